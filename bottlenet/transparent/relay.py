"""The parts every long-running guest program of bottlenet's shares: the bridge's and the
transparent egress layer's.

:func:`lifeline`: the program's stdin is its lifeline. When stdin is a pipe or a socket (the
daemon's exec session), its end ends the program at once, so it never outlives the session
that started it (a daemon killed with SIGKILL included); each line it reads may be handed to
the program (the bridge's ``down <port>``), at most :data:`MAX_LINE` bytes kept. Fed from a
file or a terminal, the program runs until killed.

:func:`pump`: one direction of a relay, blocking, with half-close: ``src`` is copied to
``dst`` until it ends, then ``dst`` is shut for writing and the other direction keeps flowing;
a failure on either side ends both directions. One buffer per direction (large reads are few
system calls per byte; the bridge's measurements are in its module).

Standard library only, Python 3.7 or later (the bridge still runs on an image's python3 where
no kit is mounted); :func:`bottlenet.transparent.script.bootstrap` carries it there.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Callable

#: The longest stdin line kept for :func:`lifeline`'s callback.
MAX_LINE = 64


def lifeline(on_line: Callable[[bytes], None] | None = None) -> None:
    """Exit when stdin (a pipe or a socket) ends; each complete line goes to ``on_line``
    (anything else is discarded). Returns at once when stdin is neither."""
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        return
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return
    line = b""
    while True:
        try:
            data = os.read(0, 4096)
        except OSError:
            data = b""
        if not data:
            os._exit(0)
        if on_line is None:
            continue
        line += data
        while b"\n" in line:
            one, line = line.split(b"\n", 1)
            on_line(one)
        line = line[-MAX_LINE:]


def pump(
    src: socket.socket,
    dst: socket.socket,
    chunk: int,
    first: Callable[[], None] | None = None,
) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends, then half-close ``dst``; ``first`` is
    called once, when the first bytes arrived."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    try:
        while True:
            n = src.recv_into(buf)
            if not n:
                break
            if first is not None:
                first()
                first = None
            dst.sendall(view[:n])
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    except OSError:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def spawn(target: Callable[..., object], *args: object) -> threading.Thread:
    """``target(*args)`` in a daemon thread, started (RuntimeError: no thread to be had)."""
    t = threading.Thread(target=target, args=args)
    t.daemon = True
    t.start()
    return t
