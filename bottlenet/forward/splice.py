"""A Linux relay engine that moves bytes with ``splice(2)``: the payload never enters Python.

Once both legs are connected sockets, :class:`SpliceRelay` takes them over from Twisted
(``detach_socket``: possible only while neither was ever read or written) and registers each
socket with the reactor as a plain read/write descriptor. Per direction, a readable source is
spliced into a pipe and the pipe at once into the destination: one ``epoll_wait`` and two
``splice`` calls per message, at most one pipe's worth (64 KiB growing to 1 MiB) per event.

Pipes: all relays share one scratch pipe, which is always empty between events. When a
destination would block, the bytes left in the scratch pipe stay where they are: that pipe
becomes the direction's private pipe and a new scratch pipe comes from a small pool (trap 6:
no byte can leak into another relay, and nothing is copied). A private pipe goes back to the
pool once drained. So an idle relay holds exactly its two sockets, and a relay holds pipes
only while a destination is slow. A pipe that a read fills grows (x4, up to 1 MiB, with
``F_SETPIPE_SZ``), so bulk transfers end up moving up to 1 MiB per event.

Rules from the prototypes (``relay-performance.md``, traps 2-6):

- A source is read only while its direction holds nothing in a pipe, so EAGAIN from
  socket -> pipe always means "socket empty", never "pipe full" (trap 3); while a destination
  would block its source is not read (backpressure), and only the destination waits for
  writability.
- Sockets come from transports that never read (the accepted leg starts paused, the fast
  client endpoint's leg too), are non-blocking (trap 5; ``SPLICE_F_NONBLOCK`` only covers the
  pipe), and once taken over Twisted can no longer close them (trap 2).
- At the end, descriptors are unregistered at once and the sockets closed on the next reactor
  pass, so a stale event in the same epoll batch can never hit a new connection that reused
  the number (trap 4).

Semantics match :class:`relay.TransportRelay` (the tests run against both): EOF on one side is
passed on as a FIN once the pipe is drained; both directions finished = clean close; any error
resets (SO_LINGER 0) both sockets. The relay is also an ``IPushProducer``: pausing it stops
reading both sockets (what is already in a pipe is still delivered).
"""

from __future__ import annotations

import os
import select
import socket
import sys
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import (
    IDelayedCall,
    IPushProducer,
    IReactorFDSet,
    IReactorTime,
    IReadDescriptor,
    IWriteDescriptor,
)
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from bottlenet.forward.relay import (
    _NULL_SINK,
    OUTCOME_ABORTED,
    OUTCOME_CLOSED,
    OUTCOME_RESET,
    EngineFactory,
    Leg,
    Outcome,
    RelayEngine,
    TransportRelay,
)
from bottlenet.forward.spec import LINGER_RST

try:
    import fcntl

    _F_SETPIPE_SZ: int = getattr(fcntl, "F_SETPIPE_SZ", 1031)
    _F_GETPIPE_SZ: int = getattr(fcntl, "F_GETPIPE_SZ", 1032)
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

#: Largest pipe (and so the most bytes one event moves in one direction).
PIPE_MAX = 1024 * 1024
#: Idle pipes kept for reuse (each is 2 fds); more are closed.
POOL_MAX = 16
#: A direction's first read, and its read after each stall: what a stall pins in a pipe.
STALL_WINDOW = 64 * 1024
#: Past this many bytes held in stalled pipes (all relays), reads stay at STALL_WINDOW.
PINNED_SOFT_MAX = 16 * 1024 * 1024
#: What one relay can hold at most: its two sockets and a private pipe (2 fds) per direction
#: whose destination is slow. The connection budget counts this, not the 2 of an idle relay.
FDS_PER_RELAY = 6
#: The engine's own descriptors: the scratch pipe, the pool, the hang-up watch's epoll.
ENGINE_FDS = 2 * (POOL_MAX + 1) + 1
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
_splice: Callable[..., int] = getattr(os, "splice", None)  # type: ignore[assignment]

ENGINES = ("auto", "splice", "portable")


def splice_supported() -> bool:
    """Linux with ``os.splice`` (Python 3.10+) and pipe resizing."""
    return sys.platform.startswith("linux") and hasattr(os, "splice") and fcntl is not None


class _Pipe:
    """One non-blocking pipe and its current capacity."""

    __slots__ = ("can_grow", "r", "size", "w")

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.size: int = fcntl.fcntl(self.w, _F_GETPIPE_SZ)
        self.can_grow = self.size < PIPE_MAX

    def grow(self) -> None:
        """Called when one read filled the pipe: make it 4x bigger, up to PIPE_MAX."""
        if not self.can_grow:
            return
        try:
            self.size = fcntl.fcntl(self.w, _F_SETPIPE_SZ, min(PIPE_MAX, self.size * 4))
        except OSError:
            # Over the per-user pipe budget (pipe-user-pages-soft): stay at this size.
            self.can_grow = False
            return
        self.can_grow = self.size < PIPE_MAX

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


@implementer(IReadDescriptor)
class _HangupWatch:
    """Agent sockets the relay does not poll, watched for a reset or hang-up alone.

    A relay stops reading the agent's socket while its pipe toward the target is full, and
    writes to it only while the target sends: a stalled relay can leave that socket in no
    epoll set, so the agent's reset went unseen until the idle timeout (its fds held all that
    time). Such sockets go into an epoll set of their own, registered with no events: only
    EPOLLERR/EPOLLHUP wake it (never data, never a half-close), and the relay is ended.
    """

    def __init__(self, reactor: IReactorFDSet) -> None:
        self._reactor = reactor
        self._ep: select.epoll | None = None
        self._ends: dict[int, _End] = {}

    def fileno(self) -> int:
        return self._ep.fileno() if self._ep is not None else -1

    def logPrefix(self) -> str:
        return "bottlenet.forward.splice"

    def track(self, end: _End) -> None:
        """Watch ``end`` while the relay polls it neither for reading nor for writing."""
        if end.reading or end.writing:
            self.unwatch(end)
        elif self._ends.get(end.fd) is not end:
            if self._ep is None:
                self._ep = select.epoll()
            self._ep.register(end.fd, 0)
            if not self._ends:
                self._reactor.addReader(self)
            self._ends[end.fd] = end

    def unwatch(self, end: _End) -> None:
        if self._ends.get(end.fd) is not end:
            return
        del self._ends[end.fd]
        assert self._ep is not None
        try:
            self._ep.unregister(end.fd)
        except OSError:
            pass
        if not self._ends:
            self._reactor.removeReader(self)

    def doRead(self) -> None:
        if self._ep is None:
            return
        for fd, _ in self._ep.poll(0):
            end = self._ends.get(fd)
            if end is not None:
                end.relay._fail()  # its _finish unwatches it

    def connectionLost(self, reason: Failure) -> None:
        pass

    def close(self) -> None:
        if self._ends:
            self._reactor.removeReader(self)
            self._ends.clear()
        if self._ep is not None:
            self._ep.close()
            self._ep = None


class SpliceEngines:
    """Builds :class:`SpliceRelay` engines for one reactor; owns the pipes and the closer.

    Use an instance as a forward table's ``engine_factory``. Call :meth:`close` when no relay
    of it is left (the table does on stop) to release the pooled pipes.
    """

    log = Logger(namespace="bottlenet.forward")

    def __init__(self, reactor: Any) -> None:
        self.reactor: IReactorFDSet = reactor
        self._clock: IReactorTime = reactor
        self._scratch: _Pipe | None = None
        self._pool: list[_Pipe] = []
        self._closing: list[tuple[SpliceRelay, Outcome]] = []
        self._close_call: IDelayedCall | None = None
        self._close_after_batch = False
        # capabilities.BatchingReactor, each method where the reactor has it (fastreactor).
        self._after_batch: Callable[[Callable[[], object]], bool] | None = getattr(
            reactor, "call_after_batch", None
        )
        #: The quiet reactor's forget_until_closed (None on other reactors).
        self.forget: Callable[[object], bool] | None = getattr(reactor, "forget_until_closed", None)
        #: Relays that took their sockets over (for stats and tests).
        self.taken_over = 0
        #: Relays that fell back to the portable engine (a transport that cannot be detached).
        self.fallbacks = 0
        #: Stalled agent sockets, watched for a reset (see _HangupWatch).
        self.hangups = _HangupWatch(reactor)
        #: Bytes held in private (stalled) pipes right now, all relays together.
        self.pinned = 0

    #: Its relays can start from two bare sockets (``SpliceRelay.start_sockets``).
    start_sockets_supported = True
    #: For the connection budget: what one relay may hold, and what the engine holds itself.
    fds_per_relay = FDS_PER_RELAY
    engine_fds = ENGINE_FDS

    def __call__(self, on_end: Callable[[Outcome], None]) -> RelayEngine:
        return SpliceRelay(self, on_end)

    # Pipes
    def scratch(self) -> _Pipe:
        pipe = self._scratch
        if pipe is None:
            pipe = self._scratch = self._new_pipe()
        return pipe

    def promote_scratch(self) -> _Pipe:
        """The scratch pipe holds a direction's leftover: it becomes that direction's pipe."""
        pipe = self._scratch
        assert pipe is not None
        self._scratch = None  # a fresh one is taken lazily by the next read
        return pipe

    def _new_pipe(self) -> _Pipe:
        pool = self._pool
        return pool.pop() if pool else _Pipe()

    def release(self, pipe: _Pipe) -> None:
        """Take back an empty private pipe."""
        if len(self._pool) < POOL_MAX:
            self._pool.append(pipe)
        else:
            pipe.close()

    def pipes_open(self) -> int:
        """Pipes held by the engine itself (scratch + pool), for tests and stats."""
        return len(self._pool) + (self._scratch is not None)

    def close(self) -> None:
        self.hangups.close()
        for pipe in self._pool:
            pipe.close()
        self._pool.clear()
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None
        self._close_now()

    # Deferred close (trap 4)
    def close_later(self, relay: SpliceRelay, outcome: Outcome) -> None:
        """Close after the current epoll batch: at its end on the quiet reactor, else on the
        next pass (``callLater(0)``). Inside a batch the after-batch call is always used (a
        relay may have let the reactor forget its sockets, see ``_finish``)."""
        self._closing.append((relay, outcome))
        if self._close_after_batch:
            return  # already scheduled at the end of this batch
        after_batch = self._after_batch
        if after_batch is not None and after_batch(self._close_now):
            self._close_after_batch = True
            return
        if self._close_call is None:
            self._close_call = self._clock.callLater(0, self._close_now)

    def _close_now(self) -> None:
        self._close_after_batch = False
        call, self._close_call = self._close_call, None
        if call is not None and call.active():
            call.cancel()
        closing, self._closing = self._closing, []
        for relay, outcome in closing:
            relay._closed(outcome)


@implementer(IReadDescriptor, IWriteDescriptor)
class _End:
    """One socket as a reactor descriptor: read = pump ``src_of``; write = drain ``dst_of``."""

    __slots__ = ("dst_of", "fd", "reading", "relay", "sock", "src_of", "writing")

    def __init__(self, relay: SpliceRelay, sock: socket.socket) -> None:
        self.relay = relay
        self.sock = sock
        self.fd = sock.fileno()
        self.reading = False
        self.writing = False
        self.src_of: _Dir = _NO_DIR
        self.dst_of: _Dir = _NO_DIR

    def fileno(self) -> int:
        return self.fd

    def logPrefix(self) -> str:
        return "bottlenet.forward.splice"

    def doRead(self) -> None:
        self.relay._pump(self.src_of)

    def doWrite(self) -> None:
        self.relay._drain(self.dst_of)

    def connectionLost(self, reason: Failure) -> None:
        # The reactor dropped this descriptor: EPOLLERR/HUP without data, or an exception.
        self.reading = self.writing = False
        self.relay._fail()


_NO_DIR: _Dir = None  # type: ignore[assignment]


class _Dir:
    """One direction: ``src`` socket -> pipe -> ``dst`` socket."""

    __slots__ = ("dst", "eof_read", "fin_sent", "inpipe", "nbytes", "pipe", "src", "window")

    def __init__(self, src: _End, dst: _End) -> None:
        self.src = src
        self.dst = dst
        #: Most bytes one read takes: x4 after each read delivered in full (up to PIPE_MAX),
        #: back to STALL_WINDOW after a stall, so what a stall pins in its pipe is bounded.
        self.window = STALL_WINDOW
        self.pipe: _Pipe | None = None  # private pipe, only while bytes wait in it
        self.inpipe = 0
        self.nbytes = 0
        # Half-close, in the words relay.py's _Side uses too:
        self.eof_read = False  # read EOF seen on src
        self.fin_sent = False  # FIN sent on dst


@implementer(IPushProducer)
class SpliceRelay:
    """:class:`relay.RelayEngine` with splice(); falls back to the portable engine per relay."""

    log = Logger(namespace="bottlenet.forward")

    def __init__(self, engines: SpliceEngines, on_end: Callable[[Outcome], None]) -> None:
        self._engines = engines
        self._reactor = engines.reactor
        self._on_end: Callable[[Outcome], None] | None = on_end
        self._fallback: TransportRelay | None = None
        self._up: _Dir | None = None  # agent -> target
        self._down: _Dir | None = None  # target -> agent
        self._paused = False
        self._closing = False  # finished: sockets unregistered, close pending or done
        self._aborted = False

    @property
    def spliced(self) -> bool:
        return self._up is not None

    @property
    def bytes_in(self) -> int:
        if self._fallback is not None:
            return self._fallback.bytes_in
        return self._up.nbytes if self._up is not None else 0

    @property
    def bytes_out(self) -> int:
        if self._fallback is not None:
            return self._fallback.bytes_out
        return self._down.nbytes if self._down is not None else 0

    def sockets(self) -> list[socket.socket]:
        """The relay's two sockets while it runs (for tests)."""
        if self._up is None:
            return []
        return [self._up.src.sock, self._up.dst.sock]

    def start(self, inbound: Leg, outbound: Leg) -> None:
        tin, tout = inbound.transport, outbound.transport
        # Both or neither: check both before taking either (trap 2).
        if _detachable(tin) and _detachable(tout):
            a, b = tin.detach_socket(), tout.detach_socket()  # type: ignore[attr-defined]
        else:
            a = b = None
        if a is None or b is None:
            self._engines.fallbacks += 1
            fallback = self._fallback = TransportRelay(self._fallback_ended)
            fallback.start(inbound, outbound)
            return
        for leg in (inbound, outbound):
            # The inert transports are never used again: drop them (memory per idle relay).
            leg.sink = _NULL_SINK  # its transport is inert after the take-over: nothing arrives
            leg.transport = None  # type: ignore[assignment]
        self.start_sockets(a, b)

    def start_sockets(self, a: socket.socket, b: socket.socket) -> None:
        """Relay between two connected non-blocking sockets, ``a`` the agent's (accepted) one
        and ``b`` the target's; from here on the relay owns and closes both."""
        self._engines.taken_over += 1
        ea, eb = _End(self, a), _End(self, b)
        up, down = _Dir(ea, eb), _Dir(eb, ea)
        ea.src_of = eb.dst_of = up
        eb.src_of = ea.dst_of = down
        self._up, self._down = up, down
        self._reactor.addReader(ea)
        ea.reading = True
        self._reactor.addReader(eb)
        eb.reading = True

    # IPushProducer (and RelayEngine.abort)
    def pauseProducing(self) -> None:
        """Stop reading both sockets until :meth:`resumeProducing` (bytes in pipes still go)."""
        if self._fallback is not None:
            self._fallback.pauseProducing()
            return
        self._paused = True
        for d in (self._up, self._down):
            if d is not None:
                self._reading(d.src, False)

    def resumeProducing(self) -> None:
        if self._fallback is not None:
            self._fallback.resumeProducing()
            return
        self._paused = False
        for d in (self._up, self._down):
            if d is not None:
                self._update(d)

    def stopProducing(self) -> None:
        self.abort()

    def abort(self) -> None:
        if self._fallback is not None:
            self._fallback.abort()
            return
        self._aborted = True
        self._finish(OUTCOME_ABORTED)

    # Byte moving
    def _pump(self, d: _Dir) -> None:
        """``d.src`` is readable, and ``d`` holds nothing in a pipe (else it is not read)."""
        engines = self._engines
        pipe = engines._scratch or engines.scratch()
        want = pipe.size if pipe.size <= d.window else d.window
        try:
            # Positional flags: keyword parsing is a measurable share of a small message.
            n = _splice(d.src.fd, pipe.w, want, None, None, _SPLICE_FLAGS)
        except BlockingIOError:
            return  # the socket is empty (the pipe is: trap 3)
        except OSError:
            self._fail()
            return
        if n == 0:
            d.eof_read = True
            self._reading(d.src, False)
            self._shut(d)
            return
        d.nbytes += n
        if n == pipe.size:
            pipe.grow()
        try:
            m = _splice(pipe.r, d.dst.fd, n, None, None, _SPLICE_FLAGS)
        except BlockingIOError:
            m = 0
        except OSError:
            # The bytes stay in the scratch pipe: make it ours so _finish closes it (trap 6).
            d.pipe = engines.promote_scratch()
            d.inpipe = n
            engines.pinned += n
            self._fail()
            return
        if m < n:
            # The destination would block: the leftover stays in this pipe, which becomes
            # the direction's own; stop reading until it drains.
            d.pipe = engines.promote_scratch()
            d.inpipe = n - m
            engines.pinned += n - m
            d.window = STALL_WINDOW
            self._reading(d.src, False)
            self._writing(d.dst, True)
        elif n == d.window and d.window < PIPE_MAX and engines.pinned < PINNED_SOFT_MAX:
            d.window *= 4

    def _drain(self, d: _Dir) -> None:
        """``d.dst`` is writable and ``d`` has bytes waiting in its pipe."""
        pipe = d.pipe
        if pipe is None:  # pragma: no cover - only registered for writing with a pipe
            self._writing(d.dst, False)
            return
        try:
            m = _splice(pipe.r, d.dst.fd, d.inpipe, None, None, _SPLICE_FLAGS)
        except BlockingIOError:
            return
        except OSError:
            self._fail()
            return
        d.inpipe -= m
        self._engines.pinned -= m
        if d.inpipe:
            return
        d.pipe = None
        self._engines.release(pipe)
        if not (d.eof_read or self._paused):
            # Under bulk the source has more already: move it now (one more pump, still
            # bounded) instead of swapping the registrations and waiting for another pass.
            self._pump(d)
            if self._closing or d.inpipe:
                return  # finished, or blocked again and still registered for writing
        self._writing(d.dst, False)
        if d.eof_read:
            self._shut(d)
        else:
            self._update(d)

    def _update(self, d: _Dir) -> None:
        self._reading(d.src, not (self._paused or self._closing or d.eof_read or d.inpipe))

    def _reading(self, end: _End, on: bool) -> None:
        if end.reading != on:
            end.reading = on
            if on:
                self._reactor.addReader(end)
            else:
                self._reactor.removeReader(end)
            self._track(end)

    def _writing(self, end: _End, on: bool) -> None:
        if end.writing != on:
            end.writing = on
            if on:
                self._reactor.addWriter(end)
            else:
                self._reactor.removeWriter(end)
            self._track(end)

    def _track(self, end: _End) -> None:
        """The agent's socket, when no longer polled, is watched for a reset (and back)."""
        up = self._up
        if not self._closing and up is not None and end is up.src:
            self._engines.hangups.track(end)

    def _shut(self, d: _Dir) -> None:
        """EOF seen and the pipe drained: pass the FIN on; close once both ways are done."""
        if d.fin_sent or self._closing:
            return
        d.fin_sent = True
        up, down = self._up, self._down
        assert up is not None and down is not None
        if up.fin_sent and down.fin_sent:
            # The last FIN: close() sends it (both receive queues are empty: both sources
            # reached EOF), so skip the shutdown() syscall.
            self._finish(OUTCOME_CLOSED)
            return
        try:
            d.dst.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the peer is gone; its own read side will report the error

    def _fail(self) -> None:
        self._finish(OUTCOME_RESET)

    def _finish(self, outcome: Outcome) -> None:
        """Unregister now; close (RST unless clean) on the next pass; then report the end."""
        if self._closing or self._up is None:
            return
        self._closing = True
        self._engines.hangups.unwatch(self._up.src)
        forget = self._engines.forget
        for end in (self._up.src, self._down.src):  # type: ignore[union-attr]
            if forget is not None and (end.reading or end.writing) and forget(end):
                # The quiet reactor, inside a batch: close() below (after the batch) takes
                # the fd out of the epoll set, no epoll_ctl needed.
                end.reading = end.writing = False
                continue
            self._reading(end, False)
            self._writing(end, False)
        for d in (self._up, self._down):
            if d.pipe is not None:  # type: ignore[union-attr]
                # Bytes still inside: this pipe never goes back to the pool (trap 6).
                d.pipe.close()  # type: ignore[union-attr]
                d.pipe = None  # type: ignore[union-attr]
                self._engines.pinned -= d.inpipe  # type: ignore[union-attr]
                d.inpipe = 0  # type: ignore[union-attr]
        self._engines.close_later(self, outcome)

    def _closed(self, outcome: Outcome) -> None:
        assert self._up is not None and self._down is not None
        for end in (self._up.src, self._down.src):
            sock = end.sock
            if outcome != OUTCOME_CLOSED:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RST)
                except OSError:
                    pass
            sock.close()
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(outcome)

    def _fallback_ended(self, outcome: Outcome) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(outcome)


def _detachable(transport: object) -> bool:
    """Whether ``transport`` is a ``capabilities.DetachableTransport`` ready to hand over."""
    check = getattr(transport, "detachable", None)
    return check is not None and bool(check())


def engine_factory(reactor: Any, engine: str = "auto") -> EngineFactory:
    """The relay engine factory for ``engine``: ``auto``, ``splice`` or ``portable``.

    ``auto`` = splice where supported (Linux with ``os.splice``), portable elsewhere.
    ``splice`` where unsupported raises ValueError (an explicit choice should not degrade).
    """
    if check_engine(engine) == "portable" or (engine == "auto" and not splice_supported()):
        return TransportRelay
    return SpliceEngines(reactor)


def check_engine(engine: str) -> str:
    """``engine`` if it names an engine this host runs (ValueError saying why not)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown relay engine {engine!r} (choose from {', '.join(ENGINES)})")
    if engine == "splice" and not splice_supported():
        raise ValueError("the splice relay engine needs Linux and os.splice (Python 3.10+)")
    return engine


__all__ = [
    "ENGINES",
    "FDS_PER_RELAY",
    "PIPE_MAX",
    "POOL_MAX",
    "SpliceEngines",
    "SpliceRelay",
    "check_engine",
    "engine_factory",
    "splice_supported",
]
