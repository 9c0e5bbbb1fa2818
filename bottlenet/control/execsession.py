"""A running exec on the client side: stdin in, stdout/stderr out, over a connection that
``Exec`` switched to the frames of :mod:`bottlenet.control.stream`.

Shared by the blocking client and the light client (so ``bottlenetctl bottle exec`` on a UNIX
socket starts without importing AMP); plain sockets and ``select``, no Twisted.

When the daemon granted file descriptors (``fds``), the session takes the command's stdin,
stdout and stderr pipes from the daemon (``SCM_RIGHTS``) and copies between them and its own
files directly; only the exit code comes over the connection.
"""

from __future__ import annotations

import os
import select
import socket
import sys
from enum import StrEnum
from typing import IO, TYPE_CHECKING, Any

from bottlenet.control import stream
from bottlenet.control.clienterrors import ControlConnectionError
from bottlenet.control.smolvmnote import NoteFilter

if TYPE_CHECKING:
    import ssl

#: Input an exec session holds while the daemon is slow to take it (then stdin waits).
MAX_OUTGOING = 256 * 1024
#: One read from a pipe of the command (or from our stdin, for it).
CHUNK = 256 * 1024
#: What a UNIX socket may hold unsent: the daemon then reads our stdin's frames in bulk.
SEND_BUFFER = 1024 * 1024


def _tls_of(sock: socket.socket) -> tuple[ssl.SSLSocket | None, tuple[type[OSError], ...]]:
    """``sock`` if it is a TLS socket, and the errors that mean "try again" on it.

    A TLS socket was made by code that imported :mod:`ssl`, so a UNIX socket's session (the
    light client's) never imports it (about 9 ms of ``bottlenetctl bottle exec``'s start).
    """
    ssl_module = sys.modules.get("ssl")
    if ssl_module is None or not isinstance(sock, ssl_module.SSLSocket):
        return None, (BlockingIOError,)
    return sock, (BlockingIOError, ssl_module.SSLWantReadError, ssl_module.SSLWantWriteError)


class ExecSession:
    """A running exec: pump stdin in, stdout/stderr out, until the command's exit code.

    :meth:`resize` may be called from a signal handler (SIGWINCH): it only records the size
    and wakes the loop through a pipe; the loop sends the frame.
    """

    def __init__(
        self, sock: socket.socket, leftover: bytes, *, tty: bool, stdin: bool, fds: bool = False
    ) -> None:
        self.sock = sock
        self.tty = tty
        self.forward_stdin = stdin
        #: The daemon hands over the command's stdio (its answer said ``fds``).
        self.fds = fds
        self._leftover = leftover
        self._parser = stream.FrameParser(stream.FD_DAEMON_KINDS if fds else stream.DAEMON_KINDS)
        self._pipes: list[int] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._size: tuple[int, int] | None = None
        self.exit_code: int | None = None
        self._tls, self._retry = _tls_of(sock)

    def __enter__(self) -> ExecSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()
        for fd in (self._wake_r, self._wake_w, *self._pipes):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1
        self._pipes = []

    def resize(self, rows: int, cols: int) -> None:
        self._size = (rows, cols)
        try:
            os.write(self._wake_w, b"r")
        except OSError:
            pass

    def run(
        self,
        stdin: IO[bytes] | None = None,
        stdout: IO[bytes] | None = None,
        stderr: IO[bytes] | None = None,
    ) -> int:
        """Pump until the command ends; its exit code (ControlConnectionError if the
        daemon goes away first).

        The socket is non-blocking: input waits in a bounded buffer while the daemon is slow
        to take it, and output is read all the while (a full pipe one way never stalls the
        other way).
        """
        try:
            if self.fds:
                self._pump(*self._take_fds(), stdin, stdout, stderr)
            else:
                self._run_framed(stdin, stdout, stderr)
        except stream.StreamError as e:
            raise ControlConnectionError(f"bad exec data from the daemon: {e}") from None
        except OSError as e:
            raise ControlConnectionError(
                f"the connection to the daemon broke during exec: {e.strerror or e}"
            ) from None
        if self.exit_code is None:
            raise ControlConnectionError(
                "the daemon closed the connection before the command ended"
            )
        return self.exit_code

    def _run_framed(
        self, stdin: IO[bytes] | None, stdout: IO[bytes] | None, stderr: IO[bytes] | None
    ) -> None:
        out = bytearray()
        stdin_fd: int | None = None
        if stdin is not None and self.forward_stdin:
            try:
                stdin_fd = stdin.fileno()
            except (AttributeError, OSError, ValueError):
                out += stream.encode(stream.STDIN, stdin.read()) + stream.encode(stream.STDIN_EOF)
        self.sock.setblocking(False)
        if self.sock.family == socket.AF_UNIX:
            stream.widen_send_buffer(self.sock, SEND_BUFFER)
        if self._leftover:
            self._receive(self._leftover, stdout, stderr)
            self._leftover = b""
        while self.exit_code is None:
            readers: list[Any] = [self.sock, self._wake_r]
            if stdin_fd is not None and len(out) < MAX_OUTGOING:
                readers.append(stdin_fd)
            writers = [self.sock] if out else []
            pending = self._tls is not None and self._tls.pending() > 0
            ready: list[Any]
            writable: list[Any]
            if pending:
                ready, writable = [self.sock], []
            else:
                ready, writable, _ = select.select(readers, writers, [])
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 512)
                except BlockingIOError:
                    pass
                size, self._size = self._size, None
                if size is not None:
                    out += stream.encode_resize(*size)
            if stdin_fd is not None and stdin_fd in ready:
                try:
                    data = os.read(stdin_fd, 65536)
                except OSError:
                    data = b""
                if data:
                    out += stream.encode(stream.STDIN, data)
                else:
                    out += stream.encode(stream.STDIN_EOF)
                    stdin_fd = None
            if out and (self.sock in writable or not pending):
                try:
                    sent = self.sock.send(out)
                    del out[:sent]
                except self._retry:
                    pass
            if self.sock in ready:
                try:
                    chunk = self.sock.recv(CHUNK)
                except self._retry:
                    continue
                if not chunk:
                    break
                self._receive(chunk, stdout, stderr)

    def _receive(self, data: bytes, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        """Write what ``data`` carries; each sink is flushed once per read, not per frame."""
        written: set[IO[bytes]] = set()
        try:
            for frame in self._parser.feed(data):
                if frame.kind == stream.EXIT:
                    self.exit_code = stream.decode_exit(frame.payload)
                    return
                sink = stderr if frame.kind == stream.STDERR else stdout
                if sink is not None:
                    sink.write(frame.payload)
                    written.add(sink)
        finally:
            for sink in written:
                sink.flush()

    # -- file descriptors ---------------------------------------------------------------

    def _take_fds(self) -> tuple[int, int, int]:
        """Ask for the fds, read until the FDS frame (every read with recvmsg: fds on bytes
        read plainly would be lost), say they were taken."""
        self.sock.setblocking(True)
        self.sock.sendall(stream.encode(stream.FDS_READY))
        frames = self._parser.feed(self._leftover)
        self._leftover = b""
        while not any(f.kind == stream.FDS for f in frames):
            if any(f.kind == stream.EXIT for f in frames):
                raise stream.StreamError("exit before the file descriptors")
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 65536, stream.FD_COUNT + 1)
            self._pipes += fds
            if len(self._pipes) > stream.FD_COUNT:
                raise stream.StreamError("too many file descriptors")
            if not data:
                raise ControlConnectionError(
                    "the daemon closed the connection before the command ended"
                )
            frames += self._parser.feed(data)
        if len(self._pipes) != stream.FD_COUNT or len(frames) != 1:
            raise stream.StreamError("the FDS frame did not carry the command's three pipes")
        self.sock.sendall(stream.encode(stream.FDS_TAKEN))
        in_w, out_r, err_r = self._pipes
        return in_w, out_r, err_r

    def _pump(
        self,
        in_w: int,
        out_r: int,
        err_r: int,
        stdin: IO[bytes] | None,
        stdout: IO[bytes] | None,
        stderr: IO[bytes] | None,
    ) -> None:
        """Copy until the exit code is in and both output pipes are at their end."""
        copy = _StdinCopy(in_w)
        if stdin is not None and self.forward_stdin:
            copy.open(stdin)
        # an in-memory stdin that is empty is at its end now: no event would come to say so
        if copy.state is _Input.CLOSED or copy.write([]):
            self._close_pipe(in_w)
        sinks = {out_r: stdout, err_r: stderr}
        note = NoteFilter()  # smolvm's packed-assets note heads the stderr pipe: not ours
        while self.exit_code is None or sinks:
            readers: list[int] = [*sinks, *copy.readers()]
            if self.exit_code is None:
                readers.append(self.sock.fileno())
            ready, writable, _ = select.select(readers, copy.writers(), [])
            copy.room(writable)
            for fd in ready:
                if fd == copy.source:
                    copy.read()
                elif fd in sinks:
                    raw = _read(fd)
                    sink = sinks[fd]
                    data = raw
                    if fd == err_r:
                        data = note.feed(raw) if raw else note.flush()
                    if not raw:
                        del sinks[fd]
                    if data and sink is not None:
                        sink.write(data)
                        sink.flush()
                elif not self._exit_frame():
                    return  # the daemon went away (or closed after EXIT)
            if copy.write(writable):
                self._close_pipe(in_w)

    def _exit_frame(self) -> bool:
        """Read the connection (only EXIT may come); False when the daemon closed it."""
        chunk = self.sock.recv(64)
        if not chunk:
            return False
        for frame in self._parser.feed(chunk):
            if frame.kind != stream.EXIT:
                raise stream.StreamError(f"unexpected frame kind {frame.kind}")
            self.exit_code = stream.decode_exit(frame.payload)
        return True

    def _close_pipe(self, fd: int) -> None:
        self._pipes.remove(fd)
        os.close(fd)


class _Input(StrEnum):
    """Where the copy of our stdin into the command's stdin pipe is."""

    #: Reading our stdin (and, pipe to pipe, letting the kernel move it: splice).
    READING = "reading"
    #: The command's stdin pipe refused the last splice: wait until it has room.
    FULL = "full"
    #: Our stdin is at its end: what is still held is written, then the pipe closes.
    DRAINING = "draining"
    #: No input (none forwarded, or all of it written and the pipe closed).
    CLOSED = "closed"


class _StdinCopy:
    """Our stdin into the command's stdin pipe (fd sessions), in named states."""

    def __init__(self, pipe: int) -> None:
        self.pipe = pipe
        self.state = _Input.CLOSED
        self.source: int | None = None  # our stdin's fd while reading it
        self.pending = bytearray()  # read, not yet written (copies that are not splices)
        self.splice = hasattr(os, "splice")

    def open(self, stdin: IO[bytes]) -> None:
        os.set_blocking(self.pipe, False)
        try:
            self.source = stdin.fileno()
            self.state = _Input.READING
        except (AttributeError, OSError, ValueError):
            self.pending += stdin.read()
            self.state = _Input.DRAINING  # nothing more to read: EOF once pending is written

    def readers(self) -> list[int]:
        reading = self.state is _Input.READING and not self.pending
        return [self.source] if reading and self.source is not None else []

    def writers(self) -> list[int]:
        if self.state is _Input.FULL or (self.state is not _Input.CLOSED and self.pending):
            return [self.pipe]
        return []

    def room(self, writable: list[int]) -> None:
        if self.state is _Input.FULL and self.pipe in writable:
            self.state = _Input.READING

    def read(self) -> None:
        """Our stdin is readable: splice it into the pipe, or hold what it gave."""
        assert self.source is not None
        if self.splice:
            try:
                moved = os.splice(self.source, self.pipe, CHUNK, flags=os.SPLICE_F_NONBLOCK)
            except BlockingIOError:
                self.state = _Input.FULL
                return
            except BrokenPipeError:
                moved = 0
            except OSError:  # not pipes (a file, a socket): copy through here
                self.splice = False
                return
            if not moved:
                self._at_end()
            return
        data = _read(self.source)
        if data:
            self.pending += data
        else:
            self._at_end()

    def _at_end(self) -> None:
        self.state, self.source = _Input.DRAINING, None

    def write(self, writable: list[int]) -> bool:
        """Write what is held if the pipe has room; True when the pipe is to close now."""
        if self.state is _Input.CLOSED:
            return False
        if self.pipe in writable:
            try:
                del self.pending[: os.write(self.pipe, self.pending)]
            except BlockingIOError:
                pass
            except BrokenPipeError:  # the command closed its stdin: no more input
                self.pending.clear()
                self._at_end()
        if self.state is _Input.DRAINING and not self.pending:
            self.state = _Input.CLOSED
            return True
        return False


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, CHUNK)
    except OSError:
        return b""
