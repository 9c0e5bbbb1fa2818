"""VM bottles end to end over AMP: the daemon's real service tree against the fake smolvm.

The fake smolvm is a test double: its "VMs" are host processes that echo on their published
ports, and its ``exec`` runs on the host (with ``exec-netns``: in a network-less namespace).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import tempfile

from bottlenet.bottles import readiness
from bottlenet.bottles.store import JOURNAL_FILE, STATE_FILE
from bottlenet.errors import BottlenetError, IsolationFailed, NotFound
from bottlenet.paths import LOCK_NAME
from tests.bottles.harness import DaemonCase, in_thread, sleep, spec_doc
from tests.fakes import process_alive
from tests.netio import ping_unix

#: A directory's POSIX access ACL (``volumeaccess``'s grants).
ACL = "system.posix_acl_access"

#: How long the sidecar readiness probe holds a connection to count its service as answering
#: (``readiness.SETTLE``, 0.25 s a round, the services tried together, in every create here). The
#: fake's services never drop a connection, so a shorter hold cannot fail a create that passes;
#: the rule itself is tests/bottles/test_readiness.py's.
SETTLE = 0.01


class E2ECase(DaemonCase):
    """``DaemonCase`` with the readiness probe's hold at :data:`SETTLE`."""

    def setUp(self) -> None:
        super().setUp()
        self.patch(readiness, "SETTLE", SETTLE)


class SocketModeTests(E2ECase):
    async def test_create_gate_passes_bytes_flow_destroy_leaves_nothing(self) -> None:
        self.fake.set_faults("exec-netns")
        client = await self.start()
        b = await client.create_bottle("b1", spec=self.spec_json(mode="socket"))
        self.assertEqual((b.mode, b.state, b.probe), ("socket", "ready", "PASS"))
        self.assertIn("--mount-socket", b.isolation or "")
        self.assertEqual(b.warnings, ())
        self.assertEqual(b.agent_vm, "bn-b1-agent")
        vb = self.registry.list_bottles()[0].require_vms()
        # bytes through each agent endpoint reach the sidecar's guest service (the fake echoes)
        for ep in b.endpoints:
            assert ep.host_path is not None
            payload = b"hello " + ep.service.encode()
            self.assertEqual(await in_thread(ping_unix, ep.host_path, payload), payload)
            # 0701 as root: the per-VM uids pass through to their own sockets, never list
            mode = 0o701 if os.geteuid() == 0 else 0o700
            self.assertEqual(os.stat(os.path.dirname(ep.host_path)).st_mode & 0o777, mode)
        # the stamped env: agent endpoints only, never a raw port
        self.assertEqual(b.env["HTTPS_PROXY"], "http://127.0.0.1:3128")
        self.assertEqual(b.env["GIT_GATE_SOCKET"], "/run/bottle/git.sock")
        self.assertEqual(
            b.env["BOTTLENET_BRIDGES"], "3128=/run/bottle/egress.sock 9418=/run/bottle/git.sock"
        )
        creates = [
            a for a in self.fake.argvs() if a[:2] == ["machine", "create"] and a[-1] != "--help"
        ]
        agent_argv = next(a for a in creates if "bn-b1-agent" in a)
        for raw in vb.raw_ports:
            for value in b.env.values():
                self.assertNotIn(str(raw), value)
            self.assertFalse(any(str(raw) in word for word in agent_argv))
        self.assertNotIn("--net", agent_argv)
        self.assertEqual(agent_argv.count("--mount-socket"), 2)
        # every create carries the three labels
        for argv in creates:
            self.assertIn(f"bottlenet.owner={self.registry.instance_id}", argv)
            self.assertIn("bottlenet.bottle=b1", argv)
            self.assertTrue({"bottlenet.role=sidecar", "bottlenet.role=agent"} & set(argv))
        # the policy file was written through exec, one host per line
        with open(os.path.join(self.tmp, "policy.txt")) as f:
            self.assertEqual(f.read(), "pypi.org\n*.github.com\n")
        self.assertIn("b1", self.state_file()["bottles"])
        # verify runs the probe again
        _, result = await client.verify_bottle("b1")
        self.assertEqual(result, "PASS")

        await client.destroy_bottle("b1")
        for ep in b.endpoints:
            assert ep.host_path is not None
            self.assertFalse(os.path.exists(ep.host_path))
        self.assertFalse(os.path.exists(os.path.join(self.state_dir, "bottles", "b1")))
        self.assertEqual(self.machines(), {})
        self.assertEqual(self.fake.live_pids(), [])
        self.assertEqual(self.state_file()["bottles"], {})
        deletes = [a for a in self.fake.argvs() if a[:2] == ["machine", "delete"]]
        self.assertTrue(deletes)
        self.assertTrue(all("-f" in a for a in deletes))
        with self.assertRaises(NotFound):
            await client.bottle_status("b1")

    async def test_gate_fails_against_the_non_isolating_fake(self) -> None:
        client = await self.start()
        with self.assertRaises(IsolationFailed) as cm:
            await client.create_bottle("b1", spec=self.spec_json(mode="socket"))
        message = str(cm.exception)
        # the fake's "guest" is the host: its /run/bottle endpoints do not exist there
        self.assertIn("own endpoint unix:/run/bottle/egress.sock does not connect", message)
        self.assertIn("torn down", message)
        self.assertEqual(self.machines(), {})
        self.assertEqual(self.fake.live_pids(), [])
        self.assertEqual(self.state_file()["bottles"], {})
        self.assertFalse(os.path.exists(os.path.join(self.state_dir, "bottles", "b1")))
        self.assertEqual((await client.list_bottles()).total, 0)


class AliasModeTests(E2ECase):
    async def test_alias_mode_fails_closed_with_the_reason(self) -> None:
        from bottlenet.errors import IsolationUnavailable

        client = await self.start("--unsafe-skip-isolation-probe")
        with self.assertRaises(IsolationUnavailable) as cm:
            await client.create_bottle("a1", spec=self.spec_json(mode="alias"))
        self.assertIn("alias mode cannot be enforced by smolvm", str(cm.exception))
        creates = [a for a in self.fake.argvs() if a[1:2] == ["create"] and a[-1] != "--help"]
        self.assertEqual(creates, [])
        self.assertEqual(self.machines(), {})


class SidecarSocketTests(E2ECase):
    """Sidecar services on exposed UNIX sockets in the bottle's 0700 directory (default)."""

    async def test_no_sidecar_tcp_and_other_uids_cannot_connect(self) -> None:
        self.fake.set_faults("exec-netns")
        client = await self.start()
        b = await client.create_bottle("s1", spec=self.spec_json(mode="socket"))
        vb = self.registry.list_bottles()[0].require_vms()
        self.assertEqual(vb.raw_ports, ())
        self.assertNotIn("raw TCP", b.isolation or "")
        creates = [a for a in self.fake.argvs() if a[1:2] == ["create"] and a[-1] != "--help"]
        sidecar_argv = next(a for a in creates if "bn-s1-sidecar" in a)
        self.assertNotIn("--port", sidecar_argv)
        self.assertEqual(sidecar_argv.count("--expose-socket"), 2)
        self.assertIn("--block-private", sidecar_argv)
        # the sidecar's VM process holds no TCP listener at all
        self.assertEqual(_tcp_listeners_of(vb.sidecar_pid), [])
        paths = [*vb.sidecar_sockets, *(e.host_path for e in b.endpoints if e.host_path)]
        self.assertEqual(len(paths), 4)
        for path in paths:
            self.assertTrue(path.startswith(os.path.join(self.state_dir, "bottles", "s1") + "/"))
            # bytes flow for the daemon's own uid ...
            self.assertEqual(await in_thread(ping_unix, path, b"mine"), b"mine")
        # ... and another local uid cannot connect to any of them
        if os.geteuid() != 0:
            self.skipTest("needs root to act as another uid")
        self.assertEqual(await in_thread(_connect_as, 65534, paths), [])
        await client.destroy_bottle("s1")

    async def test_per_vm_uids_carry_bytes_and_admit_only_their_own_vmm(self) -> None:
        """Issue 19, as root under smolvm's per-VM uids (the fake's ``uid-drop``): each VMM
        runs as the uid reserved for it; bytes flow from the agent VMM's uid through its own
        endpoints to the sidecar (the gate itself goes that way); no other uid reaches them."""
        if os.geteuid() != 0:
            self.skipTest("smolvm drops to per-VM uids only as root")
        self.fake.set_faults("exec-netns", "uid-drop")
        client = await self.start()
        bottles = {n: await client.create_bottle(n, spec=self.spec_json()) for n in ("u1", "u2")}
        uids = {n: {r: self.vmm_uid(f"bn-{n}-{r}") for r in ("agent", "sidecar")} for n in bottles}
        every = [u for pair in uids.values() for u in pair.values()]
        self.assertEqual(len(set(every)), 4)
        self.assertTrue(all(u >= 2_000_000 for u in every))
        own = {n: [e.host_path for e in b.endpoints if e.host_path] for n, b in bottles.items()}
        behind = {
            n: list(self.registry.get_bottle(n).require_vms().sidecar_sockets) for n in bottles
        }
        # the daemon's own state stays closed to every VMM uid (asked with each uid's others)
        state_files = [
            os.path.join(self.state_dir, f) for f in (STATE_FILE, JOURNAL_FILE, LOCK_NAME)
        ]
        self.assertTrue(all(os.path.exists(f) for f in state_files))
        closed = (("read", state_files), ("echo", [self.control]))
        for n in bottles:
            agent, sidecar = uids[n]["agent"], uids[n]["sidecar"]
            other = "u2" if n == "u1" else "u1"
            # one process per uid (setpriv), for all of that uid's tries
            mine, theirs, *state = await in_thread(
                _as_uid, agent, ("echo", own[n]), ("echo", own[other] + behind[n]), *closed
            )
            # bytes both ways through each own endpoint, as the agent VMM's uid
            self.assertEqual(mine, own[n])
            # ... and not into the other bottle, nor into its own sidecar's socket directory
            self.assertEqual(theirs, [])
            self.assertEqual(state, [[], []])
            # the sidecar's uid has no business at the agent endpoints
            agents, *state = await in_thread(
                _as_uid, sidecar, ("echo", own[n] + own[other]), *closed
            )
            self.assertEqual(agents, [])
            self.assertEqual(state, [[], []])
            self.assertEqual(await in_thread(_echo_as, 65534, own[n] + behind[n]), [])
            # the sidecar VMM created its sockets itself, as its uid, in a directory of its own
            for path in behind[n]:
                self.assertEqual(os.lstat(path).st_uid, sidecar)
                self.assertEqual(os.stat(os.path.dirname(path)).st_mode & 0o777, 0o700)
        for n in bottles:
            await client.destroy_bottle(n)
        registry = os.path.join(self.fake.path, ".cache", "smolvm", "uids")
        self.assertEqual([e for e in os.listdir(registry) if e.isdigit()], [])

    async def test_endpoints_refuse_a_foreign_uid_by_its_credentials(self) -> None:
        """The SO_PEERCRED check alone: an endpoint whose file mode were opened to everyone
        still resets uid 65534 and another bottle's VMM uid, and serves its own VMM's uid."""
        if os.geteuid() != 0:
            self.skipTest("smolvm drops to per-VM uids only as root")
        self.fake.set_faults("exec-netns", "uid-drop")
        client = await self.start()
        b = await client.create_bottle("p1", spec=self.spec_json())
        paths = [e.host_path for e in b.endpoints if e.host_path]
        for path in paths:
            os.chmod(path, 0o666)
        agent = self.vmm_uid("bn-p1-agent")
        self.assertEqual(await in_thread(_echo_as, agent, paths), paths)
        for stranger in (65534, agent + 1000):
            self.assertEqual(await in_thread(_echo_as, stranger, paths), [])
        await client.destroy_bottle("p1")

    async def test_per_vm_uid_grants_are_restored_after_a_restart(self) -> None:
        """A restarted daemon re-binds the endpoints and grants them to the agent VMM's uid
        again (the uid kept in its record, checked against smolvm's registry, never its
        ``.vm-uid``): that uid still gets its bytes back, the peer check
        still resets a stranger."""
        if os.geteuid() != 0:
            self.skipTest("smolvm drops to per-VM uids only as root")
        self.fake.set_faults("exec-netns", "uid-drop")
        client = await self.start()
        b = await client.create_bottle("r1", spec=self.spec_json())
        paths = [e.host_path for e in b.endpoints if e.host_path]
        await self.stop()
        client = await self.start()
        self.assertEqual((await client.bottle_status("r1")).state, "ready")
        agent = self.vmm_uid("bn-r1-agent")
        self.assertEqual(await in_thread(_echo_as, agent, paths), paths)
        for path in paths:
            os.chmod(path, 0o666)
        self.assertEqual(await in_thread(_echo_as, 65534, paths), [])
        await client.destroy_bottle("r1")

    async def test_per_vm_uids_get_a_root_owned_rw_volume_and_give_it_back(self) -> None:
        """A read-write volume owned by root, 0755: the agent VMM's uid gets one ACL entry on
        it before its start (the fake serves the volume as that uid), so the gate's round trip
        passes; destroying the bottle removes the entry (issue 27, fidelity.md #2)."""
        if os.geteuid() != 0:
            self.skipTest("smolvm drops to per-VM uids only as root")
        self.fake.set_faults("exec-netns", "uid-drop")
        vol = tempfile.mkdtemp(prefix="bnv-", dir="/var/tmp")
        self.addCleanup(shutil.rmtree, vol, True)
        os.chmod(vol, 0o755)
        doc = spec_doc(self.tmp)
        doc["agent"]["volumes"] = [f"{vol}:/tmp/work:rw"]
        client = await self.start()
        b = await client.create_bottle("v1", spec=json.dumps(doc))
        self.assertEqual(b.probe, "PASS")
        agent = self.vmm_uid("bn-v1-agent")
        self.assertIn(struct.pack("<HHI", 2, 7, agent), os.getxattr(vol, ACL))
        st = os.stat(vol)
        self.assertEqual((st.st_uid, st.st_gid, st.st_mode & 0o707), (0, 0, 0o705))
        await client.destroy_bottle("v1")
        with self.assertRaises(OSError):
            os.getxattr(vol, ACL)
        self.assertEqual(os.stat(vol).st_mode & 0o777, 0o755)

    async def test_a_failed_create_takes_its_volume_grant_back(self) -> None:
        """The grant is made before the agent's start; a create that fails after it (the
        agent's start) leaves the user's directory as it was."""
        if os.geteuid() != 0:
            self.skipTest("smolvm drops to per-VM uids only as root")
        self.fake.set_faults("exec-netns", "uid-drop", fail_start=["bn-v3-agent"])
        vol = tempfile.mkdtemp(prefix="bnv-", dir="/var/tmp")
        self.addCleanup(shutil.rmtree, vol, True)
        os.chmod(vol, 0o755)
        doc = spec_doc(self.tmp)
        doc["agent"]["volumes"] = [f"{vol}:/tmp/work:rw"]
        client = await self.start()
        with self.assertRaises(BottlenetError) as info:
            await client.create_bottle("v3", spec=json.dumps(doc))
        self.assertEqual(info.exception.code, "KVM_UNAVAILABLE")
        with self.assertRaises(OSError):
            os.getxattr(vol, ACL)
        self.assertEqual(os.stat(vol).st_mode & 0o777, 0o755)
        self.assertEqual(self.fake.state()["machines"], {})

    async def test_per_vm_uids_refuse_a_volume_they_cannot_reach(self) -> None:
        """A volume under a directory no VMM uid can pass: refused in one line naming the
        volume, that directory and the fix, before any machine exists."""
        if os.geteuid() != 0:
            self.skipTest("smolvm drops to per-VM uids only as root")
        self.fake.set_faults("exec-netns", "uid-drop")
        closed = tempfile.mkdtemp(prefix="bnc-", dir="/var/tmp")  # 0700, as /root is
        self.addCleanup(shutil.rmtree, closed, True)
        vol = os.path.join(closed, "work")
        os.mkdir(vol)
        doc = spec_doc(self.tmp)
        doc["agent"]["volumes"] = [f"{vol}:/tmp/work:rw"]
        client = await self.start()
        with self.assertRaises(BottlenetError) as info:
            await client.create_bottle("v2", spec=json.dumps(doc))
        self.assertEqual(info.exception.code, "INVALID_ARGUMENT")
        self.assertIn(f"agent.volumes[0] {vol!r}", info.exception.message)
        self.assertIn(f"chmod o+x {closed!r}", info.exception.message)
        self.assertEqual(self.fake.state()["machines"], {})
        creates = [a for a in self.fake.argvs() if a[1:2] == ["create"] and a[-1] != "--help"]
        self.assertEqual(creates, [])

    async def test_per_vm_uids_refuse_a_state_dir_they_cannot_reach(self) -> None:
        """A parent of the state dir no VMM uid can pass (and smolvm will not open): the
        sidecar VMM cannot create its sockets, the create fails saying which parent, and
        nothing is left."""
        if os.geteuid() != 0:
            self.skipTest("smolvm drops to per-VM uids only as root")
        self.fake.set_faults("exec-netns", "uid-drop")
        os.chmod(self.tmp, 0o700)
        client = await self.start()
        with self.assertRaises(BottlenetError) as info:
            await client.create_bottle("u1", spec=self.spec_json(mode="socket"))
        self.assertEqual(info.exception.code, "ISOLATION_UNAVAILABLE")
        self.assertIn(
            f"could not reach its socket directory: {self.tmp!r} has no o+x", info.exception.message
        )
        self.assertEqual(self.registry.list_bottles(), [])
        self.assertFalse(os.path.exists(os.path.join(self.state_dir, "bottles", "u1")))
        self.assertEqual(self.fake.state()["machines"], {})
        uids = os.path.join(self.fake.path, ".cache", "smolvm", "uids")
        self.assertFalse(os.path.isdir(uids) and [n for n in os.listdir(uids) if n.isdigit()])

    def vmm_uid(self, machine: str) -> int:
        """The uid the fake's "VMM" of ``machine`` dropped to (its ``.vm-uid``)."""
        with open(os.path.join(self.fake.vm_dir(machine), ".vm-uid")) as f:
            return int(f.read())

    async def test_raw_port_opt_in_says_local_users_can_reach_it(self) -> None:
        self.fake.set_faults("exec-netns")
        client = await self.start()
        b = await client.create_bottle("t1", spec=self.spec_json(mode="socket", listen="tcp"))
        vb = self.registry.list_bottles()[0].require_vms()
        self.assertEqual(len(vb.raw_ports), 2)
        self.assertIn("every local user can connect", b.isolation or "")
        for ep in b.endpoints:
            assert ep.host_path is not None
            self.assertEqual(await in_thread(ping_unix, ep.host_path, b"tcp"), b"tcp")
        await client.destroy_bottle("t1")


class EntrypointOrderTests(E2ECase):
    async def test_entrypoint_never_runs_and_workload_starts_after_the_gate(self) -> None:
        """The agent image's ENTRYPOINT records when it starts; it must never start (the
        wait command replaces it), and the workload must start after the gate's exec."""
        self.fake.set_faults("exec-netns")
        # not under /tmp: the exec-netns stand-in gives its "guest" a /tmp of its own
        marks = tempfile.mkdtemp(prefix="bnm-", dir="/var/tmp")
        self.addCleanup(shutil.rmtree, marks, True)
        image = os.path.join(self.tmp, "agent.tar")
        with open(image, "wb") as f:
            f.write(b"\0" * 1024)
        record = [
            "/bin/sh",
            "-c",
            f'date +%s.%N > {marks}/"$0".t && mv {marks}/"$0".t {marks}/"$0"',
        ]
        self.fake.set_images({image: {"entrypoint": [*record, "entrypoint"]}})
        client = await self.start()
        await client.create_bottle(
            "e1", spec=self.spec_json(mode="socket", workload=(*record, "workload"))
        )
        for _ in range(250):
            if os.path.exists(os.path.join(marks, "workload")):
                break
            await sleep(0.02)
        self.assertFalse(os.path.exists(os.path.join(marks, "entrypoint")))
        with open(os.path.join(marks, "workload")) as f:
            workload_at = float(f.read())
        calls = self.fake.calls()
        # data-dir (the per-VM uid reservation, as root) is a query, not a step of the VM
        agent_calls = [
            c for c in calls if "bn-e1-agent" in c["argv"] and c["argv"][1] != "data-dir"
        ]
        subs = [c["argv"][1] for c in agent_calls]
        self.assertEqual(subs[:3], ["create", "start", "exec"])  # create, start, gate
        create_argv = agent_calls[0]["argv"]
        # bottlenet's wait command: the guest kit's (the image may have no sleep)
        self.assertEqual(create_argv[-2:], ["/run/bottlenet-kit/app/main.pyc", "idle"])
        # then the image's USER read (no -u), the workload's prepare step (its dir, its
        # command), then the workload (detached); bottlenet's own as the guest's root
        gate, who, check, workload = agent_calls[2:6]
        self.assertNotIn("--user", who["argv"])
        for own in (gate, check, workload):
            self.assertIn("--user 0:0", " ".join(own["argv"]))
        self.assertIn("-d", workload["argv"])
        self.assertNotIn("-d", gate["argv"])
        self.assertNotIn("-d", check["argv"])
        self.assertEqual(check["argv"][-4:-2], ["workload", "prepare"])
        self.assertLess(gate["time"], check["time"])
        self.assertLess(check["time"], workload["time"])
        self.assertLess(gate["time"], workload_at)
        await client.destroy_bottle("e1")

    async def test_workload_runs_as_the_spec_user(self) -> None:
        if os.geteuid() != 0:
            self.skipTest("the fake drops to a numeric user only as root")
        self.fake.set_faults("exec-netns")
        drop = tempfile.mkdtemp(prefix="bnu-", dir="/var/tmp")  # the guest's /tmp is its own
        self.addCleanup(shutil.rmtree, drop, True)
        os.chmod(drop, 0o777)
        out = os.path.join(drop, "whoami")
        client = await self.start("--unsafe-skip-isolation-probe")
        workload = ("/bin/sh", "-c", f"id -u > {out}.tmp; mv {out}.tmp {out}")
        await client.create_bottle(
            "u1", spec=self.spec_json(mode="socket", workload=workload, user="65534:65534")
        )
        for _ in range(250):
            if os.path.exists(out):
                break
            await sleep(0.02)
        with open(out) as f:
            self.assertEqual(f.read().strip(), "65534")
        exec_d = [a for a in self.fake.argvs() if a[1:2] == ["exec"] and "-d" in a]
        self.assertIn("65534:65534", exec_d[-1])
        await client.destroy_bottle("u1")


def _tcp_listeners_of(pid: int) -> list[int]:
    from vmctl.ports import socket_inodes

    mine = socket_inodes(pid)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[9]) in mine:
                    found.append(int(fields[1].rpartition(":")[2], 16))
    return found


def _connect_as(uid: int, paths: list[str]) -> list[str]:
    """Paths another uid could connect to (a forked child drops to ``uid`` and tries)."""
    import subprocess
    import sys

    code = (
        "import os, socket, sys\n"
        f"os.setgroups([]); os.setgid({uid}); os.setuid({uid})\n"
        "ok = []\n"
        "for p in sys.argv[1:]:\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        "    try:\n"
        "        s.connect(p); ok.append(p)\n"
        "    except OSError:\n"
        "        pass\n"
        "    s.close()\n"
        "print('\\n'.join(ok))\n"
    )
    r = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True,
                       timeout=30, check=True)  # fmt: skip
    return [line for line in r.stdout.splitlines() if line]


_AS_UID = (
    "import socket, sys\n"
    "payload = b'as-uid'\n"
    "group, what = -1, None\n"
    "for p in sys.argv[1:]:\n"
    "    if p in ('echo', 'read'):\n"
    "        group, what = group + 1, p\n"
    "        continue\n"
    "    s = socket.socket(socket.AF_UNIX)\n"
    "    s.settimeout(10)\n"
    "    try:\n"
    "        if what == 'read':\n"
    "            open(p, 'rb').close(); print(group, p)\n"
    "            continue\n"
    "        s.connect(p); s.sendall(payload); s.shutdown(socket.SHUT_WR)\n"
    "        got = b''\n"
    "        while chunk := s.recv(4096):\n"
    "            got += chunk\n"
    "        if got == payload:\n"
    "            print(group, p)\n"
    "    except OSError:\n"
    "        pass\n"
    "    finally:\n"
    "        s.close()\n"
)


def _as_uid(uid: int, *jobs: tuple[str, list[str]]) -> list[list[str]]:
    """Run the probe above as ``uid`` (``setpriv``, no groups) with the system python, one
    process for every job (``echo`` or ``read``, and its paths): each job's paths that
    passed."""
    import subprocess

    argv = [word for what, paths in jobs for word in (what, *paths)]
    r = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/usr/bin/python3",
         "-c", _AS_UID, *argv],
        capture_output=True, text=True, timeout=60, check=True, cwd="/",
    )  # fmt: skip
    passed: list[list[str]] = [[] for _ in jobs]
    for line in r.stdout.splitlines():
        group, _, path = line.partition(" ")
        passed[int(group)].append(path)
    return passed


def _echo_as(uid: int, paths: list[str]) -> list[str]:
    """The paths where ``uid`` connected and got its bytes back (the fake's sidecar echoes)."""
    return _as_uid(uid, ("echo", paths))[0]


class DegradedTests(E2ECase):
    async def test_sidecar_crash_turns_bottle_degraded(self) -> None:
        from tests.bottles.harness import sleep

        client = await self.start("--unsafe-skip-isolation-probe")
        b = await client.create_bottle("d1", spec=self.spec_json(mode="socket"))
        vb = self.registry.list_bottles()[0].require_vms()
        ep = b.endpoints[0].host_path
        assert ep is not None
        held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        held.connect(ep)
        self.addCleanup(held.close)
        held.sendall(b"x")
        self.assertEqual(await in_thread(held.recv, 1), b"x")  # the relay is live
        os.kill(vb.sidecar_pid, 9)
        for _ in range(250):
            if self.registry.list_bottles()[0].state == "degraded":
                break
            await sleep(0.02)
        status = await client.bottle_status("d1")
        self.assertEqual(status.state, "degraded")
        self.assertIn("sidecar", status.detail or "")
        self.assertFalse(os.path.exists(ep))  # new connections are refused
        held.settimeout(5)
        self.assertEqual(await in_thread(held.recv, 10), b"")  # the live relay was reset
        self.assertEqual(self.state_file()["bottles"]["d1"]["state"], "degraded")
        self.assertFalse(process_alive(vb.sidecar_pid))
        await client.destroy_bottle("d1")  # teardown copes with the dead sidecar
        self.assertEqual(self.machines(), {})
