"""Unit tests for the smolvm stderr → typed error mapping."""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from vmctl import errors as E

KVM = (
    b"Error: agent operation failed: start machine: kvm not available: KVM not available. "
    b"Ensure KVM kernel module is loaded.\n  Try: sudo modprobe kvm_intel\n"
)
CASES: list[tuple[bytes, int, type[E.SmolvmFailed], str]] = [
    (b"Error: vm not found: m1\n", 1, E.NotFound, "NOT_FOUND"),
    (
        b"Error: config operation failed: machine status: machine 'm1' not found\n",
        1,
        E.NotFound,
        "NOT_FOUND",
    ),
    (
        b"Error: config operation failed: create machine: machine 'm1' already exists or is "
        b"being created\n",
        1,
        E.AlreadyExists,
        "ALREADY_EXISTS",
    ),
    (
        b"WARN something\nError: config operation failed: start machine: host port 4000 is "
        b"already in use by running machine 'other'\n",
        1,
        E.PortInUse,
        "PORT_IN_USE",
    ),
    (
        b"Error: agent operation failed: start machine: configure virtio-net: failed to start "
        b"virtio network runtime: Address already in use (os error 98) (boot process exited "
        b"(code 1) before the agent was ready)\n",
        1,
        E.PortInUse,
        "PORT_IN_USE",
    ),
    (KVM, 1, E.KvmUnavailable, "KVM_UNAVAILABLE"),
    (
        b"Error: agent operation failed: start machine: kvm permission denied: Cannot access "
        b"/dev/kvm (permission denied).\n  usermod hint\n",
        1,
        E.KvmUnavailable,
        "KVM_UNAVAILABLE",
    ),
    (
        b"Error: agent operation failed: start machine: monitor agent: agent operation failed: "
        b"start vm: krun_start_enter returned: -22 (EINVAL: Invalid argument)\n",
        1,
        E.DeviceBudget,
        "DEVICE_BUDGET",
    ),
    (
        b"Error: agent operation failed: connect: machine 'm1' is not running. Use 'smolvm "
        b"machine start --name m1' first.\n",
        1,
        E.NotRunning,
        "NOT_RUNNING",
    ),
    (
        b"Error: agent operation failed: start machine: agent operation failed: wait for "
        b"ready: agent did not become ready within 30 seconds\n",
        1,
        E.ReadinessTimeout,
        "READINESS_TIMEOUT",
    ),
    (
        b"error: unexpected argument '--bogus' found\n\nUsage: smolvm machine create\n",
        2,
        E.UsageError,
        "USAGE_ERROR",
    ),
    (b"Error: something new went wrong\n", 1, E.SmolvmFailed, "SMOLVM_FAILED"),
    (b"", 1, E.SmolvmFailed, "SMOLVM_FAILED"),
]


class ClassifyTests(SynchronousTestCase):
    def test_table(self) -> None:
        for stderr, code, cls, wire in CASES:
            e = E.classify(stderr, code, "machine start")
            self.assertIs(type(e), cls, stderr)
            self.assertEqual(e.code, wire)
            self.assertEqual(e.exit_code, code)
            self.assertTrue(e.message.startswith("smolvm machine start"))

    def test_port_details(self) -> None:
        e = E.classify(CASES[3][0], 1, "machine start")
        assert isinstance(e, E.PortInUse)
        self.assertEqual((e.port, e.holder), (4000, "other"))
        self.assertIn("host port 4000", e.message)
        e = E.classify(CASES[4][0], 1, "machine start")
        assert isinstance(e, E.PortInUse)
        self.assertIsNone(e.holder)

    def test_multiline_kept_sanitised(self) -> None:
        e = E.classify(KVM, 1, "machine start")
        self.assertNotIn("\n", e.message)
        self.assertIn("kvm_intel", e.message)

    def test_kvm_denied_advice_fits_the_daemon_uid(self) -> None:
        """Issue 30: a non-root daemon is told about its own uid and keeps smolvm's kvm-group
        advice, never "as root"; a root daemon is told why the group cannot help its
        per-VM uids (the real 1.32.2 message as root, then smolvm's non-root message)."""
        root = (
            b"Error: agent operation failed: start machine: agent operation failed: monitor "
            b"agent: Then log out and log back in for the change to take effect.); libkrun "
            b"detail: build microVM: Internal error while starting microVM: "
            b"KvmContext(KvmOpen(Error(13))) (boot process exited (code 1) before the agent "
            b"was ready)\n"
        )
        user = (  # the real 1.32.2 as uid 65534 (setpriv), on a root:root 0600 /dev/kvm
            b"Error: agent operation failed: start machine: kvm permission denied: Cannot "
            b"access /dev/kvm (permission denied).\nAdd your user to the 'kvm' group:\n\n"
            b"sudo usermod -aG kvm $USER\n\nThen log out and log back in for the change to "
            b"take effect.\n"
        )
        as_root = E.kvm_message("machine start", E.error_text(root), euid=0)
        self.assertIn("the daemon runs as root", as_root)
        self.assertIn("no supplementary groups", as_root)
        self.assertNotIn("smolvm says", as_root)
        as_user = E.kvm_message("machine start", E.error_text(user), euid=4242)
        self.assertNotIn("root", as_user)
        self.assertIn("the daemon's user (uid 4242)", as_user)
        self.assertIn(
            "smolvm says: Add your user to the 'kvm' group: sudo usermod -aG kvm $USER Then log",
            as_user,
        )
        self.assertNotIn("\n", as_user)
        e = E.classify(user, 1, "machine start")  # the default: this process's uid
        self.assertIn(f"uid {os.geteuid()}" if os.geteuid() else "runs as root", e.message)

    def test_signal(self) -> None:
        e = E.classify(b"", None, "machine stop", signal=9)
        self.assertEqual(e.code, "SMOLVM_FAILED")
        self.assertIn("signal 9", e.message)

    def test_generic_carries_tail(self) -> None:
        e = E.classify(b"noise\x1b[31m\n" * 200 + b"the end\n", 1, "machine ls")
        self.assertTrue(e.stderr_tail.endswith("the end"))
        self.assertNotIn("\x1b", e.message)
        self.assertLessEqual(len(e.stderr_tail), E.MESSAGE_LIMIT)

    def test_every_class_has_distinct_code(self) -> None:
        codes = {c: c.code for c in E.ALL_ERRORS}
        for c in (
            "SMOLVM_UNAVAILABLE",
            "SMOLVM_FAILED",
            "NOT_FOUND",
            "ALREADY_EXISTS",
            "PORT_IN_USE",
            "KVM_UNAVAILABLE",
            "DEVICE_BUDGET",
            "NOT_RUNNING",
            "READINESS_TIMEOUT",
            "USAGE_ERROR",
            "TIMEOUT",
            "INVALID_ARGUMENT",
            "UNSUPPORTED_VERSION",
        ):
            self.assertIn(c, codes.values())


class SanitizeTests(SynchronousTestCase):
    @given(st.binary(max_size=2000))
    def test_no_control_bounded(self, data: bytes) -> None:
        s = E.sanitize(data)
        self.assertLessEqual(len(s), E.MESSAGE_LIMIT)
        self.assertFalse(any(ord(c) < 32 or 0x7F <= ord(c) <= 0x9F for c in s))

    @given(st.binary(max_size=500), st.integers(0, 3))
    def test_classify_never_raises(self, data: bytes, code: int) -> None:
        e = E.classify(data, code, "x")
        self.assertIsInstance(e, E.SmolvmFailed)
        self.assertFalse(any(ord(c) < 32 for c in e.message))


def _json_error(code: str, message: str) -> bytes:
    return b'{"error":{"code":"%s","message":"%s"}}\n' % (code.encode(), message.encode())


def test_json_codes_type_the_error_whatever_the_message() -> None:
    """V10/V12: HYPERVISOR_UNAVAILABLE and CONFLICT decide by code, not by their text."""
    hv = E.classify(_json_error("HYPERVISOR_UNAVAILABLE", "hvf busy"), 1, "machine start")
    assert isinstance(hv, E.KvmUnavailable)
    taken = E.classify(_json_error("CONFLICT", "name taken"), 1, "machine create")
    assert isinstance(taken, E.AlreadyExists)


def test_the_last_json_error_line_wins() -> None:
    """V14: a guest-forged earlier line cannot choose the code of smolvm's own failure."""
    err = _json_error("NOT_FOUND", "a") + _json_error("CONFLICT", "b")
    assert E.json_error(err) == ("CONFLICT", "b")
