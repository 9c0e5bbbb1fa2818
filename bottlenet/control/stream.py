"""The frames of an exec session: what flows on a control connection after ``Exec`` switched it.

An exec's bytes never travel inside AMP boxes (a box value is capped at 64 KiB and every box
is parsed by the control parser): the daemon answers ``bottlenet.Exec`` and from then on the
same connection carries only these frames, in both directions, until the command ends and
the daemon closes it. The connection was authenticated before the command (peer uid on the
UNIX socket, client certificate on TLS), so there is no second socket to find, race for or
leak, and a session is single-use by construction.

Each frame is ``kind`` (1 byte), ``length`` (4 bytes, big-endian) and ``length`` bytes:

- client to daemon: ``STDIN`` (bytes for the command's stdin or terminal), ``STDIN_EOF``
  (empty), ``RESIZE`` (rows and columns, 2 bytes each);
- daemon to client: ``STDOUT``, ``STDERR`` (bytes; with a TTY there is only ``STDOUT``),
  ``EXIT`` (the command's exit code, 4 bytes signed), after which the daemon closes.

With file descriptors (``Exec``'s ``fds``, answered ``fds`` True on a UNIX socket) no byte of
the command's stdio is framed: the client sends ``FDS_READY`` once it reads with
``recvmsg``, the daemon answers ``FDS`` (3 bytes, carrying the command's stdin, stdout and
stderr as ``SCM_RIGHTS``), the client sends ``FDS_TAKEN`` (the daemon then closes its
copies), and the daemon sends ``EXIT`` when the command has ended and the fds were taken.

Nothing here knows about reactors; both clients and the daemon use it.
"""

from __future__ import annotations

import socket
import struct
from typing import NamedTuple

STDIN = 1
STDIN_EOF = 2
RESIZE = 3
FDS_READY = 4
FDS_TAKEN = 5
STDOUT = 16
STDERR = 17
EXIT = 18
FDS = 19

CLIENT_KINDS = frozenset({STDIN, STDIN_EOF, RESIZE})
DAEMON_KINDS = frozenset({STDOUT, STDERR, EXIT})
#: With file descriptors: what the client may send, what the daemon sends.
FD_CLIENT_KINDS = frozenset({FDS_READY, FDS_TAKEN})
FD_DAEMON_KINDS = frozenset({FDS, EXIT})
#: The command's stdin, stdout and stderr, in this order, one per payload byte of ``FDS``.
FD_COUNT = 3
#: No frame carries more than this; bigger writes are split.
MAX_FRAME = 65536
_HEADER = struct.Struct(">BI")
HEADER_SIZE = _HEADER.size


def widen_send_buffer(sock: socket.socket, size: int) -> None:
    """Let a UNIX socket hold ``size`` bytes unsent, so bulk frames move in fewer, larger
    reads at the other end; a refusal (a lower ``wmem_max``) only costs speed."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
    except OSError:
        pass


class StreamError(Exception):
    """A frame that breaks the rules (unknown kind, too long, malformed payload)."""


class Frame(NamedTuple):
    """One frame: its kind and its payload (a NamedTuple: ``bottlenetctl bottle exec``
    imports this module, and attrs costs its start-up)."""

    kind: int
    payload: bytes = b""


def header(kind: int, length: int) -> bytes:
    """The 5 bytes before a payload of ``length`` (at most :data:`MAX_FRAME`): a sender that
    writes them and the payload apart saves copying the payload into one frame."""
    return _HEADER.pack(kind, length)


def encode(kind: int, payload: bytes = b"") -> bytes:
    """One or more frames of ``kind`` holding ``payload`` (split at :data:`MAX_FRAME`)."""
    if len(payload) <= MAX_FRAME:
        return _HEADER.pack(kind, len(payload)) + payload
    parts = []
    for i in range(0, len(payload), MAX_FRAME):
        chunk = payload[i : i + MAX_FRAME]
        parts.append(_HEADER.pack(kind, len(chunk)) + chunk)
    return b"".join(parts)


def encode_resize(rows: int, cols: int) -> bytes:
    return encode(RESIZE, struct.pack(">HH", clamp_size(rows), clamp_size(cols)))


def decode_resize(payload: bytes) -> tuple[int, int]:
    if len(payload) != 4:
        raise StreamError("resize frame must hold 4 bytes")
    rows, cols = struct.unpack(">HH", payload)
    return rows, cols


def encode_exit(code: int) -> bytes:
    return encode(EXIT, struct.pack(">i", code))


def decode_exit(payload: bytes) -> int:
    if len(payload) != 4:
        raise StreamError("exit frame must hold 4 bytes")
    code: int = struct.unpack(">i", payload)[0]
    return code


def clamp_size(n: int) -> int:
    """Terminal dimensions as the kernel keeps them (unsigned short), 0 meaning unknown."""
    return max(0, min(int(n), 0xFFFF))


class FrameParser:
    """Incremental parser; ``allowed`` is the set of kinds the peer may send.

    Each payload is copied once, straight out of the data fed: only a frame cut by the end
    of one read waits in a buffer (bulk output reads many frames at a time, and copying
    every read into a buffer cost more CPU than the rest of the client together)."""

    def __init__(self, allowed: frozenset[int]) -> None:
        self._allowed = allowed
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        frames: list[Frame] = []
        pos = 0
        if self._buf:  # complete the frame cut by the last read first
            pos = self._complete(data, frames)
            if self._buf:
                return frames
        end = len(data)
        unpack = _HEADER.unpack_from
        while end - pos >= HEADER_SIZE:
            kind, length = unpack(data, pos)
            self._check(kind, length)
            start = pos + HEADER_SIZE
            if end - start < length:
                break
            pos = start + length
            frames.append(Frame(kind, data[start:pos]))
        if pos < end:
            self._buf += data[pos:]
            if len(self._buf) >= HEADER_SIZE:  # a bad header is refused before its payload
                self._check(*_HEADER.unpack_from(self._buf))
        return frames

    def _complete(self, data: bytes, frames: list[Frame]) -> int:
        """Add to the buffered frame what it lacks from ``data``; how much of it was used."""
        buf = self._buf
        used = 0
        if len(buf) < HEADER_SIZE:
            used = min(HEADER_SIZE - len(buf), len(data))
            buf += data[:used]
            if len(buf) < HEADER_SIZE:
                return used
        kind, length = _HEADER.unpack_from(buf)
        self._check(kind, length)
        take = min(HEADER_SIZE + length - len(buf), len(data) - used)
        buf += data[used : used + take]
        used += take
        if len(buf) == HEADER_SIZE + length:
            frames.append(Frame(kind, bytes(buf[HEADER_SIZE:])))
            self._buf = bytearray()
        return used

    def _check(self, kind: int, length: int) -> None:
        if kind not in self._allowed:
            raise StreamError(f"unexpected frame kind {kind}")
        if length > MAX_FRAME:
            raise StreamError("frame too long")

    @property
    def buffered(self) -> int:
        return len(self._buf)
