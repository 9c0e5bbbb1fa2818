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

The session's lifecycle is declared: two typed machines (``automat``), the session
(:class:`ExecState`: starting, attached, input closed, the fd handover, exited, client
gone, closing, closed) and the child's end (:class:`ChildState`: the TERM, then the KILL
grace as a state with its timer); ``docs/architecture.md`` draws both. The per-byte path
feeds neither.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from typing import Any, Protocol

from automat import TypeMachineBuilder
from twisted.internet.error import ProcessDone, ProcessExitedAlready, ProcessTerminated
from twisted.internet.interfaces import (
    IDelayedCall,
    IProcessTransport,
    IPushProducer,
    IReactorTime,
)
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from bottlenet.control import stream
from bottlenet.control.smolvmnote import NoteFilter
from bottlenet.control.stream import FrameParser, StreamError, widen_send_buffer

#: After the client is gone, the child gets SIGTERM, and SIGKILL this many seconds later.
KILL_GRACE = 3.0
#: The size asked for each pipe of the child (handed to a client, or read by the daemon) and
#: for a UNIX connection's send buffer (Linux's default cap for a user's pipe).
PIPE_SIZE = 1024 * 1024
#: The exit code of a command its Exec's ``time_limit`` ended (as timeout(1), smolvm --timeout).
TIMEOUT_EXIT = 124
#: Output read from the child before the client is attached (or while it is paused).
MAX_PENDING = 256 * 1024
#: What the reactor reads from a child's pipe at a time (``twisted.internet.fdesc``).
REACTOR_READ = 8192
#: The most of a child's output the bridge reads in one turn of the reactor (whole frames).
TURN_READ = 4 * stream.MAX_FRAME


class ExecState(StrEnum):
    """Where an exec session is: the client's side and the command's end, declared.

    Read with :attr:`ExecBridge.state`; the transitions are in :func:`_session_machine`
    and ``docs/architecture.md`` (Declared states, the exec session)."""

    #: The client is not attached yet: the command's output waits in a bounded buffer.
    STARTING = "starting"
    #: The client is attached and the command runs: bytes stream both ways.
    ATTACHED = "attached"
    #: Framed sessions: the client's input ended (STDIN_EOF; the child's stdin is closed),
    #: the command's output still streams: the session's one half-close.
    INPUT_CLOSED = "input-closed"
    #: fd sessions: the command's pipes went out on ``FDS``, the client has not said it took them.
    FDS_OFFERED = "fds-offered"
    #: fd sessions: the client holds the command's pipes.
    FDS_TAKEN = "fds-taken"
    #: The command ended; the client is not attached yet (or has not taken its pipes).
    EXITED = "exited"
    #: fd sessions: the command ended while its pipes were offered.
    EXITED_FDS_OFFERED = "exited-fds-offered"
    #: The client went away first: the command is being ended (see :class:`ChildState`).
    CLIENT_GONE = "client-gone"
    #: The exit code is written and the connection is closing.
    CLOSING = "closing"
    #: Both ends are done; ``on_end`` was told.
    CLOSED = "closed"


class ChildState(StrEnum):
    """Where the smolvm child is: the TERM, then KILL after a grace, as states with a timer.

    Read with :attr:`ExecBridge.child_state`; transitions in :func:`_child_machine`."""

    #: Not spawned yet (smolvm is being started).
    UNSTARTED = "unstarted"
    RUNNING = "running"
    #: SIGTERM sent; SIGKILL follows after :data:`KILL_GRACE` (its timer is the state's data).
    TERMINATING = "terminating"
    #: SIGKILL sent.
    KILLED = "killed"
    #: It ended (its exit code is known); every timer is cancelled.
    ENDED = "ended"


class _Session(Protocol):
    """The inputs of an exec session (one machine per session)."""

    def client_attached(self, transport: Any) -> None:
        """The connection switched to frames: the client is there."""

    def child_exited(self, code: int) -> None:
        """The command ended with ``code``."""

    def stdin_ended(self) -> None:
        """Framed sessions: the client's input ended (STDIN_EOF)."""

    def fds_ready(self) -> bool:
        """fd sessions: the client reads with ``recvmsg`` (False: not now)."""

    def fds_taken(self) -> bool:
        """fd sessions: the client has the pipes (False: not now)."""

    def client_lost(self) -> None:
        """The connection is gone (told once or twice: producer stop, then connection lost)."""

    def state(self) -> ExecState:
        """The read-out."""


class _Child(Protocol):
    """The inputs of the child's end (one machine per session)."""

    def started(self, process: IProcessTransport) -> None:
        """The smolvm child runs (``process``, its transport, is connected)."""

    def terminate(self) -> None:
        """End it: SIGTERM now, SIGKILL after the grace."""

    def expire(self) -> None:
        """Its time limit is over: end it, and its exit code is :data:`TIMEOUT_EXIT`."""

    def kill_timer_fired(self) -> None:
        """The grace is over."""

    def exited(self) -> None:
        """It ended."""

    def state(self) -> ChildState:
        """The read-out."""


@dataclass(eq=False)
class _ExecCore:
    """What an exec session's two machines read and write (Twisted's ``_client_service._Core``
    idiom): the per-byte path's pointers, which the transitions set (the client, the running
    child, where an output frame goes, the pending buffer), the child's deadline and exit.

    The KILL timer is not here: it is the data of :attr:`ChildState.TERMINATING`, made on
    entering it (:func:`_arm_kill`) and cancelled by the transition that leaves it."""

    bottle: str
    peer: str
    stdin: bool
    clock: IReactorTime
    #: The bridge as the connection's producer (the connection's buffer pauses the child).
    producer: IPushProducer
    #: Told once, when both ends are done.
    on_end: Callable[[], None]
    #: The bridge's logger (its events keep the bridge as their source).
    log: Logger
    #: The connection's transport, from attached until lost.
    client: Any = None
    #: The running child (None before it runs and once it ended).
    child: IProcessTransport | None = None
    #: Where an output frame goes: the pending buffer, the client's ``write``, or nowhere.
    out: Callable[[bytes], None] = field(init=False)
    pending: list[bytes] = field(default_factory=list)
    pending_size: int = 0
    #: Back-pressure: the connection's buffer is full (or the pending one).
    child_paused: bool = False
    deadline: IDelayedCall | None = None
    #: Why it ended: its exit code is :data:`TIMEOUT_EXIT`.
    timed_out: bool = False
    #: The command's exit code, once it ended (a value; the states say what it means).
    exit_code: int | None = None
    #: fd sessions: the child's ends (closed once it runs), the client's (until it took them).
    child_fds: list[int] = field(default_factory=list)
    client_fds: list[int] = field(default_factory=list)
    #: The child's machine, which the session's ``client_lost`` ends.
    ending: _Child = field(init=False)

    def __post_init__(self) -> None:
        self.out = self.buffer
        self.ending = _CHILD(self)

    def buffer(self, data: bytes) -> None:
        """Output while no client is attached: kept, up to about :data:`MAX_PENDING`."""
        self.pending.append(data)
        self.pending_size += len(data)
        if self.pending_size > MAX_PENDING:
            self.pause_child()

    def pause_child(self) -> None:
        process = self.child
        if not self.child_paused and process is not None:
            self.child_paused = True
            pause = getattr(process, "pauseProducing", None)
            if pause is not None:
                pause()

    def resume_child(self) -> None:
        process = self.child
        if self.child_paused and process is not None:
            self.child_paused = False
            resume = getattr(process, "resumeProducing", None)
            if resume is not None:
                resume()

    def signal(self, name: str) -> None:
        process = self.child
        if process is None:
            return
        try:
            process.signalProcess(name)
        except (ProcessExitedAlready, OSError):
            pass

    def set_deadline(self, seconds: float) -> None:
        if self.ending.state() is not ChildState.ENDED and self.deadline is None:
            self.deadline = self.clock.callLater(seconds, self.expire)

    def expire(self) -> None:
        self.deadline = None
        self.ending.expire()

    def close_fds(self) -> None:
        _close_all(self.child_fds)
        _close_all(self.client_fds)


@implementer(IPushProducer)
class ExecBridge(ProcessProtocol):
    """One exec: process protocol of the smolvm child, and the stream end of the connection.

    ``resize(process, rows, cols)`` applies a terminal size; ``on_end()`` is told once the
    session is over (child gone and client detached). Its lifecycle is two declared
    machines (:class:`ExecState`, :class:`ChildState`) over one core (:class:`_ExecCore`);
    the per-byte path (output frames, stdin writes, back-pressure) feeds neither: it writes
    through the core's ``out``, which the session's transitions point at the pending buffer,
    the client, or nowhere.
    """

    log = Logger()

    def __init__(
        self,
        *,
        bottle: str,
        peer: str,
        tty: bool,
        stdin: bool,
        clock: IReactorTime,
        resize: Callable[[IProcessTransport, int, int], None],
        on_end: Callable[[ExecBridge], None] = lambda _: None,
        fds: bool = False,
    ) -> None:
        self.bottle = bottle
        self.peer = peer
        self.tty = tty
        self.stdin = stdin
        self._resize = resize
        self.fds = fds and not tty
        self._parser = FrameParser(stream.FD_CLIENT_KINDS if self.fds else stream.CLIENT_KINDS)
        #: smolvm's packed-assets note heads its stderr (a terminal's one stream with -t):
        #: dropped there, never framed to the client (framed sessions only).
        self._note = NoteFilter()
        self._note_fd = 1 if tty else 2
        self._core = _ExecCore(
            bottle=bottle,
            peer=peer,
            stdin=stdin,
            clock=clock,
            producer=self,
            on_end=partial(on_end, self),
            log=self.log,
        )
        self._session = (_HANDOVER_SESSION if self.fds else _FRAMED_SESSION)(self._core)

    @property
    def state(self) -> ExecState:
        """Where the session is (client side and exit)."""
        return self._session.state()

    @property
    def child_state(self) -> ChildState:
        """Where the child is (running, terminating in its grace, killed, ended)."""
        return self._core.ending.state()

    @property
    def client(self) -> Any:
        """The client's transport while it is attached (None before and after)."""
        return self._core.client

    @property
    def exit_code(self) -> int | None:
        """The command's exit code, once it ended."""
        return self._core.exit_code

    # -- the smolvm child ---------------------------------------------------------------

    @property
    def process(self) -> IProcessTransport | None:
        transport: IProcessTransport | None = self.transport
        return transport

    def connectionMade(self) -> None:
        assert self.transport is not None
        self._core.ending.started(self.transport)
        if self.fds:
            return  # the child's stdio are the client's pipes, not ours
        if not self.stdin and not self.tty:
            self.transport.closeStdin()
        _widen_pipes(self.transport)
        # The child's stdin (its pipe, or the pty master for a tty) tells us when it is full:
        # reading from the client stops until it drains, so the daemon buffers at most about
        # one write buffer plus one read of the client per session, whatever the client sends.
        register = getattr(self.transport, "registerProducer", None)
        if register is not None and (self.stdin or self.tty):
            register(_ClientPauser(self._core), True)

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD == self._note_fd and not self._note.decided:
            data = self._note.feed(data)
            if not data:
                return
        core = self._core
        kind = stream.STDERR if childFD == 2 else stream.STDOUT
        # A read as full as the reactor's means more is waiting: it goes out in full frames,
        # up to TURN_READ per turn of the reactor, not in a frame per 8 KiB.
        fd = self._child_fd(childFD) if len(data) >= REACTOR_READ else None
        sent = 0
        while True:
            if fd is not None:
                data = _fill(fd, data, stream.MAX_FRAME)
            if len(data) <= stream.MAX_FRAME:  # the header, then the payload as it came
                core.out(stream.header(kind, len(data)))
                core.out(data)
            else:
                core.out(stream.encode(kind, data))
            sent += len(data)
            if fd is None or len(data) < stream.MAX_FRAME or sent >= TURN_READ:
                return
            if core.child_paused or core.out is _drop:  # back-pressure holds mid-turn too
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
        held = self._note.flush()  # a stream that ended while its head was undecided
        if held:
            self.childDataReceived(self._note_fd, held)
        core = self._core
        core.ending.exited()
        code = 255
        exc = reason.value
        if isinstance(exc, ProcessDone):
            code = 0
        elif isinstance(exc, ProcessTerminated):
            if exc.exitCode is not None:
                code = exc.exitCode
            elif exc.signal is not None:
                code = 128 + exc.signal
        if core.timed_out:
            code = TIMEOUT_EXIT
        core.exit_code = code
        self.log.info(
            "exec in bottle {bottle} by {peer} ended: exit {code} (tty={tty})",
            bottle=self.bottle,
            peer=self.peer,
            code=code,
            tty=self.tty,
        )
        self._session.child_exited(code)

    # -- the switched connection ----------------------------------------------------------

    def attach(self, transport: Any, leftover: bytes) -> None:
        """The connection now carries frames; ``leftover`` is what arrived after Exec."""
        self._session.client_attached(transport)
        if leftover and self._session.state() is not ExecState.CLOSING:
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
            if self._core.client is not None:
                self._core.client.abortConnection()

    def _apply_frames(self, frames: list[stream.Frame]) -> None:
        if self.fds:
            for frame in frames:
                self._fd_frame(frame)
            return
        process = self._core.child
        if process is None:  # not started, or ended: its stdin is gone
            return
        for frame in frames:
            if frame.kind == stream.STDIN:
                if self.stdin or self.tty:
                    process.write(frame.payload)
            elif frame.kind == stream.STDIN_EOF:
                if not self.tty:  # a terminal's end of input is in its bytes (Ctrl-D)
                    self._session.stdin_ended()
            elif frame.kind == stream.RESIZE:
                rows, cols = stream.decode_resize(frame.payload)
                if self.tty:
                    self._resize(process, rows, cols)

    def client_lost(self) -> None:
        """The client went away: end the command (the child, hence the guest command).

        Told once or twice (the connection's producer stops, then the connection is lost):
        acted on once."""
        self._session.client_lost()

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
        self._core.child_fds = [in_r, out_w, err_w]
        self._core.client_fds = [in_w, out_r, err_r]
        return in_r, out_w, err_w

    def spawned(self) -> None:
        """The child has its own copies of its ends: the daemon's go (or no EOF would come)."""
        _close_all(self._core.child_fds)

    def close_fds(self) -> None:
        self._core.close_fds()

    def _fd_frame(self, frame: stream.Frame) -> None:
        if frame.kind == stream.FDS_READY:
            done = self._session.fds_ready()
        elif frame.kind == stream.FDS_TAKEN:
            done = self._session.fds_taken()
        else:
            done = False
        if not done:
            raise StreamError(f"unexpected frame kind {frame.kind} in this state")

    # -- the child's end ------------------------------------------------------------------

    def set_deadline(self, seconds: float) -> None:
        """The command is ended after ``seconds`` (Exec's ``time_limit``), whoever holds its
        stdio; its exit code is then :data:`TIMEOUT_EXIT`."""
        self._core.set_deadline(seconds)

    def terminate(self) -> None:
        """SIGTERM now, SIGKILL after :data:`KILL_GRACE` (idempotent)."""
        self._core.ending.terminate()

    # IPushProducer for the connection: its write buffer is full, or has room again.
    def pauseProducing(self) -> None:
        self._core.pause_child()

    def resumeProducing(self) -> None:
        self._core.resume_child()

    def stopProducing(self) -> None:
        self.client_lost()


def _drop(data: bytes) -> None:
    """Where output goes once the client is gone."""


# -- the session's outputs (what a transition does) --------------------------------------


def _connect(m: _Session, c: _ExecCore, transport: Any) -> None:
    """The client is attached: what waited goes out, and output streams to it."""
    c.client = transport
    if getattr(transport, "bufferSize", None) is not None:
        # Twisted pauses a producer once its buffer holds more than ``bufferSize`` (64 KiB):
        # one 64 KiB frame did, so each turn of the reactor moved one frame. Now a turn
        # moves up to TURN_READ (the buffer's bound: TURN_READ more, at most), and a read
        # of the client's frames takes up to TURN_READ too.
        transport.bufferSize = TURN_READ
    _widen_send_buffer(transport)
    transport.registerProducer(c.producer, True)
    pending, c.pending, c.pending_size = c.pending, [], 0
    for chunk in pending:
        transport.write(chunk)
    if c.child_paused:
        c.resume_child()
    c.out = transport.write


def _close_client(c: _ExecCore) -> None:
    """The exit code is out: the connection closes (a client reading to EOF is not held)."""
    if c.client is not None:
        c.client.unregisterProducer()
        c.client.loseConnection()


def _connect_and_close(m: _Session, c: _ExecCore, transport: Any) -> None:
    _connect(m, c, transport)
    _close_client(c)


def _queue_exit(m: _Session, c: _ExecCore, code: int) -> None:
    c.pending.append(stream.encode_exit(code))


def _tell_exit(m: _Session, c: _ExecCore, code: int | None = None) -> None:
    assert c.exit_code is not None
    c.out(stream.encode_exit(c.exit_code))
    _close_client(c)


def _close_stdin(m: _Session, c: _ExecCore) -> None:
    """The half-close: the child's stdin ends; its output goes on."""
    process = c.child
    if process is None:
        return
    # A pipe with a producer registered never closes: unregister first.
    unregister = getattr(process, "unregisterProducer", None)
    if unregister is not None and c.stdin:
        unregister()
        if c.client is not None:
            c.client.resumeProducing()
    process.closeStdin()


def _detach(c: _ExecCore) -> None:
    """The client is gone: output goes nowhere, and the command's pipes close."""
    c.client = None
    c.out = _drop
    c.close_fds()


def _abandon(m: _Session, c: _ExecCore) -> None:
    """The client left before the command ended: its pipes close and the command ends."""
    _detach(c)
    if c.child is not None:
        c.log.info(
            "exec in bottle {bottle}: client {peer} went away; ending the command",
            bottle=c.bottle,
            peer=c.peer,
        )
        c.ending.terminate()


def _close(m: _Session, c: _ExecCore, code: int | None = None) -> None:
    """Both ends are done."""
    _detach(c)
    c.on_end()


def _offer_fds(m: _Session, c: _ExecCore) -> bool:
    # The client reads with recvmsg from now on: each fd rides on one byte of FDS.
    for fd in c.client_fds:
        c.client.sendFileDescriptor(fd)
    c.client.write(stream.encode(stream.FDS, bytes(len(c.client_fds))))
    return True


def _fds_gone(m: _Session, c: _ExecCore) -> bool:
    # It has them (the kernel holds in-flight copies once sendmsg returned, and the client
    # saw the bytes): the daemon's copies go, so the child sees stdin's EOF.
    _close_all(c.client_fds)
    return True


def _fds_gone_then_exit(m: _Session, c: _ExecCore) -> bool:
    _fds_gone(m, c)
    _tell_exit(m, c)
    return True


def _session_machine(fds: bool) -> Callable[[_ExecCore], _Session]:
    """The session's transitions: one table for framed sessions, one for fd sessions (whose
    exit code waits until the client holds the pipes, or its output would be lost)."""
    builder = TypeMachineBuilder(_Session, _ExecCore)
    starting = builder.state(ExecState.STARTING)
    attached = builder.state(ExecState.ATTACHED)
    exited = builder.state(ExecState.EXITED)
    gone = builder.state(ExecState.CLIENT_GONE)
    closing = builder.state(ExecState.CLOSING)
    closed = builder.state(ExecState.CLOSED)
    everywhere = [starting, attached, exited, gone, closing, closed]
    starting.upon(_Session.client_attached).to(attached)(_connect)
    for state in (starting, attached):
        state.upon(_Session.client_lost).to(gone)(_abandon)
    gone.upon(_Session.child_exited).to(closed)(_close)
    exited.upon(_Session.client_lost).to(closed)(_close)
    closing.upon(_Session.client_lost).to(closed)(_close)
    for state in (gone, closed):
        state.upon(_Session.client_lost).loop().returns(None)
    if not fds:
        input_closed = builder.state(ExecState.INPUT_CLOSED)
        everywhere.append(input_closed)
        starting.upon(_Session.child_exited).to(exited)(_queue_exit)
        exited.upon(_Session.client_attached).to(closing)(_connect_and_close)
        attached.upon(_Session.stdin_ended).to(input_closed)(_close_stdin)
        input_closed.upon(_Session.stdin_ended).loop().returns(None)
        for state in (attached, input_closed):
            state.upon(_Session.child_exited).to(closing)(_tell_exit)
        input_closed.upon(_Session.client_lost).to(gone)(_abandon)
    else:
        offered = builder.state(ExecState.FDS_OFFERED)
        taken = builder.state(ExecState.FDS_TAKEN)
        exited_offered = builder.state(ExecState.EXITED_FDS_OFFERED)
        everywhere += [offered, taken, exited_offered]
        for state in (starting, attached):
            state.upon(_Session.child_exited).to(exited).returns(None)
        exited.upon(_Session.client_attached).loop()(_connect)
        attached.upon(_Session.fds_ready).to(offered)(_offer_fds)
        exited.upon(_Session.fds_ready).to(exited_offered)(_offer_fds)
        offered.upon(_Session.fds_taken).to(taken)(_fds_gone)
        exited_offered.upon(_Session.fds_taken).to(closing)(_fds_gone_then_exit)
        offered.upon(_Session.child_exited).to(exited_offered).returns(None)
        taken.upon(_Session.child_exited).to(closing)(_tell_exit)
        for state in (offered, taken):
            state.upon(_Session.client_lost).to(gone)(_abandon)
        exited_offered.upon(_Session.client_lost).to(closed)(_close)
        # Named refusals: a handover frame out of its order is the client's error.
        refusals = {
            _Session.fds_ready: [starting, offered, taken, exited_offered, gone, closing, closed],
            _Session.fds_taken: [starting, attached, taken, exited, gone, closing, closed],
        }
        for request, states in refusals.items():
            for state in states:
                state.upon(request).loop().returns(False)
    for state in everywhere:
        state.upon(_Session.state).loop().returns(ExecState(state.name))
    return builder.build()


# -- the child's outputs ------------------------------------------------------------------


def _run(m: _Child, c: _ExecCore, process: IProcessTransport) -> None:
    c.child = process


def _arm_kill(m: _Child, c: _ExecCore) -> IDelayedCall:
    """Entering terminating: the KILL timer, the state's data (as ``_client_service``'s
    ``Waiting`` holds its retry), which the transitions out of it are handed."""
    return c.clock.callLater(KILL_GRACE, m.kill_timer_fired)


def _send_term(m: _Child, c: _ExecCore) -> None:
    c.signal("TERM")


def _note_timeout(m: _Child, c: _ExecCore) -> None:
    c.timed_out = True
    c.log.info(
        "exec in bottle {bottle} by {peer}: timeout; ending the command",
        bottle=c.bottle,
        peer=c.peer,
    )


def _time_out(m: _Child, c: _ExecCore) -> None:
    _note_timeout(m, c)
    _send_term(m, c)


def _send_kill(m: _Child, c: _ExecCore, kill: IDelayedCall) -> None:
    """The grace is over (``kill`` has fired)."""
    c.signal("KILL")


def _ended(m: _Child, c: _ExecCore) -> None:
    """It is gone: no signal after this, no deadline left, no stdin to write."""
    c.child = None
    deadline, c.deadline = c.deadline, None
    if deadline is not None and deadline.active():
        deadline.cancel()


def _ended_in_grace(m: _Child, c: _ExecCore, kill: IDelayedCall) -> None:
    """It ended within its grace: the KILL timer goes with the state it belonged to."""
    kill.cancel()
    _ended(m, c)


def _child_machine() -> Callable[[_ExecCore], _Child]:
    builder = TypeMachineBuilder(_Child, _ExecCore)
    unstarted = builder.state(ChildState.UNSTARTED)
    running = builder.state(ChildState.RUNNING)
    terminating = builder.state(ChildState.TERMINATING, _arm_kill)
    killed = builder.state(ChildState.KILLED)
    ended = builder.state(ChildState.ENDED)
    unstarted.upon(_Child.started).to(running)(_run)
    running.upon(_Child.terminate).to(terminating)(_send_term)
    running.upon(_Child.expire).to(terminating)(_time_out)
    terminating.upon(_Child.kill_timer_fired).to(killed)(_send_kill)
    terminating.upon(_Child.exited).to(ended)(_ended_in_grace)
    terminating.upon(_Child.expire, nodata=True).loop()(_note_timeout)
    killed.upon(_Child.expire).loop()(_note_timeout)
    for state in (unstarted, running, killed):
        state.upon(_Child.exited).to(ended)(_ended)
    # Nothing to end before it runs or after it ended; ending twice is ending once. The
    # KILL timer fires in terminating only: every other way out of it cancels it.
    for state in (unstarted, killed, ended):
        state.upon(_Child.terminate).loop().returns(None)
    terminating.upon(_Child.terminate).loop().returns(None)
    for state in (unstarted, ended):
        state.upon(_Child.expire).loop().returns(None)
    for state in (unstarted, running, killed, ended):
        state.upon(_Child.state).loop().returns(ChildState(state.name))
    terminating.upon(_Child.state).loop().returns(ChildState.TERMINATING)
    return builder.build()


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


def _widen_pipes(transport: object) -> None:
    """The child's pipes (not a pty) hold :data:`PIPE_SIZE`: while the daemon waits for its
    turn on a busy machine the command keeps running, and each turn then reads whole frames
    (up to :data:`TURN_READ`) instead of the 64 KiB a default pipe holds."""
    pipes = getattr(transport, "pipes", None) or {}
    for end in pipes.values():
        try:
            fcntl.fcntl(end.fileno(), fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        except (OSError, ValueError):  # a refusal (the user's pipe quota) only costs speed
            pass


def _widen_send_buffer(transport: Any) -> None:
    """A UNIX socket's connection may hold :data:`PIPE_SIZE` unsent (its default is about
    200 KiB): while the client waits for its turn the daemon keeps sending, and the client
    then reads more at a time (its CPU per byte halved). TCP (TLS) keeps its autotuning."""
    handle = getattr(transport, "getHandle", None)
    sock = handle() if handle is not None else None
    if isinstance(sock, socket.socket) and sock.family == socket.AF_UNIX:
        widen_send_buffer(sock, PIPE_SIZE)


def _close_all(fds: list[int]) -> None:
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


@implementer(IPushProducer)
class _ClientPauser:
    """Registered on the child's stdin: a full pipe pauses reading from the client."""

    def __init__(self, core: _ExecCore) -> None:
        self.core = core

    def pauseProducing(self) -> None:
        client = self.core.client
        if client is not None:
            client.pauseProducing()

    def resumeProducing(self) -> None:
        client = self.core.client
        if client is not None:
            client.resumeProducing()

    def stopProducing(self) -> None:
        pass


_FRAMED_SESSION = _session_machine(fds=False)
_HANDOVER_SESSION = _session_machine(fds=True)
_CHILD = _child_machine()
