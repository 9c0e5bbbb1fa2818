"""An attached guest command ends with its session (issue 27 item 5, ``vmctl.sessionend``).

The wrapper is plain Python run by the guest's python3, so its own tests run it here as a real
process on pipes, the way smolvm's agent holds them. The last tests drive vmctl against the fake
smolvm (a TEST DOUBLE), which models the real agent: an ``-i`` session's end or ``--timeout``
kills only ``crun exec`` and drops its pipes; the command is not signalled.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from twisted.internet.defer import Deferred
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from tests.fakes import process_alive
from tests.sigdefault import sigint_default
from vmctl import sessionend

from .test_integration import FakeSmolvmTestCase

#: A command that ignores stdin and never writes again once it has said where it is: the
#: shape of the workload waiter, ``logs -f`` on a quiet log, a user's ``sleep``.
QUIET = ["sh", "-c", "sleep 300 & echo $!; wait"]


def wait_until(condition: object, timeout: float = 20.0) -> bool:
    """Poll an outside process's state (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def start(argv: list[str]) -> subprocess.Popen[bytes]:
    """The wrapped command on three pipes, as the agent runs ``crun exec``; SIGINT at its
    default, as in a guest, whatever this suite inherited (``tests/sigdefault.py``)."""
    return subprocess.Popen(
        sessionend.wrap(argv, (sys.executable,)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        process_group=0,
        preexec_fn=sigint_default,
    )


def first_line(p: subprocess.Popen[bytes]) -> bytes:
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], 20)
    assert ready, "no output"
    return p.stdout.readline()


def test_dropped_pipes_end_a_command_that_ignores_stdin() -> None:
    """The agent drops the session's pipes: the quiet command (a child of the shell, in its
    group) is ended, not left running in the guest."""
    p = start(QUIET)
    try:
        sleeper = int(first_line(p))
        assert process_alive(sleeper)
        for f in (p.stdin, p.stdout, p.stderr):
            assert f is not None
            f.close()
        assert wait_until(lambda: not process_alive(sleeper)), "the command outlived its session"
        p.wait(20)
    finally:
        os.killpg(p.pid, 9) if p.poll() is None else None


def test_stdin_end_alone_is_a_half_close_and_codes_pass_through() -> None:
    """Closing stdin is not the session's end: the command reads to EOF and goes on; its exit
    code, and a signal as 128 + n, are the wrapper's."""
    p = start(["sh", "-c", "cat; echo after; exit 7"])
    out, err = p.communicate(b"in\n", timeout=20)
    assert (p.returncode, out, err) == (7, b"in\nafter\n", b"")
    p = start(["sh", "-c", "kill -TERM $$"])
    p.communicate(timeout=20)
    assert p.returncode == 128 + 15
    p = start(["/nonexistent/tool"])
    _, err = p.communicate(timeout=20)
    assert p.returncode == 127 and b"/nonexistent/tool" in err


class _Session(ProcessProtocol):
    def __init__(self) -> None:
        self.out = b""
        self.line: Deferred[bytes] = Deferred()
        self.ended: Deferred[None] = Deferred()

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        self.out += data
        if b"\n" in self.out and not self.line.called:
            self.line.callback(self.out.split(b"\n")[0])

    def processEnded(self, reason: Failure) -> None:
        self.ended.callback(None)


class SessionEndAgainstTheFake(FakeSmolvmTestCase):
    """vmctl's attached calls against the fake's real-agent session end."""

    async def _running(self) -> None:
        await self.smolvm.create(self.spec("m1"))
        await self.smolvm.start("m1")

    async def test_timed_out_stdin_exec_ends_the_guest_command(self) -> None:
        """``exec`` with stdin (``-i``, the gate's and the reach check's form) and smolvm's
        ``--timeout``: exit 124, and the guest command is gone too."""
        await self._running()
        pidfile = os.path.join(self.tmpdir(), "pid")
        r = await self.smolvm.exec(
            "m1", ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 300"], stdin=b"", timeout=1
        )
        self.assertEqual(r.exit_code, 124)
        with open(pidfile) as fh:
            pid = int(fh.read())
        self.assertTrue(wait_until(lambda: not process_alive(pid)), "the timed-out command lives")

    async def test_ended_session_ends_the_guest_command(self) -> None:
        """``spawn_exec``'s child ended (a client gone, the daemon stopping): the quiet guest
        command ends with it."""
        await self._running()
        session = _Session()
        transport = await self.smolvm.spawn_exec("m1", QUIET, session)
        sleeper = int(await session.line)
        self.assertTrue(process_alive(sleeper))
        transport.signalProcess("TERM")
        await session.ended
        self.assertTrue(wait_until(lambda: not process_alive(sleeper)), "the command lives on")


def test_ctrl_c_is_the_commands_not_the_wrappers() -> None:
    """A terminal's Ctrl-C reaches the whole foreground group: the wrapper ignores it, and a
    command that handles it (a REPL) goes on in its session."""
    p = start(
        [sys.executable, "-c",
         "import signal, time; got = []; signal.signal(signal.SIGINT, lambda *a: got.append(1))\n"
         "print('ready', flush=True)\n"
         "while not got: time.sleep(0.02)\n"
         "print('after', flush=True)"]
    )  # fmt: skip
    assert first_line(p) == b"ready\n"
    os.killpg(p.pid, signal.SIGINT)
    out, _ = p.communicate(timeout=20)
    assert (p.returncode, out) == (0, b"after\n")


def test_ctrl_c_stops_a_command_that_does_not_handle_it() -> None:
    """The command gets SIGINT back at its default: Ctrl-C stops a plain ``sleep`` (the
    wrapper exits 128 + SIGINT)."""
    p = start(["sh", "-c", "echo ready; exec sleep 300"])
    try:
        assert first_line(p) == b"ready\n"
        os.killpg(p.pid, signal.SIGINT)
        p.communicate(timeout=20)
        assert p.returncode == 128 + signal.SIGINT
    finally:
        os.killpg(p.pid, 9) if p.poll() is None else None


def test_a_command_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    """The session's pipes drop and the command ignores SIGTERM: the wrapper outlives its own
    SIGTERM to the group and SIGKILLs it after ``GRACE``."""
    p = start(["sh", "-c", "trap '' TERM; echo $$; sleep 300"])
    try:
        shell = int(first_line(p))
        for f in (p.stdin, p.stdout, p.stderr):
            assert f is not None
            f.close()
        assert wait_until(lambda: not process_alive(shell), sessionend.GRACE + 15), (
            "a command that ignores SIGTERM outlived its session"
        )
        p.wait(20)
    finally:
        os.killpg(p.pid, 9) if p.poll() is None else None
