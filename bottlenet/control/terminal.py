"""A launcher's own terminal during an exec: raw mode restored on every way out, SIGWINCH
turned into resize frames. Used by ``bottlenetctl bottle exec`` and by launchers that drive
:meth:`~bottlenet.control.blocking.BlockingControlClient.open_exec` themselves."""

from __future__ import annotations

import contextlib
import os
import signal
import termios
import tty
from collections.abc import Iterator

from bottlenet.control.execsession import ExecSession


def terminal_size(fd: int) -> tuple[int, int] | None:
    """(rows, cols) of the terminal on ``fd``, None when it is not one."""
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return None
    return size.lines, size.columns


#: Always turned into an orderly exit while the terminal is raw.
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
#: Signals whose default action ends the process and that a handler can catch: turned into
#: an orderly exit too, unless the process ignores or handles them already (then they do
#: not end it). SIGINT is Python's KeyboardInterrupt, which unwinds by itself.
_FATAL_BY_DEFAULT = tuple(
    getattr(signal, name)
    for name in (
        "SIGQUIT",
        "SIGUSR1",
        "SIGUSR2",
        "SIGALRM",
        "SIGPIPE",
        "SIGVTALRM",
        "SIGPROF",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGIO",
        "SIGPWR",
        "SIGSYS",
        "SIGTRAP",
        "SIGSTKFLT",
    )
    if hasattr(signal, name)
)


@contextlib.contextmanager
def raw_terminal(fd: int | None) -> Iterator[None]:
    """Raw mode on ``fd`` (a terminal) for the block; restored however the block ends.

    SIGTERM, SIGHUP and every other catchable signal that would end the process as things
    stand (QUIT, USR1, USR2, ALRM, PIPE, ...) are turned into an orderly exit, so the
    ``finally`` runs (exit status 128 + the signal's number).
    """
    if fd is None:
        yield
        return
    saved = termios.tcgetattr(fd)

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, leave) for s in _ENDING_SIGNALS}
    for s in _FATAL_BY_DEFAULT:
        if signal.getsignal(s) == signal.SIG_DFL:
            old[s] = signal.signal(s, leave)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSAFLUSH, saved)
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def forward_winch(session: ExecSession, fd: int | None) -> Iterator[None]:
    if fd is None:
        yield
        return

    def on_winch(signum: int, frame: object) -> None:
        size = terminal_size(fd)
        if size is not None:
            session.resize(*size)

    old = signal.signal(signal.SIGWINCH, on_winch)
    try:
        yield
    finally:
        signal.signal(signal.SIGWINCH, old)
