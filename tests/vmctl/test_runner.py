"""Unit tests for vmctl.runner against a fake process reactor and a Clock."""

from __future__ import annotations

import os
import stat
import tempfile
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from tests.fakes import FAKE_SMOLVM
from tests.vmctl.fakereactor import FakeProcess, FakeProcessReactor
from vmctl.errors import CallTimeout, SmolvmUnavailable, Unavailable
from vmctl.install import (
    SOURCE_OPTION,
    SOURCE_PATH,
    SOURCE_WHEEL,
    SmolvmInstall,
    discover,
    find_wheel,
)
from vmctl.runner import BoundedBuffer, ProcessRunner, ProcResult, build_env, resolve_smolvm
from vmctl.service import VmctlService, make_smolvm

BIN = FAKE_SMOLVM  # exists; the fake reactor never runs it
HOSTILE = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/home/u",
    "LANG": "C.UTF-8",
    "LC_ALL": "C",
    "TMPDIR": "/tmp",
    "XDG_RUNTIME_DIR": "/run/user/1000",
    "SMOLVM_PUBLISH_ADDR": "0.0.0.0",
    "SMOLVM_EGRESS_FLOOR": "off",
    "SMOLVM_EGRESS_ALLOW_PRIVATE": "1",
    "SMOLVM_DATA_DIR": "/elsewhere",
    "SMOLVM_BOOT_BINARY": "/x",
    "LD_PRELOAD": "/evil.so",
    "RUST_LOG": "trace",
    "AWS_SECRET_ACCESS_KEY": "secret",
}


class EnvTests(SynchronousTestCase):
    def test_allow_list_only(self) -> None:
        env = build_env(HOSTILE)
        self.assertEqual(
            env,
            {
                "PATH": "/usr/bin:/bin",
                "HOME": "/home/u",
                "LANG": "C.UTF-8",
                "LC_ALL": "C",
                "TMPDIR": "/tmp",
                "XDG_RUNTIME_DIR": "/run/user/1000",
            },
        )

    def test_relative_path_entries_never_reach_smolvm(self) -> None:
        """Issue 13 item 9: PATH is passed on with its absolute entries only."""
        env = build_env({"PATH": ".:bin::/usr/bin:./x:/bin"})
        self.assertEqual(env["PATH"], "/usr/bin:/bin")

    def test_data_dir_only_when_configured(self) -> None:
        self.assertNotIn("SMOLVM_DATA_DIR", build_env(HOSTILE, None))
        self.assertEqual(build_env(HOSTILE, "/var/lib/b")["SMOLVM_DATA_DIR"], "/var/lib/b")

    @given(st.dictionaries(st.text(min_size=1, max_size=20), st.text(max_size=20)))
    def test_never_passes_denied(self, extra: dict[str, str]) -> None:
        source = {**extra, **HOSTILE}
        env = build_env(source, "/d")
        for k in ("SMOLVM_PUBLISH_ADDR", "SMOLVM_EGRESS_FLOOR", "SMOLVM_EGRESS_ALLOW_PRIVATE"):
            self.assertNotIn(k, env)
        self.assertTrue(
            set(env)
            <= {"PATH", "HOME", "LANG", "TMPDIR", "XDG_RUNTIME_DIR", "SMOLVM_DATA_DIR"}
            | {k for k in env if k.startswith("LC_")}
        )


class ResolveTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp()
        self.addCleanup(lambda: __import__("shutil").rmtree(self.dir))
        self.exe = os.path.join(self.dir, "smolvm")
        with open(self.exe, "w") as f:
            f.write("#!/bin/sh\n")
        os.chmod(self.exe, stat.S_IRWXU)

    def test_found_on_path(self) -> None:
        self.assertEqual(resolve_smolvm(None, f"/nonexistent:{self.dir}"), self.exe)

    def test_missing(self) -> None:
        self.assertIsNone(resolve_smolvm(None, "/nonexistent"))
        self.assertIsNone(resolve_smolvm(None, None))
        self.assertIsNone(resolve_smolvm(os.path.join(self.dir, "nope"), None))

    def test_explicit_path(self) -> None:
        self.assertEqual(resolve_smolvm(self.exe, None), self.exe)

    def test_not_executable(self) -> None:
        os.chmod(self.exe, stat.S_IRUSR)
        self.assertIsNone(resolve_smolvm(self.exe, None))

    def test_relative_path_entries_ignored(self) -> None:
        rel = os.path.relpath(self.dir)
        self.assertIsNone(resolve_smolvm(None, rel))

    def test_binary_writable_by_others_or_foreign_is_refused(self) -> None:
        """Issue 13 item 9: a smolvm another user could replace is never run."""
        from vmctl.runner import untrusted_reason

        self.assertIsNone(untrusted_reason(self.exe))
        os.chmod(self.exe, 0o777)
        self.assertIsNone(resolve_smolvm(self.exe, None))
        self.assertIsNone(resolve_smolvm(None, self.dir))
        self.assertIn("writable by group or others", untrusted_reason(self.exe) or "")
        os.chmod(self.exe, stat.S_IRWXU)
        os.chmod(self.dir, 0o777)  # the directory too: the file could be swapped
        self.addCleanup(os.chmod, self.dir, 0o700)
        self.assertIsNone(resolve_smolvm(self.exe, None))
        os.chmod(self.dir, 0o700)
        if os.geteuid() == 0:
            os.chown(self.exe, 65534, 65534)
            self.assertIn("owned by uid 65534", untrusted_reason(self.exe) or "")
            self.assertIsNone(resolve_smolvm(self.exe, None))

    def test_make_smolvm_without_binary(self) -> None:
        _service, smolvm = make_smolvm(
            FakeProcessReactor(), None, None, environ={"PATH": ""}, wheel=lambda: None
        )
        self.assertIsNone(smolvm.binary)
        f = self.failureResultOf(smolvm.list(), SmolvmUnavailable)
        self.assertEqual(f.value.code, "SMOLVM_UNAVAILABLE")
        self.assertIn("bottlenet[vm]", smolvm.describe())

    def _wheel_dir(self, cli_text: str) -> tuple[str, str]:
        """A wheel-shaped directory whose "CLI" is ``cli_text``; (its dir, its binary)."""
        wheel_dir = os.path.join(self.dir, "wheel", "smol")
        os.makedirs(wheel_dir)
        wheel_bin = os.path.join(wheel_dir, "smol-vmm")
        for name in ("libkrun.so", "libkrunfw.so.5", "agent-rootfs.tar.zst"):
            with open(os.path.join(wheel_dir, name), "w") as f:
                f.write("\n")
        with open(wheel_bin, "w") as f:
            f.write(cli_text)
        os.chmod(wheel_bin, 0o755)
        return wheel_dir, wheel_bin

    def test_discovery_order_and_assets(self) -> None:
        """--smolvm, then PATH, then the wheel; assets next to the binary are passed on, the
        rootfs tarball in SMOLVM_AGENT_ROOTFS_TAR where the binary holds that name (1.37
        reads SMOLVM_AGENT_ROOTFS as a directory only: issue 35)."""
        wheel_dir, wheel_bin = self._wheel_dir("#!/bin/sh\n# reads SMOLVM_AGENT_ROOTFS_TAR\n")
        rootfs = os.path.join(wheel_dir, "agent-rootfs.tar.zst")
        wheel = SmolvmInstall(wheel_bin, SOURCE_WHEEL, wheel_dir, rootfs, "1.32.2")
        self.assertEqual(discover(None, "/nonexistent", lambda: wheel), wheel)
        self.assertEqual(discover(None, self.dir, lambda: wheel).source, SOURCE_PATH)
        self.assertEqual(discover(self.exe, None, lambda: wheel).source, SOURCE_OPTION)
        self.assertIsNone(discover("/nonexistent/smolvm", None, lambda: wheel))  # no fallback
        picked = discover(wheel_bin, None, lambda: None)
        assert picked is not None
        self.assertEqual(
            picked.env(), {"SMOLVM_LIB_DIR": wheel_dir, "SMOLVM_AGENT_ROOTFS_TAR": rootfs}
        )
        self.assertIn("the smolmachines 1.32.2 wheel, pulled in by bottlenet[vm]", wheel.describe())
        by_hand = SmolvmInstall(wheel_bin, SOURCE_WHEEL, wheel_dir, rootfs, "1.37.3",
                                wheel_by_name=True)  # fmt: skip
        self.assertIn("1.37.3 wheel, installed by name", by_hand.describe())
        self.assertNotIn("bottlenet[vm]", by_hand.describe())
        evil = {"PATH": "/bin", "SMOLVM_AGENT_ROOTFS": "/evil", "SMOLVM_AGENT_ROOTFS_TAR": "/e"}
        env = build_env(evil, None, picked.env())
        self.assertEqual(env["SMOLVM_AGENT_ROOTFS_TAR"], rootfs)
        self.assertNotIn("SMOLVM_AGENT_ROOTFS", env)  # the daemon's own never passes
        self.assertNotIn("SMOLVM_LIB_DIR", build_env({"SMOLVM_LIB_DIR": "/evil"}))
        self.assertNotIn("SMOLVM_MACHINE_NAME", build_env({"SMOLVM_MACHINE_NAME": "x"}))

    def test_rootfs_variable_follows_what_the_binary_offers(self) -> None:
        """A CLI without the name SMOLVM_AGENT_ROOTFS_TAR (older than PR #356) gets the
        tarball in SMOLVM_AGENT_ROOTFS; an unpacked rootfs directory always goes there."""
        wheel_dir, wheel_bin = self._wheel_dir("#!/bin/sh\n# an old CLI\n")
        picked = discover(wheel_bin, None, lambda: None)
        assert picked is not None
        self.assertEqual(picked.rootfs_var, "SMOLVM_AGENT_ROOTFS")
        self.assertEqual(
            picked.env()["SMOLVM_AGENT_ROOTFS"], os.path.join(wheel_dir, "agent-rootfs.tar.zst")
        )
        os.unlink(os.path.join(wheel_dir, "agent-rootfs.tar.zst"))
        os.mkdir(os.path.join(wheel_dir, "agent-rootfs"))
        with open(wheel_bin, "a") as f:
            f.write("# SMOLVM_AGENT_ROOTFS_TAR\n")
        picked = discover(wheel_bin, None, lambda: None)
        assert picked is not None
        self.assertEqual(
            picked.env()["SMOLVM_AGENT_ROOTFS"], os.path.join(wheel_dir, "agent-rootfs")
        )

    def test_installed_wheel_is_found(self) -> None:
        found = find_wheel()
        if found is None:
            raise SkipTest("the smolmachines wheel (bottlenet[vm]) is not installed")
        self.assertEqual(found.source, SOURCE_WHEEL)
        self.assertTrue(found.binary.endswith(os.path.join("smol", "smol-vmm")))
        self.assertIsNotNone(found.lib_dir)
        self.assertTrue(str(found.agent_rootfs).endswith("agent-rootfs.tar.zst"))
        # 1.32.2 and 1.37.3 both read the tarball from SMOLVM_AGENT_ROOTFS_TAR (their strings)
        self.assertEqual(found.rootfs_var, "SMOLVM_AGENT_ROOTFS_TAR")


class BoundedBufferTests(SynchronousTestCase):
    def test_small(self) -> None:
        b = BoundedBuffer(10)
        b.write(b"abc")
        self.assertEqual(b.value(), b"abc")
        self.assertFalse(b.truncated)

    def test_keeps_head_and_tail(self) -> None:
        b = BoundedBuffer(10)
        for chunk in (b"0123", b"456789", b"abcdef"):
            b.write(chunk)
        self.assertTrue(b.truncated)
        self.assertEqual(b.dropped, 6)
        v = b.value()
        self.assertTrue(v.startswith(b"01234"))
        self.assertTrue(v.endswith(b"bcdef"))
        self.assertIn(b"6 bytes dropped", v)

    @given(st.lists(st.binary(max_size=50), max_size=20), st.integers(2, 64))
    def test_bounded(self, chunks: list[bytes], limit: int) -> None:
        b = BoundedBuffer(limit)
        for c in chunks:
            b.write(c)
        data = b"".join(chunks)
        if len(data) <= (limit // 2) * 2:
            self.assertEqual(b.value(), data)
        else:
            half = limit // 2
            self.assertEqual(b.dropped, len(data) - 2 * half)
            self.assertTrue(b.value().startswith(data[:half]))
            self.assertTrue(b.value().endswith(data[-half:]))


class RunnerTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = FakeProcessReactor()
        self.runner = ProcessRunner(self.reactor, grace=3.0, max_output=100)

    def run_one(self, **kw: Any) -> tuple[Deferred[ProcResult], FakeProcess]:
        d = self.runner.run([BIN, "machine", "ls"], {"PATH": "/bin"}, 10.0, **kw)
        return d, self.reactor.spawned[-1]

    def test_spawn_arguments(self) -> None:
        _, proc = self.run_one()
        self.assertEqual(proc.executable, BIN)
        self.assertEqual(proc.args, [BIN, "machine", "ls"])
        self.assertEqual(proc.env, {"PATH": "/bin"})
        self.assertIsNone(proc.path)
        self.assertFalse(proc.usePTY)
        self.assertTrue(proc.stdin_closed)
        self.assertEqual(proc.stdin, b"")

    def test_stdin_fed_then_closed(self) -> None:
        _, proc = self.run_one(stdin=b"payload")
        self.assertEqual(proc.stdin, b"payload")
        self.assertTrue(proc.stdin_closed)

    def test_result_exit_zero(self) -> None:
        d, proc = self.run_one()
        self.reactor.advance(1.5)
        proc.finish(0, out=b"out", err=b"err")
        r = self.successResultOf(d)
        assert isinstance(r, ProcResult)
        self.assertEqual(r.argv, (BIN, "machine", "ls"))
        self.assertEqual((r.exit_code, r.signal, r.stdout, r.stderr), (0, None, b"out", b"err"))
        self.assertEqual(r.duration, 1.5)
        self.assertTrue(r.ok)
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        self.assertEqual(self.runner.in_flight, 0)

    def test_result_exit_code_and_signal(self) -> None:
        d, proc = self.run_one()
        proc.finish(3)
        self.assertEqual(self.successResultOf(d).exit_code, 3)
        d, proc = self.run_one()
        proc.finish(None, signal=9)
        r = self.successResultOf(d)
        self.assertEqual((r.exit_code, r.signal), (None, 9))

    def test_bounded_output(self) -> None:
        d, proc = self.run_one()
        proc.output(b"x" * 500, b"e" * 30)
        proc.finish(0)
        r = self.successResultOf(d)
        self.assertTrue(r.stdout_truncated)
        self.assertFalse(r.stderr_truncated)
        self.assertLess(len(r.stdout), 200)

    def test_timeout_term_then_kill(self) -> None:
        d, proc = self.run_one()
        proc.ignore_term = True
        self.reactor.advance(9.9)
        self.assertEqual(proc.signals, [])
        self.reactor.advance(0.1)
        self.assertEqual(proc.signals, ["TERM"])
        self.assertNoResult(d)
        self.reactor.advance(2.9)
        self.assertEqual(proc.signals, ["TERM"])
        self.reactor.advance(0.1)
        self.assertEqual(proc.signals, ["TERM", "KILL"])
        f = self.failureResultOf(d, CallTimeout)
        self.assertEqual(f.value.code, "TIMEOUT")
        self.assertEqual(f.value.partial.signal, 9)
        self.assertTrue(f.value.partial.timed_out)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_timeout_term_is_enough(self) -> None:
        d, proc = self.run_one()
        self.reactor.advance(10)
        self.assertEqual(proc.signals, ["TERM"])
        self.failureResultOf(d, CallTimeout)
        self.reactor.advance(100)
        self.assertEqual(proc.signals, ["TERM"])
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_timeout_after_exit_with_pipes_held(self) -> None:
        d, proc = self.run_one()
        proc.exit_only(0)
        self.assertNoResult(d)
        self.reactor.advance(10)
        self.assertTrue(proc.lost)
        self.failureResultOf(d, CallTimeout)

    def test_cancel_escalates(self) -> None:
        d, proc = self.run_one()
        proc.ignore_term = True
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(proc.signals, ["TERM"])
        self.assertEqual(self.runner.in_flight, 1)
        self.reactor.advance(3)
        self.assertEqual(proc.signals, ["TERM", "KILL"])
        self.assertEqual(self.runner.in_flight, 0)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_add_timeout_cancels(self) -> None:
        d, proc = self.run_one()
        d.addTimeout(1, self.reactor)
        self.reactor.advance(1)
        self.assertEqual(proc.signals, ["TERM"])

    def test_spawn_failure(self) -> None:
        self.reactor.spawn_error = FileNotFoundError(2, "No such file")
        d = self.runner.run([BIN], {}, 1)
        self.failureResultOf(d, SmolvmUnavailable)

    def test_relative_binary_refused(self) -> None:
        self.assertRaises(ValueError, self.runner.run, ["smolvm"], {}, 1)
        self.assertEqual(self.reactor.spawned, [])

    def test_shutdown_waits(self) -> None:
        d, proc = self.run_one()
        stopped = self.runner.shutdown(5)
        self.assertNoResult(stopped)
        self.failureResultOf(self.runner.run([BIN], {}, 1), Unavailable)
        proc.finish(0)
        self.successResultOf(stopped)
        self.assertEqual(self.successResultOf(d).exit_code, 0)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_shutdown_kills_past_deadline(self) -> None:
        service = VmctlService(self.runner, stop_deadline=5)
        service.startService()
        d, proc = self.run_one()
        proc.ignore_term = True
        stopped = service.stopService()
        self.reactor.advance(5)
        self.assertEqual(proc.signals, ["TERM"])
        self.assertNoResult(stopped)
        self.reactor.advance(3)
        self.assertEqual(proc.signals, ["TERM", "KILL"])
        self.successResultOf(stopped)
        f = self.failureResultOf(d, Unavailable)
        self.assertIn("shutting down", f.value.message)
        self.assertFalse(service.running)

    def test_shutdown_idle(self) -> None:
        self.successResultOf(self.runner.shutdown(5))
