"""A signal sent to a child between its fork and its exec is not lost (``vmctl.forksignals``).

The window is real in the daemon: Twisted forks an ``exec -t`` child and runs Python in it
until its exec, with the reactor's SIGTERM handler, so a SIGTERM the exec bridge sends at once
was eaten by that handler. A fork here stands in for Twisted's: it is the same ``os.fork``
with the same hooks, and the child signals itself before any exec, which is the window made
certain instead of raced. The last test checks that vmctl's attached exec spawns inside it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from vmctl import forksignals

from .test_integration import FakeSmolvmTestCase


@pytest.fixture
def daemon_handler() -> Iterator[list[int]]:
    """A Python SIGTERM handler in this process, as the reactor installs in the daemon."""
    heard: list[int] = []
    saved = signal.signal(signal.SIGTERM, lambda signum, frame: heard.append(signum))
    yield heard
    signal.signal(signal.SIGTERM, saved)


def fork_and_term_itself() -> int:
    """Fork; the child sends itself SIGTERM before any exec, then exits 0 if it lives on.
    The child's wait status."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


def test_a_term_before_the_exec_ends_the_child(daemon_handler: list[int]) -> None:
    """Forked inside the guard, the child dies of the SIGTERM it got before its exec (with
    the daemon's handler it would have lived on); the parent keeps its handler."""
    with forksignals.child_signals_default():
        status = fork_and_term_itself()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
    assert callable(signal.getsignal(signal.SIGTERM)) and daemon_handler == []
    os.kill(os.getpid(), signal.SIGTERM)  # the parent's handler still runs, once
    assert daemon_handler == [signal.SIGTERM]
    assert not forksignals.armed()


def test_outside_the_guard_a_fork_is_left_alone(daemon_handler: list[int]) -> None:
    """A fork outside the guard is untouched: the child's handler runs (what the guard is for)."""
    status = fork_and_term_itself()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


class _Quiet(ProcessProtocol):
    """Hears nothing; ``ended`` fires when the child has been reaped."""

    def __init__(self) -> None:
        self.ended: Deferred[None] = Deferred()

    def processEnded(self, reason: Failure) -> None:
        self.ended.callback(None)


class SpawnInsideTheGuard(FakeSmolvmTestCase):
    """vmctl's attached exec (pipes and terminal) spawns its child inside the guard."""

    async def test_attached_execs_spawn_inside_the_guard(self) -> None:
        """Both ``spawn_exec`` forms call ``spawnProcess`` with the guard armed."""
        await self.smolvm.create(self.spec("m1"))
        await self.smolvm.start("m1")
        seen: list[bool] = []

        class Reactor:
            def __getattr__(self, name: str) -> Any:
                return getattr(reactor, name)

            def spawnProcess(self, *a: Any, **kw: Any) -> Any:
                seen.append(forksignals.armed())
                return reactor.spawnProcess(*a, **kw)

        self.runner.reactor = Reactor()
        for tty in (False, True):
            quiet = _Quiet()
            transport = await self.smolvm.spawn_exec("m1", ["true"], quiet, tty=tty)
            with contextlib.suppress(ProcessExitedAlready):
                transport.signalProcess("KILL")
            await quiet.ended  # reaped here, not left to the next test's reactor check
        self.assertEqual(seen, [True, True])


#: Run in a fresh interpreter: an after-fork hook registered *before* vmctl.forksignals runs
#: in the child ahead of the guard's own, so its SIGTERM lands between the fork and the
#: guard's reset (the earliest point of the window). Prints the child's wait status.
_EARLIEST = """
import os, signal, sys
signal.signal(signal.SIGTERM, lambda *a: None)  # the daemon's handler
os.register_at_fork(after_in_child=lambda: os.kill(os.getpid(), signal.SIGTERM))
from vmctl import forksignals
with forksignals.child_signals_default():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
print(os.waitpid(pid, 0)[1])
"""


def test_a_term_at_the_first_instant_after_the_fork_is_held_until_the_default() -> None:
    """A SIGTERM that reaches the child before the guard's child hook has run is held
    (blocked across the fork), not taken by the daemon's handler: the child dies of it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", _EARLIEST], capture_output=True, text=True, cwd=root, timeout=60
    )
    assert out.returncode == 0, out.stderr
    status = int(out.stdout)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
