"""Integration tests: the real spawn path (real reactor) against the fake smolvm.

Everything here runs against ``tests/fakes/smolvm``, a test double; no real smolvm or KVM.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Sequence
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from tests.fakes import FAKE_SMOLVM, PLAYED, FakeSmolvmMixin, process_alive
from tests.netio import ping_tcp
from vmctl.errors import (
    AlreadyExists,
    CallTimeout,
    DeviceBudget,
    KvmUnavailable,
    NotFound,
    NotRunning,
    PortInUse,
    PortNotOwned,
    ReadinessTimeout,
    SmolvmUnavailable,
    Unavailable,
    UsageError,
)
from vmctl.ports import (
    Ownership,
    allocate_ports,
    check_port_owner,
    listening_inodes,
    start_with_raw_ports,
)
from vmctl.runner import ProcessRunner
from vmctl.service import VmctlService
from vmctl.smolvm import Smolvm, Timeouts
from vmctl.spec import MachineSpec, PortMapping, Volume

LABELS = {"owner": "bottlenet-test"}


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


class FakeSmolvmTestCase(FakeSmolvmMixin, TestCase):
    timeout = 30

    def setUp(self) -> None:
        self.setUpFake()
        self.runner = ProcessRunner(reactor, grace=1.0)
        self.smolvm = self.make()

    def tmpdir(self) -> str:
        """A fresh directory inside the fake's (removed) state dir, never in the cwd."""
        return tempfile.mkdtemp(dir=self.fake.path)

    def make(self, **kw: Any) -> Smolvm:
        kw.setdefault("environ", self.fake.environ())
        return Smolvm(self.runner, FAKE_SMOLVM, self.fake.path, **kw)

    def spec(self, name: str = "m1", ports: Sequence[int] = (), **kw: Any) -> MachineSpec:
        return MachineSpec(
            name, labels=LABELS, ports=[PortMapping(p, 8000 + i) for i, p in enumerate(ports)], **kw
        )

    def assertAllDeletesForced(self) -> None:
        deletes = [a for a in self.fake.argvs() if a[:2] == ["machine", "delete"]]
        self.assertTrue(deletes)
        for argv in deletes:
            self.assertIn("-f", argv)


class LifecycleTests(FakeSmolvmTestCase):
    async def test_full_lifecycle(self) -> None:
        v = await self.smolvm.version()
        self.assertEqual(str(v), PLAYED)
        [port] = allocate_ports(1)
        await self.smolvm.create(self.spec("m1", [port], env={"BASE": "1"}))
        pid = await self.smolvm.start("m1")
        assert pid is not None
        self.assertTrue(process_alive(pid))
        m = await self.smolvm.status("m1")
        self.assertEqual((m.state, m.pid, m.ports, m.labels), ("running", pid, 1, LABELS))
        self.assertEqual(ping_tcp("127.0.0.1", port), b"ping")
        self.assertEqual(await self.smolvm.start("m1"), pid)  # already running
        self.assertEqual([x.name for x in await self.smolvm.list(LABELS)], ["m1"])
        self.assertEqual(await self.smolvm.list({"owner": "someone-else"}), [])
        r = await self.smolvm.exec(
            "m1", ["sh", "-c", 'echo "$BASE $K"; echo err >&2; exit 3'], env={"K": "v w"}
        )
        self.assertEqual((r.exit_code, r.stdout, r.stderr), (3, b"1 v w\n", b"err\n"))
        r = await self.smolvm.exec("m1", ["cat"], stdin=b"from stdin")
        self.assertEqual((r.exit_code, r.stdout), (0, b"from stdin"))
        d = await self.smolvm.data_dir("m1")
        self.assertTrue(d.startswith(self.fake.path) and os.path.isdir(d))
        await self.smolvm.stop("m1")
        self.assertFalse(process_alive(pid))
        self.assertEqual((await self.smolvm.status("m1")).state, "stopped")
        await self.smolvm.stop("m1")  # not running: still fine
        with self.assertRaises(NotRunning):
            await self.smolvm.exec("m1", ["true"])
        pid2 = await self.smolvm.start("m1")  # restart works
        assert pid2 is not None
        await self.smolvm.delete("m1")
        self.assertFalse(process_alive(pid2))
        self.assertEqual(await self.smolvm.list(), [])
        self.assertFalse(os.path.exists(d))
        self.assertAllDeletesForced()
        self.assertEqual(self.fake.live_pids(), [])

    async def test_delete_leaves_no_vm_process(self) -> None:
        pids = []
        for name in ("a1", "a2"):
            await self.smolvm.create(self.spec(name, allocate_ports(2)))
            pid = await self.smolvm.start(name)
            assert pid is not None
            pids.append(pid)
        self.assertEqual(sorted(self.fake.live_pids()), sorted(pids))
        for name in ("a1", "a2"):
            await self.smolvm.delete(name)
        self.assertEqual([p for p in pids if process_alive(p)], [])
        self.assertEqual(self.fake.live_pids(), [])
        self.assertAllDeletesForced()

    async def test_volume_mount_counted(self) -> None:
        d = self.tmpdir()
        await self.smolvm.create(self.spec("v1", volumes=[Volume(d, "/w")]))
        self.assertEqual((await self.smolvm.status("v1")).mounts, 1)


class ErrorTests(FakeSmolvmTestCase):
    async def test_not_found(self) -> None:
        for call in (self.smolvm.start, self.smolvm.stop, self.smolvm.delete, self.smolvm.status,
                     self.smolvm.data_dir):  # fmt: skip
            with self.assertRaises(NotFound):
                await call("ghost")
        with self.assertRaises(NotFound):
            await self.smolvm.exec("ghost", ["true"])

    async def test_already_exists(self) -> None:
        await self.smolvm.create(self.spec("m1"))
        with self.assertRaises(AlreadyExists) as cm:
            await self.smolvm.create(self.spec("m1"))
        self.assertEqual(cm.exception.code, "ALREADY_EXISTS")
        self.assertIn("already exists", cm.exception.message)

    async def test_port_in_use_by_machine(self) -> None:
        [port] = allocate_ports(1)
        await self.smolvm.create(self.spec("m1", [port]))
        await self.smolvm.create(self.spec("m2", [port]))
        await self.smolvm.start("m1")
        with self.assertRaises(PortInUse) as cm:
            await self.smolvm.start("m2")
        self.assertEqual((cm.exception.port, cm.exception.holder), (port, "m1"))

    async def test_port_in_use_by_foreign_process(self) -> None:
        holder = socket.socket()
        self.addCleanup(holder.close)
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        await self.smolvm.create(self.spec("m1", [port]))
        with self.assertRaises(PortInUse) as cm:
            await self.smolvm.start("m1")
        self.assertIsNone(cm.exception.holder)
        self.assertIn("Address already in use", cm.exception.message)
        self.assertEqual((await self.smolvm.status("m1")).state, "stopped")

    async def test_kvm(self) -> None:
        await self.smolvm.create(self.spec("m1"))
        for fault in ("kvm", "kvm-denied"):
            self.fake.set_faults(fault)
            with self.assertRaises(KvmUnavailable) as cm:
                await self.smolvm.start("m1")
            self.assertNotIn("\n", cm.exception.message)

    async def test_device_budget_from_smolvm(self) -> None:
        dirs = []
        for i in range(4):
            d = self.tmpdir()
            dirs.append(Volume(d, f"/m{i}"))
        lenient = self.make(device_budget=10)
        await lenient.create(self.spec("m1", allocate_ports(1), volumes=dirs))
        with self.assertRaises(DeviceBudget) as cm:
            await lenient.start("m1")
        self.assertIn("krun_start_enter returned: -22", cm.exception.message)
        self.assertEqual(self.fake.live_pids(), [])

    async def test_device_budget_refused_before_spawn(self) -> None:
        dirs = []
        for i in range(4):
            d = self.tmpdir()
            dirs.append(Volume(d, f"/m{i}"))
        with self.assertRaises(Exception) as cm:
            await self.smolvm.create(self.spec("m1", allocate_ports(1), volumes=dirs))
        self.assertEqual(getattr(cm.exception, "code", None), "DEVICE_BUDGET")
        self.assertEqual(self.fake.calls(), [])

    async def test_readiness_timeout(self) -> None:
        self.fake.set_faults("slow-start", slow_start=5, ready_timeout=0.3)
        await self.smolvm.create(self.spec("m1", allocate_ports(1)))
        with self.assertRaises(ReadinessTimeout):
            await self.smolvm.start("m1")
        self.assertEqual(self.fake.live_pids(), [])

    async def test_call_timeout_kills_cli(self) -> None:
        self.fake.set_faults("slow-start", slow_start=5)
        slow = self.make(timeouts=Timeouts(start=0.5))
        await slow.create(self.spec("m1"))
        with self.assertRaises(CallTimeout) as cm:
            await slow.start("m1")
        self.assertEqual(cm.exception.code, "TIMEOUT")
        self.assertEqual(self.runner.in_flight, 0)
        # The CLI is gone; its half-booted VM is left to the fixture's cleanup, as with smolvm.

    async def test_crash_after_start(self) -> None:
        self.fake.set_faults("crash-after-start", crash_after=0.1)
        await self.smolvm.create(self.spec("m1"))
        pid = await self.smolvm.start("m1")
        assert pid is not None
        for _ in range(100):
            if not process_alive(pid):
                break
            await sleep(0.05)
        self.assertEqual((await self.smolvm.status("m1")).state, "stopped")
        [m] = await self.smolvm.list(LABELS)
        self.assertEqual((m.state, m.pid), ("stopped", pid))  # smolvm keeps the stale pid
        self.assertNotEqual(await self.smolvm.start("m1"), pid)  # it can be started again

    async def test_vm_ignoring_term_is_killed(self) -> None:
        self.fake.set_faults("ignore-term", stop_grace=0.2)
        await self.smolvm.create(self.spec("m1"))
        pid = await self.smolvm.start("m1")
        assert pid is not None
        await self.smolvm.stop("m1")
        self.assertFalse(process_alive(pid))

    async def test_delete_without_force_is_cancelled(self) -> None:
        """Why vmctl always passes -f: without it smolvm stops the VM, prompts, and (stdin
        closed) prints Cancelled and exits 0 without deleting anything."""
        await self.smolvm.create(self.spec("m1"))
        pid = await self.smolvm.start("m1")
        r = await self.runner.run(
            [FAKE_SMOLVM, *self.smolvm.machine_args("delete", "--name", "m1")], self.smolvm.env, 10
        )
        self.assertEqual((r.exit_code, r.stdout.splitlines()[-1]), (0, b"Cancelled"))
        self.assertIn(b"Delete machine 'm1'? [y/N]", r.stderr)
        m = await self.smolvm.status("m1")
        self.assertEqual(m.state, "stopped")
        assert pid is not None
        self.assertFalse(process_alive(pid))

    async def test_usage_error(self) -> None:
        with self.assertRaises(UsageError) as cm:
            await self.smolvm._call("create", ["--bogus"], 10)
        self.assertIn("unexpected argument", cm.exception.message)

    async def test_missing_binary(self) -> None:
        smolvm = Smolvm(self.runner, "/nonexistent/smolvm", environ={})
        with self.assertRaises(SmolvmUnavailable):
            await smolvm.version()

    async def test_old_fake_version(self) -> None:
        self.fake.set_faults(version="1.7.7")
        with self.assertRaises(Exception) as cm:
            await self.smolvm.start("m1")
        self.assertEqual(getattr(cm.exception, "code", None), "UNSUPPORTED_VERSION")
        self.assertEqual(self.fake.argvs(), [["--version"]])


class EnvironmentTests(FakeSmolvmTestCase):
    async def test_hostile_inherited_environment_never_reaches_smolvm(self) -> None:
        hostile = {
            "SMOLVM_PUBLISH_ADDR": "0.0.0.0",
            "SMOLVM_EGRESS_FLOOR": "off",
            "SMOLVM_EGRESS_ALLOW_PRIVATE": "1",
            "FAKE_SMOLVM_FAIL": "kvm",
            "LD_PRELOAD": "",
            "SOME_SECRET": "hunter2",
        }
        saved = {k: os.environ.get(k) for k in hostile}
        os.environ.update(hostile)
        try:
            smolvm = Smolvm(self.runner, FAKE_SMOLVM, self.fake.path)  # environ from os.environ
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        os.environ.update({"SMOLVM_PUBLISH_ADDR": "0.0.0.0"})
        self.addCleanup(os.environ.pop, "SMOLVM_PUBLISH_ADDR", None)
        [port] = allocate_ports(1)
        await smolvm.create(self.spec("m1", [port]))
        await smolvm.start("m1")  # FAKE_SMOLVM_FAIL=kvm did not get through either
        calls = self.fake.calls()
        self.assertEqual(len(calls), 5)  # --version, two --help, create, start
        allowed = {"PATH", "HOME", "LANG", "TMPDIR", "XDG_RUNTIME_DIR", "SMOLVM_DATA_DIR"}
        for call in calls:
            # Machine calls get smolvm's state as --state-dir, never through the environment
            # (--version and --help, made before the CLI is known, get SMOLVM_DATA_DIR).
            smolvm_keys = sorted(k for k in call["env"] if k.startswith("SMOLVM_"))
            if call["argv"][-1] != "--help" and call["argv"][0] == "machine":
                self.assertIn(self.fake.path, call["argv"])
                self.assertEqual(smolvm_keys, [])
            else:
                self.assertEqual(smolvm_keys, ["SMOLVM_DATA_DIR"])
            # (an interpreter shim such as pyenv's may add its own PYENV_*/PWD/SHLVL keys)
            self.assertEqual(set(call["env_keys"]) & set(hostile), set())
        self.assertTrue(set(smolvm.env) <= allowed | {k for k in smolvm.env if k[:3] == "LC_"})
        self.assertEqual(set(listening_inodes(port).values()) - {"::1"}, {"127.0.0.1"})

    async def test_data_dir_only_when_configured(self) -> None:
        smolvm = Smolvm(self.runner, FAKE_SMOLVM, None, environ=self.fake.environ(),
                        check_version=False)  # fmt: skip
        # Without SMOLVM_DATA_DIR the fake falls back to $HOME/.fake-smolvm.
        await smolvm.list()
        log = os.path.join(self.fake.path, ".fake-smolvm", "calls.jsonl")
        with open(log) as f:
            self.assertNotIn("SMOLVM_DATA_DIR", f.read())


class RawPortTests(FakeSmolvmTestCase):
    def factory(self, name: str = "side") -> Any:
        return lambda ports: self.spec(name, ports)

    async def test_allocate_start_verify(self) -> None:
        result = await start_with_raw_ports(self.smolvm, self.factory(), 3)
        self.assertEqual(result.attempts, 1)
        self.assertTrue(result.verified)
        self.assertEqual(len(set(result.ports)), 3)
        self.assertEqual([c.ownership for c in result.checks], [Ownership.OWNED] * 3)
        for p in result.ports:
            self.assertEqual(ping_tcp("127.0.0.1", p), b"ping")
        self.assertEqual((await self.smolvm.status("side")).pid, result.pid)

    async def test_retry_on_reported_collision(self) -> None:
        self.fake.set_faults(port_clash=1)
        result = await start_with_raw_ports(self.smolvm, self.factory(), 2)
        self.assertEqual(result.attempts, 2)
        subs = [a[1] for a in self.fake.argvs() if a[0] == "machine" and a[-1] != "--help"]
        # the machine that lost the race is stopped before it is deleted (no orphan VMM)
        self.assertEqual(subs[:5], ["create", "start", "stop", "delete", "create"])
        self.assertAllDeletesForced()
        self.assertTrue(result.verified)

    async def test_retry_after_toctou(self) -> None:
        thief = socket.socket()
        self.addCleanup(thief.close)
        thief.bind(("127.0.0.1", 0))
        thief.listen(1)
        stolen = thief.getsockname()[1]
        batches = [[stolen], allocate_ports(1)]
        result = await start_with_raw_ports(
            self.smolvm, self.factory(), 1, allocate=lambda n: batches.pop(0)
        )
        self.assertEqual(result.attempts, 2)
        self.assertNotEqual(result.ports, (stolen,))
        self.assertTrue(result.verified)

    async def test_retries_bounded(self) -> None:
        self.fake.set_faults(port_clash=5)
        with self.assertRaises(PortInUse) as cm:
            await start_with_raw_ports(self.smolvm, self.factory(), 1, attempts=2)
        self.assertIn("after 2 attempts", cm.exception.message)
        self.assertEqual(await self.smolvm.list(), [])
        self.assertAllDeletesForced()

    async def test_foreign_owner_refused(self) -> None:
        # The VM gets 127.0.0.1:P, but a foreign process already holds [::1]:P.
        thief = socket.socket(socket.AF_INET6)
        self.addCleanup(thief.close)
        thief.bind(("::1", 0))
        thief.listen(1)
        port = thief.getsockname()[1]
        with self.assertRaises(PortNotOwned) as cm:
            await start_with_raw_ports(self.smolvm, self.factory(), 1, allocate=lambda n: [port])
        self.assertEqual(cm.exception.code, "PORT_NOT_OWNED")
        self.assertIn("foreign", cm.exception.message)
        self.assertEqual(await self.smolvm.list(), [])  # rolled back
        self.assertEqual(self.fake.live_pids(), [])

    async def test_check_port_owner(self) -> None:
        listener = socket.socket()
        self.addCleanup(listener.close)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        self.assertEqual(check_port_owner(port, os.getpid()).ownership, Ownership.OWNED)
        await self.smolvm.create(self.spec("m1"))
        vm = await self.smolvm.start("m1")
        assert vm is not None
        c = check_port_owner(port, vm)
        self.assertEqual(c.ownership, Ownership.FOREIGN)
        self.assertFalse(c.owned)
        listener.close()
        self.assertEqual(check_port_owner(port, vm).ownership, Ownership.NOT_LISTENING)
        self.assertEqual(
            check_port_owner(port, vm, proc="/nonexistent").ownership, Ownership.UNVERIFIABLE
        )


class ServiceTests(FakeSmolvmTestCase):
    async def until(self, cond: Any, what: str, seconds: float = 30.0) -> None:
        """Poll ``cond`` every 20 ms (returns as soon as it holds; the bound only stops a hang)."""
        for _ in range(int(seconds / 0.02)):
            if cond():
                return
            await sleep(0.02)
        self.fail(f"timed out waiting for {what}")

    async def test_stop_service_kills_calls_past_deadline(self) -> None:
        await self.smolvm.create(self.spec("m1"))
        vm = await self.smolvm.start("m1")
        service = VmctlService(self.runner, stop_deadline=0.2)
        service.startService()
        d = self.smolvm.exec("m1", ["sleep", "30"])
        # Wait for the event (the guest command is running), not for a guessed time.
        await self.until(lambda: len(self.fake.live_pids()) == 2, "the exec's guest command")
        await service.stopService()
        with self.assertRaises(Unavailable):
            await d
        self.assertEqual(self.runner.in_flight, 0)
        # The guest command dies with its CLI; a killed process can stay visible for a moment.
        await self.until(lambda: self.fake.live_pids() == [vm], "the guest command to die")
        with self.assertRaises(Unavailable):
            await self.smolvm.list()
