"""The daemon's half of an exec session: a smolvm child on one side, a switched control
connection on the other (frames of :mod:`bottlenet.control.stream`).

Why a switched connection rather than a second socket: the control connection is already
authenticated (peer uid, or a verified client certificate for TLS), it works for remote
launchers too, nobody else can connect to it, and it is single-use by construction (it closes
when the command ends). Back-pressure holds both ways: a client that stops reading pauses
the child's output, a child that stops reading its stdin pauses the client.

No byte of the command line, its input or its output is ever logged; the log says which
bottle, which peer, whether a terminal was used, and the exit code.

With ``fds`` (a local client on the UNIX socket asked for them, and no terminal) the child's
stdin, stdout and stderr are pipes whose other ends the client takes over ``SCM_RIGHTS``: the
command's bytes never pass through the daemon, which still owns the child (its end, its
exit code, its log line) and tells the exit code over the connection.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from typing import Any

from twisted.internet.error import ProcessDone, ProcessExitedAlready, ProcessTerminated
from twisted.internet.interfaces import IDelayedCall, IProcessTransport, IPushProducer
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from bottlenet.control import stream
from bottlenet.control.stream import FrameParser, StreamError

#: After the client is gone, the child gets SIGTERM, and SIGKILL this many seconds later.
KILL_GRACE = 3.0
#: The size asked for each pipe handed to a client (Linux's default cap for a user).
PIPE_SIZE = 1024 * 1024
#: The exit code of a command its Exec's ``time_limit`` ended (as timeout(1), smolvm --timeout).
TIMEOUT_EXIT = 124
#: Output read from the child before the client is attached (or while it is paused).
MAX_PENDING = 256 * 1024
#: What the reactor reads from a child's pipe at a time (``twisted.internet.fdesc``).
REACTOR_READ = 8192
#: The most of a child's output the bridge reads in one turn of the reactor (whole frames).
TURN_READ = 4 * stream.MAX_FRAME


@implementer(IPushProducer)
class ExecBridge(ProcessProtocol):
    """One exec: process protocol of the smolvm child, and the stream end of the connection.

    ``resize(process, rows, cols)`` applies a terminal size; ``on_end()`` is told once the
    session is over (child gone and client detached).
    """

    log = Logger()

    def __init__(
        self,
        *,
        bottle: str,
        peer: str,
        tty: bool,
        stdin: bool,
        clock: Any,
        resize: Callable[[IProcessTransport, int, int], None],
        on_end: Callable[[ExecBridge], None] = lambda _: None,
        fds: bool = False,
    ) -> None:
        self.bottle = bottle
        self.peer = peer
        self.tty = tty
        self.stdin = stdin
        self._clock = clock
        self._resize = resize
        self._on_end = on_end
        self.fds = fds and not tty
        self._parser = FrameParser(stream.FD_CLIENT_KINDS if self.fds else stream.CLIENT_KINDS)
        #: fd mode: the child's ends (closed once it runs), the client's (until it took them).
        self._child_fds: list[int] = []
        self._client_fds: list[int] = []
        self._fds_sent = False
        self._fds_taken = False
        self._client: Any = None  # the connection's transport, once switched
        self._pending: list[bytes] = []
        self._pending_size = 0
        self._child_paused = False
        self._exit_code: int | None = None
        self._client_gone = False
        self._kill_timer: IDelayedCall | None = None
        self._deadline: IDelayedCall | None = None
        self._timed_out = False
        self._ended = False

    # -- the smolvm child ---------------------------------------------------------------

    @property
    def process(self) -> IProcessTransport | None:
        transport: IProcessTransport | None = self.transport
        return transport

    def connectionMade(self) -> None:
        assert self.transport is not None
        if self.fds:
            return  # the child's stdio are the client's pipes, not ours
        if not self.stdin and not self.tty:
            self.transport.closeStdin()
        # The child's stdin (its pipe, or the pty master for a tty) tells us when it is full:
        # reading from the client stops until it drains, so the daemon buffers at most about
        # one write buffer plus one read of the client per session, whatever the client sends.
        register = getattr(self.transport, "registerProducer", None)
        if register is not None and (self.stdin or self.tty):
            register(_ClientPauser(self), True)

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        kind = stream.STDERR if childFD == 2 else stream.STDOUT
        # A read as full as the reactor's means more is waiting: it goes out in full frames,
        # up to TURN_READ per turn of the reactor, not in a frame per 8 KiB.
        fd = self._child_fd(childFD) if len(data) >= REACTOR_READ else None
        sent = 0
        while True:
            if fd is not None:
                data = _fill(fd, data, stream.MAX_FRAME)
            self._send(stream.encode(kind, data))
            sent += len(data)
            if fd is None or len(data) < stream.MAX_FRAME or sent >= TURN_READ:
                return
            if self._child_paused or self._client_gone:  # back-pressure holds mid-turn too
                return
            data = _fill(fd, b"", stream.MAX_FRAME)
            if not data:
                return

    def _child_fd(self, childFD: int) -> int | None:
        transport: Any = self.transport
        pipes = getattr(transport, "pipes", None)
        if pipes is None:  # a pty: one master for the child's output
            fileno = getattr(transport, "fileno", None)
            return fileno() if fileno is not None and childFD == 1 else None
        end = pipes.get(childFD)
        return end.fileno() if end is not None else None

    def processEnded(self, reason: Failure) -> None:
        code = 255
        exc = reason.value
        if isinstance(exc, ProcessDone):
            code = 0
        elif isinstance(exc, ProcessTerminated):
            if exc.exitCode is not None:
                code = exc.exitCode
            elif exc.signal is not None:
                code = 128 + exc.signal
        if self._timed_out:
            code = TIMEOUT_EXIT
        self._exit_code = code
        for timer in (self._kill_timer, self._deadline):
            if timer is not None and timer.active():
                timer.cancel()
        self._kill_timer = self._deadline = None
        self.log.info(
            "exec in bottle {bottle} by {peer} ended: exit {code} (tty={tty})",
            bottle=self.bottle,
            peer=self.peer,
            code=code,
            tty=self.tty,
        )
        self._finish()

    def _finish(self) -> None:
        """The exit code to the client, then the connection closed; with fds only once the
        client has taken them (or its output, still in the pipes, would be lost)."""
        if self._exit_code is None or (self.fds and not self._fds_taken and not self._client_gone):
            return
        self._send(stream.encode_exit(self._exit_code))
        if self._client is not None:
            self._client.unregisterProducer()
            self._client.loseConnection()
        self._maybe_end()

    # -- the switched connection ----------------------------------------------------------

    def attach(self, transport: Any, leftover: bytes) -> None:
        """The connection now carries frames; ``leftover`` is what arrived after Exec."""
        self._client = transport
        transport.registerProducer(self, True)
        pending, self._pending, self._pending_size = self._pending, [], 0
        for chunk in pending:
            transport.write(chunk)
        if self._child_paused:
            self._resume_child()
        if self._exit_code is not None and not self.fds:
            transport.unregisterProducer()
            transport.loseConnection()
            return
        if leftover:
            self.client_data(leftover)

    def client_data(self, data: bytes) -> None:
        try:
            self._apply_frames(self._parser.feed(data))
        except StreamError as e:  # a bad header, or a bad payload (RESIZE of the wrong size)
            self.log.warn(
                "exec in bottle {bottle}: closing the session of {peer}: {why}",
                bottle=self.bottle,
                peer=self.peer,
                why=str(e),
            )
            if self._client is not None:
                self._client.abortConnection()

    def _apply_frames(self, frames: list[stream.Frame]) -> None:
        if self.fds:
            for frame in frames:
                self._fd_frame(frame)
            return
        process = self.process
        for frame in frames:
            if process is None or self._exit_code is not None:
                return
            if frame.kind == stream.STDIN:
                if self.stdin or self.tty:
                    process.write(frame.payload)
            elif frame.kind == stream.STDIN_EOF:
                if not self.tty:
                    # A pipe with a producer registered never closes: unregister first.
                    unregister = getattr(process, "unregisterProducer", None)
                    if unregister is not None and self.stdin:
                        unregister()
                        if self._client is not None:
                            self._client.resumeProducing()
                    process.closeStdin()
            elif frame.kind == stream.RESIZE:
                rows, cols = stream.decode_resize(frame.payload)
                if self.tty:
                    self._resize(process, rows, cols)

    # -- file descriptors -----------------------------------------------------------------

    def make_stdio(self) -> tuple[int, int, int]:
        """Pipes for the command's stdin, stdout and stderr: the child's ends, to spawn it
        with (the client's ends are kept until it has taken them)."""
        pipes: list[tuple[int, int]] = []
        try:
            for _ in range(stream.FD_COUNT):
                pipes.append(os.pipe())
        except OSError:
            _close_all([fd for pair in pipes for fd in pair])
            raise
        (in_r, in_w), (out_r, out_w), (err_r, err_w) = pipes
        for _, w in pipes:  # fewer, larger copies for bulk data; a refusal only costs speed
            try:
                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
            except OSError:
                pass
        self._child_fds = [in_r, out_w, err_w]
        self._client_fds = [in_w, out_r, err_r]
        return in_r, out_w, err_w

    def spawned(self) -> None:
        """The child has its own copies of its ends: the daemon's go (or no EOF would come)."""
        _close_all(self._child_fds)

    def close_fds(self) -> None:
        _close_all(self._child_fds)
        _close_all(self._client_fds)

    def _fd_frame(self, frame: stream.Frame) -> None:
        if frame.kind == stream.FDS_READY and not self._fds_sent and self._client is not None:
            # The client reads with recvmsg from now on: each fd rides on one byte of FDS.
            self._fds_sent = True
            for fd in self._client_fds:
                self._client.sendFileDescriptor(fd)
            self._client.write(stream.encode(stream.FDS, bytes(len(self._client_fds))))
        elif frame.kind == stream.FDS_TAKEN and self._fds_sent and not self._fds_taken:
            # It has them (the kernel holds in-flight copies once sendmsg returned, and the
            # client saw the bytes): the daemon's copies go, so the child sees stdin's EOF.
            self._fds_taken = True
            _close_all(self._client_fds)
            self._finish()
        else:
            raise StreamError(f"unexpected frame kind {frame.kind} in this state")

    def client_lost(self) -> None:
        """The client went away: end the command (the child, hence the guest command).

        Told once or twice (the connection's producer stops, then the connection is lost):
        acted on once."""
        if self._client_gone:
            return
        self._client_gone = True
        self._client = None
        self.close_fds()
        if self._exit_code is None and self.process is not None:
            self.log.info(
                "exec in bottle {bottle}: client {peer} went away; ending the command",
                bottle=self.bottle,
                peer=self.peer,
            )
            self.terminate()
        self._maybe_end()

    def set_deadline(self, seconds: float) -> None:
        """The command is ended after ``seconds`` (Exec's ``time_limit``), whoever holds its
        stdio; its exit code is then :data:`TIMEOUT_EXIT`."""
        if self._exit_code is None and self._deadline is None:
            self._deadline = self._clock.callLater(seconds, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        if self._exit_code is not None or self.process is None:
            return
        self._timed_out = True
        self.log.info(
            "exec in bottle {bottle} by {peer}: timeout; ending the command",
            bottle=self.bottle,
            peer=self.peer,
        )
        self.terminate()

    def terminate(self) -> None:
        """SIGTERM now, SIGKILL after :data:`KILL_GRACE` (idempotent)."""
        process = self.process
        if process is None or self._exit_code is not None or self._kill_timer is not None:
            return
        self._signal("TERM")
        self._kill_timer = self._clock.callLater(KILL_GRACE, self._signal, "KILL")

    def _signal(self, name: str) -> None:
        process = self.process
        if process is None or self._exit_code is not None:
            return
        try:
            process.signalProcess(name)
        except (ProcessExitedAlready, OSError):
            pass

    def _maybe_end(self) -> None:
        if self._ended or self._exit_code is None:
            return
        if self._client is not None and not self._client_gone:
            return
        self._ended = True
        self._on_end(self)

    # -- flow control -------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        if self._client is not None:
            self._client.write(data)
            return
        if self._client_gone:
            return
        self._pending.append(data)
        self._pending_size += len(data)
        if self._pending_size > MAX_PENDING:
            self._pause_child()

    def _pause_child(self) -> None:
        process = self.process
        if not self._child_paused and process is not None and self._exit_code is None:
            self._child_paused = True
            pause = getattr(process, "pauseProducing", None)
            if pause is not None:
                pause()

    def _resume_child(self) -> None:
        process = self.process
        if self._child_paused and process is not None and self._exit_code is None:
            self._child_paused = False
            resume = getattr(process, "resumeProducing", None)
            if resume is not None:
                resume()

    # IPushProducer for the connection: its write buffer is full, or has room again.
    def pauseProducing(self) -> None:
        self._pause_child()

    def resumeProducing(self) -> None:
        self._resume_child()

    def stopProducing(self) -> None:
        self.client_lost()


def _fill(fd: int, data: bytes, size: int) -> bytes:
    """``data`` and what else ``fd`` (non-blocking) holds now, up to ``size`` bytes. An EOF
    or error met here is met again, and acted on, by the reactor's next read."""
    parts = [data]
    have = len(data)
    while have < size:
        try:
            more = os.read(fd, size - have)
        except OSError:  # drained (EAGAIN), or the reactor's next read will see why
            break
        if not more:
            break
        parts.append(more)
        have += len(more)
    return data if len(parts) == 1 else b"".join(parts)


def _close_all(fds: list[int]) -> None:
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


@implementer(IPushProducer)
class _ClientPauser:
    """Registered on the child's stdin: a full pipe pauses reading from the client."""

    def __init__(self, bridge: ExecBridge) -> None:
        self.bridge = bridge

    def pauseProducing(self) -> None:
        client = self.bridge._client
        if client is not None:
            client.pauseProducing()

    def resumeProducing(self) -> None:
        client = self.bridge._client
        if client is not None:
            client.resumeProducing()

    def stopProducing(self) -> None:
        pass
