"""A signal sent to a child between its fork and its exec is not lost.

Why: Twisted starts a child on a pseudo-terminal (``exec -t``, and any child it cannot
``posix_spawn``) with ``os.fork`` and runs Python in the child until ``exec``. Until then the
child has the daemon's own handlers: a SIGTERM the exec bridge sends it at once (its client
left, its time limit) runs the reactor's handler in the child, which then execs as if nothing
happened, and the command lives on until the SIGKILL after the grace. (``posix_spawn`` has no
such window: glibc blocks every signal and sets each caught one to its default before it lets
them in again.)

So :func:`child_signals_default` brackets the spawn: for each signal the daemon catches with a
Python handler, the fork happens with it blocked (a signal meant for the parent waits those few
microseconds and is delivered after); the child sets it to its default and unblocks it at once
(``os.register_at_fork``), so one sent before the exec ends the child as it would have ended
the command.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

#: The signals to treat at the next fork (None: forks are left alone).
_armed: frozenset[signal.Signals] | None = None


def _caught() -> frozenset[signal.Signals]:
    """The signals this process handles with a Python function now."""
    out = set()
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):
            if callable(signal.getsignal(sig)):
                out.add(signal.Signals(sig))
    return frozenset(out)


def _before() -> None:
    if _armed:
        signal.pthread_sigmask(signal.SIG_BLOCK, _armed)


def _in_parent() -> None:
    if _armed:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _armed)


def _in_child() -> None:
    if _armed:
        for sig in _armed:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _armed)


os.register_at_fork(before=_before, after_in_parent=_in_parent, after_in_child=_in_child)


@contextlib.contextmanager
def child_signals_default() -> Iterator[None]:
    """A fork in this block gives the child the default action of every signal this process
    catches, with none lost in between (call from the thread that forks: the reactor's)."""
    global _armed
    saved, _armed = _armed, _caught()
    try:
        yield
    finally:
        _armed = saved


def armed() -> bool:
    """Whether a fork now would be treated (for tests of a spawn's wiring)."""
    return _armed is not None
