"""Unit tests for vmctl.smolvm against a scripted fake process reactor."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from tests.fakes import FAKE_SMOLVM
from tests.vmctl.fakereactor import FakeProcessReactor, scripted
from vmctl import sessionend
from vmctl.errors import (
    CallTimeout,
    InvalidArgument,
    KvmUnavailable,
    NotFound,
    NotRunning,
    SmolvmFailed,
    SmolvmUnavailable,
    UnsupportedVersion,
    UsageError,
)
from vmctl.runner import ProcessRunner
from vmctl.smolvm import (
    SUBCOMMANDS,
    Features,
    Machine,
    Smolvm,
    SmolvmVersion,
    Timeouts,
    VmmSeen,
    VmUids,
    subcommand_of,
    vm_dir_of,
    vmm_uid_of,
)
from vmctl.spec import MachineSpec, PortMapping

BIN = FAKE_SMOLVM  # exists; the fake reactor never runs it


def rec(name: str, **kw: object) -> dict[str, object]:
    base: dict[str, object] = {
        "name": name, "state": "running", "pid": 77, "labels": {}, "ports": 1, "mounts": 0,
        "ephemeral": False, "network": True, "image": None, "cpus": 4, "memory_mib": 8192,
        "created_at": 1,
    }  # fmt: skip
    base.update(kw)
    return base


#: ``--help`` texts: a 1.9.2-like CLI (the 1.8.0 floor and nothing later) by default.
HELP_19 = {"create": b"  -n, --name <NAME>\n  --label <KEY=VALUE>\n  --mount-socket <H:G>\n",
           "exec": b"  --name <NAME>\n  -e, --env <KEY=VALUE>\n"}  # fmt: skip
HELP_132 = {
    "create": HELP_19["create"] + b"  --error-format <F>\n  --state-dir <PATH>\n"
    b"  --expose-socket <G[:H]>\n  -u, --user <USER>\n  --block-private\n",
    "exec": HELP_19["exec"] + b"  --error-format <F>\n  --state-dir <PATH>\n"
    b"  --timeout <DURATION>\n  -u, --user <USER>\n",
}


class Script:
    """Answers smolvm argv with canned (code, stdout, stderr); records every argv."""

    def __init__(self, version: bytes = b"smolvm 1.9.2\n", helps: dict[str, bytes] = HELP_19):
        self.version = version
        self.helps = helps
        self.answers: dict[str, tuple[int, bytes, bytes]] = {}
        self.seen: list[list[str]] = []

    def __call__(self, args: list[str]) -> tuple[int, bytes, bytes]:
        self.seen.append(args)
        if args == ["--version"]:
            return 0, self.version, b""
        if args[-1:] == ["--help"]:
            return 0, self.helps[args[1]], b""
        key = " ".join(args[:2])
        return self.answers.get(key, (0, b"", b""))

    @property
    def machine_calls(self) -> list[list[str]]:
        return [a for a in self.seen if a[:1] == ["machine"] and a[-1:] != ["--help"]]


class SmolvmUnitTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.script = Script()
        self.reactor = FakeProcessReactor(scripted(self.script))
        self.runner = ProcessRunner(self.reactor)
        self.smolvm = Smolvm(
            self.runner, BIN, "/var/lib/smol",
            environ={"PATH": "/bin", "SMOLVM_PUBLISH_ADDR": "0.0.0.0", "HOME": "/h"},
        )  # fmt: skip

    def test_version(self) -> None:
        v = self.successResultOf(self.smolvm.version())
        self.assertEqual(v, SmolvmVersion(1, 9, 2))
        self.assertEqual(str(v), "1.9.2")
        self.assertEqual(self.smolvm.features, Features())
        self.assertEqual(self.smolvm.known_version, v)

    def test_version_floor(self) -> None:
        self.assertFalse(SmolvmVersion(1, 7, 7).supported)
        self.assertTrue(SmolvmVersion(1, 8, 0).supported)
        self.assertTrue(SmolvmVersion(2, 0, 0) > SmolvmVersion(1, 99, 99))

    def test_old_version_refused(self) -> None:
        self.script.version = b"smolvm 1.7.7\n"
        f = self.failureResultOf(self.smolvm.version(), UnsupportedVersion)
        self.assertIn("1.8.0", f.value.message)
        self.assertIn("--label", f.value.message)
        f = self.failureResultOf(self.smolvm.start("m1"), UnsupportedVersion)
        self.assertEqual(f.value.code, "UNSUPPORTED_VERSION")
        self.assertEqual([a for a in self.script.seen if a[0] == "machine"], [])

    def test_cli_without_label_refused(self) -> None:
        """A binary that says 1.8+ but whose create has no --label is refused too."""
        self.script.helps = {"create": b"--name\n", "exec": b"--name\n"}
        f = self.failureResultOf(self.smolvm.stop("m1"), UnsupportedVersion)
        self.assertIn("--label", f.value.message)
        self.assertEqual(self.script.machine_calls, [])

    def test_garbage_version(self) -> None:
        self.script.version = b"hello\n"
        self.failureResultOf(self.smolvm.version(), SmolvmFailed)

    def test_gate_runs_once(self) -> None:
        self.successResultOf(self.smolvm.stop("m1"))
        self.successResultOf(self.smolvm.stop("m1"))
        self.assertEqual(self.script.seen.count(["--version"]), 1)

    def test_env_and_argv(self) -> None:
        self.script.answers["machine start"] = (0, b"Machine 'm1' running (PID: 123)\n", b"")
        self.assertEqual(self.successResultOf(self.smolvm.start("m1")), 123)
        proc = self.reactor.spawned[-1]
        self.assertEqual(proc.args, [BIN, "machine", "start", "--name", "m1"])
        self.assertEqual(
            proc.env, {"PATH": "/bin", "HOME": "/h", "SMOLVM_DATA_DIR": "/var/lib/smol"}
        )

    def test_start_sees_the_vmm_uid(self) -> None:
        """Issue 30: the privilege model is seen, not assumed: a start that reports a pid
        records that process's effective uid (here a live process of ours stands in)."""
        self.assertIsNone(self.smolvm.vmm_seen)
        self.script.answers["machine start"] = (0, b"Machine 'm1' running (PID: 999999999)\n", b"")
        self.successResultOf(self.smolvm.start("m1"))
        self.assertIsNone(self.smolvm.vmm_seen)  # no such process: nothing seen
        pid = os.getpid()
        self.script.answers["machine start"] = (0, b"Machine 'm2' running (PID: %d)\n" % pid, b"")
        self.successResultOf(self.smolvm.start("m2"))
        self.assertEqual(self.smolvm.vmm_seen, VmmSeen("m2", os.geteuid()))
        self.assertIs(VmmSeen("m", 2_000_001).model(0), VmUids.PER_VM)
        self.assertIs(VmmSeen("m", 0).model(0), VmUids.ONE)  # root, no drop (the fake)
        self.assertIs(VmmSeen("m", 4242).model(4242), VmUids.ONE)

    def test_vmm_uid_is_the_effective_uid_from_status(self) -> None:
        """``/proc/PID/status``'s effective uid (a dropped process's /proc/PID is root's)."""
        proc = tempfile.mkdtemp(prefix="bn-proc-")
        self.addCleanup(shutil.rmtree, proc)
        os.makedirs(os.path.join(proc, "7"))
        with open(os.path.join(proc, "7", "status"), "w") as f:
            f.write("Name:\tsmol-vmm\nUid:\t0\t2000001\t2000001\t2000001\nGid:\t0\n")
        self.assertEqual(vmm_uid_of(7, proc), 2_000_001)
        self.assertIsNone(vmm_uid_of(8, proc))

    def test_delete_always_forced(self) -> None:
        self.successResultOf(self.smolvm.delete("m1"))
        self.assertEqual(self.script.seen[-1], ["machine", "delete", "--name", "m1", "-f"])

    def test_lifecycle_argv(self) -> None:
        self.successResultOf(self.smolvm.stop("m1"))
        self.script.answers["machine data-dir"] = (0, b"/d/vms/abc\n", b"")
        self.assertEqual(self.successResultOf(self.smolvm.data_dir("m1")), "/d/vms/abc")
        self.successResultOf(self.smolvm.create(MachineSpec("m1", ports=[PortMapping(5, 6)])))
        self.assertEqual(
            self.script.machine_calls,
            [
                ["machine", "stop", "--name", "m1"],
                ["machine", "data-dir", "--name", "m1"],
                ["machine", "create", "--name", "m1", "--port", "5:6"],
            ],
        )

    def test_a_machines_vm_dir_is_asked_until_the_layout_is_seen(self) -> None:
        """Issue 38: ``machine data-dir`` is asked until its answer is ``vm_dir_of``'s; then
        the layout answers for every later machine, without a call. An answer that is not
        the layout's is never taken for it."""
        self.script.answers["machine data-dir"] = (0, b"/elsewhere/vms/abc\n", b"")
        for name in ("m1", "m2"):
            self.assertEqual(self.successResultOf(self.smolvm._vm_dir(name)), "/elsewhere/vms/abc")
        asked = [a for a in self.script.machine_calls if a[1] == "data-dir"]
        self.assertEqual(len(asked), 2)
        layout = vm_dir_of("/var/lib/smol", "m3")
        self.script.answers["machine data-dir"] = (0, layout.encode() + b"\n", b"")
        self.assertEqual(self.successResultOf(self.smolvm._vm_dir("m3")), layout)
        self.assertEqual(
            self.successResultOf(self.smolvm._vm_dir("m4")), vm_dir_of("/var/lib/smol", "m4")
        )
        asked = [a for a in self.script.machine_calls if a[1] == "data-dir"]
        self.assertEqual([a[-1] for a in asked], ["m1", "m2", "m3"])

    def test_invalid_spawns_nothing(self) -> None:
        for d in (
            self.smolvm.start("-f"),
            self.smolvm.delete("a--b"),
            self.smolvm.exec("m1", []),
            self.smolvm.create(MachineSpec("m1", cpus=0)),
            self.smolvm.status("bad name"),
        ):
            self.failureResultOf(d, InvalidArgument)
        self.assertEqual(self.reactor.spawned, [])

    def test_unavailable(self) -> None:
        smolvm = Smolvm(self.runner, None, environ={})
        for d in (smolvm.version(), smolvm.list(), smolvm.start("m1")):
            self.failureResultOf(d, SmolvmUnavailable)
        self.assertEqual(self.reactor.spawned, [])

    def test_errors_mapped(self) -> None:
        self.script.answers["machine stop"] = (1, b"", b"Error: vm not found: m1\n")
        f = self.failureResultOf(self.smolvm.stop("m1"), NotFound)
        self.assertIn("vm not found: m1", f.value.message)

    def test_list(self) -> None:
        data = [
            rec("a", labels={"owner": "bn", "b": "1"}),
            rec("b", labels={"owner": "other"}),
            rec("c", labels={"owner": "bn"}, ephemeral=True),
            rec("d", labels={"owner": "bn"}, pid="12", ports="x", state=None),
            {"name": 5},
            "junk",
        ]
        self.script.answers["machine ls"] = (0, json.dumps(data).encode(), b"WARN x\n")
        ms = self.successResultOf(self.smolvm.list({"owner": "bn"}))
        self.assertEqual([m.name for m in ms], ["a", "d"])
        self.assertEqual(ms[0], Machine("a", "running", 77, {"owner": "bn", "b": "1"}, 1, 0,
                                        False, True, None, 4, 8192, 1))  # fmt: skip
        self.assertEqual((ms[1].pid, ms[1].ports, ms[1].state), (None, 0, "unknown"))
        self.assertEqual(len(self.successResultOf(self.smolvm.list())), 3)
        self.assertEqual(len(self.successResultOf(self.smolvm.list(include_ephemeral=True))), 4)
        self.assertEqual(self.script.seen[-1], ["machine", "ls", "--json"])

    def test_list_bad_json(self) -> None:
        for out in (b"{}", b"not json", b"\xff"):
            self.script.answers["machine ls"] = (0, out, b"")
            self.failureResultOf(self.smolvm.list(), SmolvmFailed)

    def test_status(self) -> None:
        self.script.answers["machine status"] = (0, json.dumps(rec("m1", pid=99)).encode(), b"")
        m = self.successResultOf(self.smolvm.status("m1"))
        self.assertEqual((m.pid, m.running), (99, True))
        self.assertEqual(self.script.seen[-1], ["machine", "status", "--name", "m1", "--json"])
        self.script.answers["machine status"] = (0, json.dumps(rec("other")).encode(), b"")
        self.failureResultOf(self.smolvm.status("m1"), SmolvmFailed)

    def test_exec_guest_codes_are_results(self) -> None:
        self.script.answers["machine exec"] = (1, b"out", b"Error: from the guest itself\n")
        r = self.successResultOf(self.smolvm.exec("m1", ["false"]))
        self.assertEqual((r.exit_code, r.stdout), (1, b"out"))
        self.script.answers["machine exec"] = (2, b"", b"error: guest usage\n")
        self.assertEqual(self.successResultOf(self.smolvm.exec("m1", ["x"])).exit_code, 2)
        self.script.answers["machine exec"] = (0, b"ok", b"")
        self.assertEqual(self.successResultOf(self.smolvm.exec("m1", ["x"])).exit_code, 0)

    def test_exec_smolvm_failures_raised(self) -> None:
        self.script.answers["machine exec"] = (
            1, b"", b"Error: agent operation failed: connect: machine 'm1' is not running. "
            b"Use 'smolvm machine start --name m1' first.\n",
        )  # fmt: skip
        self.failureResultOf(self.smolvm.exec("m1", ["x"]), NotRunning)
        self.script.answers["machine exec"] = (1, b"", b"Error: vm not found: m1\n")
        self.failureResultOf(self.smolvm.exec("m1", ["x"]), NotFound)
        self.script.answers["machine exec"] = (
            2, b"", b"error: unexpected argument '-q' found\n\nUsage: smolvm machine exec\n",
        )  # fmt: skip
        self.failureResultOf(self.smolvm.exec("m1", ["x"]), UsageError)

    def test_exec_error_text_never_reaches_the_message(self) -> None:
        """Issue 13 item 9: a guest-forged ``Error:`` line keeps its type, never its words."""
        forged = b"Error: agent operation failed: GUEST-CHOSEN-TEXT is not running\n"
        self.script.answers["machine exec"] = (1, b"", forged)
        err = self.failureResultOf(self.smolvm.exec("m1", ["x"]), NotRunning).value
        for shown in (str(err), err.message, err.stderr_tail, repr(err.args)):
            self.assertNotIn("GUEST-CHOSEN-TEXT", shown)
        self.assertIn("m1", err.message)

    def test_exec_stdin_and_env(self) -> None:
        self.successResultOf(self.smolvm.exec("m1", ["cat"], env={"K": "v"}, stdin=b"data"))
        proc = self.reactor.spawned[-1]
        self.assertEqual(proc.stdin, b"data")
        self.assertEqual(
            proc.args[1:],
            ["machine", "exec", "--name", "m1", "-e", "K=v", "-i", "--", *sessionend.wrap(["cat"])],
        )

    def test_timeouts_apply(self) -> None:
        reactor = FakeProcessReactor()
        smolvm = Smolvm(ProcessRunner(reactor), BIN, environ={}, check_version=False,
                        timeouts=Timeouts(stop=7))  # fmt: skip
        d = smolvm.stop("m1")
        reactor.advance(7)
        self.assertEqual(reactor.spawned[0].signals, ["TERM"])
        self.failureResultOf(d, CallTimeout)
        d = smolvm.exec("m1", ["sleep", "100"], timeout=2)
        reactor.advance(2)
        self.assertEqual(reactor.spawned[1].signals, ["TERM"])
        self.failureResultOf(d, CallTimeout)


class CallObserverTests(SynchronousTestCase):
    """``on_call`` hears every CLI call: allow-listed subcommand, "ok" or the code, seconds."""

    def setUp(self) -> None:
        self.script = Script()
        self.reactor = FakeProcessReactor(scripted(self.script))
        self.calls: list[tuple[str, str, float]] = []
        self.smolvm = Smolvm(
            ProcessRunner(self.reactor), BIN, environ={},
            on_call=lambda *call: self.calls.append(call),
        )  # fmt: skip

    def test_successes_failures_and_guest_exit_codes(self) -> None:
        self.script.answers["machine start"] = (0, b"Machine 'm1' running (PID: 5)\n", b"")
        self.script.answers["machine stop"] = (1, b"", b"Error: vm not found: m1\n")
        self.script.answers["machine exec"] = (3, b"", b"guest says no\n")
        self.successResultOf(self.smolvm.start("m1"))
        self.failureResultOf(self.smolvm.stop("m1"), NotFound)
        self.assertEqual(self.successResultOf(self.smolvm.exec("m1", ["false"])).exit_code, 3)
        self.successResultOf(self.smolvm.data_dir("m1").addErrback(lambda _: None))
        self.assertEqual(
            [(sub, result) for sub, result, _ in self.calls],
            [
                ("version", "ok"),
                ("help", "ok"),
                ("help", "ok"),
                ("start", "ok"),
                ("stop", "NOT_FOUND"),
                ("exec", "ok"),  # the guest's own exit code is a result
                ("data-dir", "ok"),
            ],
        )
        self.assertTrue(all(seconds == 0.0 for _, _, seconds in self.calls))

    def test_duration_timeout_and_version_refusal(self) -> None:
        reactor = FakeProcessReactor()
        calls: list[tuple[str, str, float]] = []
        smolvm = Smolvm(
            ProcessRunner(reactor),
            BIN,
            environ={},
            check_version=False,
            timeouts=Timeouts(delete=4),
            on_call=lambda *c: calls.append(c),
        )
        d = smolvm.delete("m1")
        reactor.advance(4)
        self.failureResultOf(d, CallTimeout)
        self.assertEqual(calls, [("delete", "TIMEOUT", 4.0)])
        self.script.version = b"smolvm 1.5.0\n"
        self.failureResultOf(self.smolvm.list(), UnsupportedVersion)
        self.assertEqual(self.calls, [("version", "UNSUPPORTED_VERSION", 0.0)])

    def test_no_binary_and_a_failing_observer(self) -> None:
        smolvm = Smolvm(ProcessRunner(self.reactor), None, environ={},
                        on_call=lambda *c: self.calls.append(c))  # fmt: skip
        self.failureResultOf(smolvm.status("m1"), SmolvmUnavailable)
        self.assertEqual([c[:2] for c in self.calls], [("version", "SMOLVM_UNAVAILABLE")])
        self.assertIn("bottlenet[vm]", self.failureResultOf(smolvm.list()).value.message)
        self.calls.clear()

        def broken(*_: object) -> None:
            raise RuntimeError("observer bug")

        def bug(*_: object, **__: object) -> None:
            raise RuntimeError("runner bug")

        self.calls.clear()
        self.smolvm.runner.run = bug  # type: ignore[method-assign]
        self.failureResultOf(self.smolvm.stop("m1"), RuntimeError)
        self.assertEqual([c[:2] for c in self.calls], [("version", "INTERNAL")])  # never "ok"
        self.smolvm.runner = ProcessRunner(self.reactor)

        self.smolvm.on_call = broken
        self.successResultOf(self.smolvm.version())  # the call itself is unaffected
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 3)  # version + 2 helps

    def test_subcommand_names_come_from_the_allow_list(self) -> None:
        self.assertEqual(subcommand_of(["--version"]), "version")
        self.assertEqual(subcommand_of(["machine", "ls", "--json"]), "ls")
        self.assertEqual(subcommand_of(["machine", "data-dir", "--name", "x"]), "data-dir")
        self.assertEqual(subcommand_of(["machine", "evil\nname"]), "other")
        self.assertEqual(subcommand_of(["pack", "create"]), "other")
        self.assertEqual(subcommand_of([]), "other")
        self.assertLessEqual({subcommand_of(a) for a in (["x"], ["machine", "y"])}, SUBCOMMANDS)
        self.assertEqual(subcommand_of(["machine", "create", "--help"]), "help")


class Smolvm132Tests(SynchronousTestCase):
    """A 1.32-like CLI: json errors, --state-dir, exec --timeout and -u, --expose-socket."""

    def setUp(self) -> None:
        self.script = Script(b"smolvm 1.32.2\n", HELP_132)
        self.reactor = FakeProcessReactor(scripted(self.script))
        self.smolvm = Smolvm(
            ProcessRunner(self.reactor), BIN, "/var/lib/smol",
            environ={"PATH": "/bin", "HOME": "/h", "SMOLVM_AGENT_ROOTFS": "/evil"},
        )  # fmt: skip

    def test_features_detected(self) -> None:
        self.successResultOf(self.smolvm.version())
        self.assertEqual(
            self.smolvm.features,
            Features(True, True, True, True, True, True, True),
        )

    def test_state_dir_and_json_errors_on_every_call(self) -> None:
        self.successResultOf(self.smolvm.stop("m1"))
        self.assertEqual(
            self.script.machine_calls[-1],
            ["machine", "stop", "--error-format", "json", "--state-dir", "/var/lib/smol",
             "--name", "m1"],
        )  # fmt: skip
        env = self.reactor.spawned[-1].env
        self.assertEqual(env, {"PATH": "/bin", "HOME": "/h"})  # no SMOLVM_DATA_DIR, no rootfs

    def test_json_codes_decide(self) -> None:
        def fails(code: str, message: str) -> None:
            err = json.dumps({"error": {"code": code, "message": message}}).encode()
            self.script.answers["machine start"] = (1, b"", b"WARN noise\n" + err + b"\n")

        fails("NOT_FOUND", "anything at all")
        self.failureResultOf(self.smolvm.start("m1"), NotFound)
        fails("KVM_UNAVAILABLE", "anything")
        f = self.failureResultOf(self.smolvm.start("m1"), KvmUnavailable)
        self.assertEqual(f.value.smolvm_code, "KVM_UNAVAILABLE")
        fails("CONFIG_ERROR", "config operation failed: machine status: machine 'm1' not found")
        self.failureResultOf(self.smolvm.start("m1"), NotFound)  # message fallback
        fails("SMOLVM_ERROR", "monitor agent: KvmContext(KvmOpen(Error(13))) (boot process)")
        f = self.failureResultOf(self.smolvm.start("m1"), KvmUnavailable)
        self.assertIn("KVM is not usable on this host", f.value.message)
        self.assertNotIn("KvmContext", f.value.message)
        fails("SMOLVM_ERROR", "something new")
        f = self.failureResultOf(self.smolvm.start("m1"), SmolvmFailed)
        self.assertEqual((type(f.value), f.value.smolvm_code), (SmolvmFailed, "SMOLVM_ERROR"))

    def test_exec_user_and_timeout(self) -> None:
        self.successResultOf(self.smolvm.exec("m1", ["id"], user="1000:1000", timeout=9.5))
        proc = self.reactor.spawned[-1]
        self.assertEqual(proc.args[-6:], ["--user", "1000:1000", "--timeout", "10s", "--", "id"])
        self.successResultOf(self.smolvm.exec("m1", ["sleep", "9"], detach=True, user="app"))
        self.assertNotIn("--timeout", self.reactor.spawned[-1].args)  # would kill the workload
        self.script.answers["machine exec"] = (1, b"", b'{"error":{"code":"COMMAND_FAILED",'
                                               b'"message":"guest"}}\n')  # fmt: skip
        self.assertEqual(self.successResultOf(self.smolvm.exec("m1", ["x"])).exit_code, 1)
        not_running = b'{"error":{"code":"SMOLVM_ERROR","message":"machine is not running"}}\n'
        self.script.answers["machine exec"] = (1, b"", not_running)
        self.failureResultOf(self.smolvm.exec("m1", ["x"]), NotRunning)

    def test_remove_stops_before_delete(self) -> None:
        self.assertTrue(self.successResultOf(self.smolvm.remove("m1")))
        self.assertEqual([a[1] for a in self.script.machine_calls], ["stop", "delete"])
        self.script.answers["machine stop"] = (1, b"", b'{"error":{"code":"NOT_FOUND","mess'
                                               b'age":"vm not found: m1"}}\n')  # fmt: skip
        self.assertFalse(self.successResultOf(self.smolvm.remove("m1")))

    def test_a_failed_stop_still_deletes(self) -> None:
        """A stop that fails (not NOT_FOUND) does not keep the machine: the delete runs."""
        self.script.answers["machine stop"] = (1, b"", b'{"error":{"code":"SMOLVM_ERROR","mes'
                                               b'sage":"vmm did not stop"}}\n')  # fmt: skip
        self.assertTrue(self.successResultOf(self.smolvm.remove("m1")))
        self.assertEqual([a[1] for a in self.script.machine_calls], ["stop", "delete"])

    def test_long_state_dir_refused(self) -> None:
        smolvm = Smolvm(ProcessRunner(self.reactor), BIN, "/" + "d" * 70, environ={})
        f = self.failureResultOf(smolvm.list(), SmolvmUnavailable)
        self.assertIn("too long", f.value.message)


class SharedGateTests(SynchronousTestCase):
    def test_concurrent_calls_share_one_version_and_feature_run(self) -> None:
        reactor = FakeProcessReactor()
        smolvm = Smolvm(ProcessRunner(reactor), BIN, environ={})
        first, second = smolvm.stop("m1"), smolvm.stop("m2")
        self.assertEqual([p.args[1:] for p in reactor.spawned], [["--version"]])
        reactor.spawned[0].finish(0, out=b"smolvm 1.32.2\n")
        for sub in ("create", "exec"):
            reactor.spawned[-1].finish(0, out=HELP_132[sub])
        self.assertEqual(
            [p.args[1:3] for p in reactor.spawned[3:]],
            [["machine", "stop"], ["machine", "stop"]],
        )
        for p in reactor.spawned[3:]:
            p.finish(0)
        self.successResultOf(first)
        self.successResultOf(second)

    def test_version_and_a_call_share_one_probe_run_named_as_probes(self) -> None:
        """version() (Hello's probe) and a first call at start run each probe once, logged as
        ``--version`` and ``machine create --help``, never as a bare ``machine create``."""
        reactor = FakeProcessReactor()
        smolvm = Smolvm(ProcessRunner(reactor), BIN, environ={})
        with capturedLogs() as events:
            version, stopped = smolvm.version(), smolvm.stop("m1")
            reactor.spawned[0].finish(0, out=b"smolvm 1.32.2\n")
            for sub in ("create", "exec"):
                reactor.spawned[-1].finish(0, out=HELP_132[sub])
            reactor.spawned[-1].finish(0)
        self.assertEqual(str(self.successResultOf(version)), "1.32.2")
        self.successResultOf(stopped)
        self.assertEqual(
            [p.args[1:] for p in reactor.spawned[:3]],
            [["--version"], ["machine", "create", "--help"], ["machine", "exec", "--help"]],
        )
        self.assertEqual(len(reactor.spawned), 4)
        named = [e["sub"] for e in events if "sub" in e]
        self.assertEqual(
            named, ["--version", "machine create --help", "machine exec --help", "machine stop"]
        )
        self.assertEqual(sum("features" in e.get("log_format", "") for e in events), 1)

    def test_a_failed_run_fails_every_waiter_and_is_retried(self) -> None:
        reactor = FakeProcessReactor()
        smolvm = Smolvm(ProcessRunner(reactor), BIN, environ={})
        first, second = smolvm.stop("m1"), smolvm.stop("m2")
        reactor.spawned[0].finish(0, out=b"smolvm 1.7.7\n")
        self.failureResultOf(first, UnsupportedVersion)
        self.failureResultOf(second, UnsupportedVersion)
        smolvm.stop("m3")
        self.assertEqual([p.args[1:] for p in reactor.spawned][-1], ["--version"])
