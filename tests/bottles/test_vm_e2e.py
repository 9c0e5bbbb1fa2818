"""VM bottles end to end over AMP: the daemon's real service tree against the fake smolvm.

The fake smolvm is a test double: its "VMs" are host processes that echo on their published
ports, and its ``exec`` runs on the host (with ``exec-netns``: in a network-less namespace).
"""

from __future__ import annotations

import os
import socket

from bottlenet.errors import BottlenetError, IsolationFailed, NotFound
from tests.bottles.harness import DaemonCase, in_thread
from tests.fakes import process_alive
from tests.netio import ping_tcp, ping_unix


class SocketModeTests(DaemonCase):
    async def test_create_gate_passes_bytes_flow_destroy_leaves_nothing(self) -> None:
        self.fake.set_faults("exec-netns")
        client = await self.start()
        b = await client.create_bottle("b1", spec=self.spec_json(mode="socket"))
        self.assertEqual((b.mode, b.state, b.probe), ("socket", "ready", "PASS"))
        self.assertIn("--mount-socket", b.isolation or "")
        self.assertEqual(b.warnings, ())
        self.assertEqual(b.agent_vm, "bn-b1-agent")
        vb = self.registry.list_bottles()[0].machine()
        # bytes through each agent endpoint reach the sidecar's guest service (the fake echoes)
        for ep in b.endpoints:
            assert ep.host_path is not None
            payload = b"hello " + ep.service.encode()
            self.assertEqual(await in_thread(ping_unix, ep.host_path, payload), payload)
            self.assertEqual(os.stat(os.path.dirname(ep.host_path)).st_mode & 0o777, 0o700)
        # the stamped env: agent endpoints only, never a raw port
        self.assertEqual(b.env["HTTPS_PROXY"], "http://127.0.0.1:3128")
        self.assertEqual(b.env["GIT_GATE_SOCKET"], "/run/bottle/git.sock")
        self.assertEqual(
            b.env["BOTTLENET_BRIDGES"], "3128=/run/bottle/egress.sock 9418=/run/bottle/git.sock"
        )
        creates = [a for a in self.fake.argvs() if a[:2] == ["machine", "create"]]
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
        self.assertIn("leak: tcp:127.0.0.1:", message)
        self.assertIn("torn down", message)
        self.assertEqual(self.machines(), {})
        self.assertEqual(self.fake.live_pids(), [])
        self.assertEqual(self.state_file()["bottles"], {})
        self.assertFalse(os.path.exists(os.path.join(self.state_dir, "bottles", "b1")))
        self.assertEqual((await client.list_bottles()).total, 0)


class AliasModeTests(DaemonCase):
    async def test_alias_mode_with_fallback_and_skipped_probe(self) -> None:
        client = await self.start("--alias-iptables-fallback", "--unsafe-skip-isolation-probe")
        b = await client.create_bottle("a1", spec=self.spec_json(mode="alias"), alias="127.77.0.9")
        self.assertEqual((b.mode, b.alias, b.probe), ("alias", "127.77.0.9", "skipped"))
        self.assertIn("iptables", b.isolation or "")
        self.assertIn("SKIPPED", b.isolation or "")
        self.assertTrue(any("NOT verified" in w for w in b.warnings))
        vb = self.registry.list_bottles()[0].machine()
        for ep in b.endpoints:
            host, _, port = ep.endpoint.rpartition(":")
            self.assertEqual(host, "127.77.0.9")
            self.assertEqual(await in_thread(ping_tcp, host, int(port)), b"ping")
            self.assertNotIn(int(port), vb.raw_ports)
        self.assertTrue(b.env["HTTPS_PROXY"].startswith("http://127.77.0.9:"))
        for raw in vb.raw_ports:
            self.assertFalse(any(str(raw) in v for v in b.env.values()))
        creates = [a for a in self.fake.argvs() if a[:2] == ["machine", "create"]]
        agent_argv = next(a for a in creates if "bn-a1-agent" in a)
        self.assertIn("--net", agent_argv)
        self.assertFalse(any(str(raw) in w for raw in vb.raw_ports for w in agent_argv))
        await client.destroy_bottle("a1")
        for ep in b.endpoints:
            host, _, port = ep.endpoint.rpartition(":")
            with self.assertRaises(OSError):
                socket.create_connection((host, int(port)), timeout=2).close()
        self.assertEqual(self.machines(), {})

    async def test_alias_mode_refused_without_fallback(self) -> None:
        from bottlenet.errors import IsolationUnavailable

        client = await self.start()
        with self.assertRaises(IsolationUnavailable):
            await client.create_bottle("a1", spec=self.spec_json(mode="alias"))
        self.assertEqual(self.fake.argvs().count(["machine", "create"]), 0)
        self.assertEqual(self.machines(), {})


class DegradedTests(DaemonCase):
    async def test_sidecar_crash_turns_bottle_degraded(self) -> None:
        from tests.bottles.harness import sleep

        client = await self.start("--unsafe-skip-isolation-probe")
        b = await client.create_bottle("d1", spec=self.spec_json(mode="socket"))
        vb = self.registry.list_bottles()[0].machine()
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


class RollbackThroughTheFakeTests(DaemonCase):
    """One rollback end to end (every step's rollback is unit-tested in test_rollback.py)."""

    async def test_agent_start_failure_leaves_nothing(self) -> None:
        self.fake.set_faults("exec-netns", fail_start=["bn-rb-agent"])
        client = await self.start()
        with self.assertRaises(BottlenetError) as cm:
            await client.create_bottle("rb", spec=self.spec_json(mode="socket"))
        self.assertEqual(cm.exception.code, "SMOLVM_FAILED")
        self.assertEqual(self.machines(), {})
        self.assertEqual(self.fake.live_pids(), [])
        assert self.root is not None
        self.assertEqual(self.root.table.list(), [])
        self.assertFalse(os.path.exists(os.path.join(self.state_dir, "bottles", "rb")))
        self.assertEqual(self.state_file()["bottles"], {})
        self.assertEqual((await client.list_bottles()).total, 0)
        b = await client.create_bottle("ok", spec=self.spec_json(mode="socket"))
        self.assertEqual(b.state, "ready")
