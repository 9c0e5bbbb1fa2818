"""Byte-transparent relay between an accepted agent connection and its target.

Written here rather than taken from ``twisted.protocols.portforward`` (no half-close, no
cancellable connect) or any ``twisted.protocols.policies`` wrapper (they drop
``IHalfCloseableProtocol``). The code is split in two so a later splice() implementation can
replace the byte-moving part without touching listeners, limits, counters or teardown:

- :class:`RelaySession` (one per accepted connection, engine-agnostic): pauses the accepted
  leg, connects to the target through a client endpoint (cancellable, with a timeout), hands
  both legs to a :class:`RelayEngine`, and reports the end exactly once to its
  :class:`RelayOwner` with an outcome and byte counts.
- :class:`RelayEngine` (interface) and :class:`TransportRelay` (the Twisted-transport
  implementation): moves bytes, passes FIN both ways, turns an error on one leg into an abort
  (RST) of the other.

Each :class:`Leg` is a thin protocol that forwards every transport event to its current
:class:`LegSink`; whoever owns the leg (the session during connect, then the engine) installs
itself as the sink.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, cast
from typing import Protocol as TypingProtocol

from attrs import frozen
from twisted.internet import error as ierror
from twisted.internet import tcp
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import (
    IConsumer,
    IFileDescriptorReceiver,
    IHalfCloseableProtocol,
    IPushProducer,
    IStreamClientEndpoint,
    ISystemHandle,
    ITCPTransport,
)
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

import twisted
from bottlenet.waiters import OneShot

if TYPE_CHECKING:
    from twisted.internet.interfaces import IAddress, IReactorTime

    from bottlenet.forward.capabilities import SocketStartingEngine

#: Largest single read from a leg (also the per-leg write high-water mark, see ``bufferSize``).
READ_SIZE = 256 * 1024

#: Twisted versions whose private transport attributes the eager send was checked against
#: (see ``tests/forward/test_eager_pin.py``). Any other version falls back to plain write().
EAGER_VERIFIED_TWISTED = frozenset({"26.10.0"})


class Outcome(StrEnum):
    """How a relay ended (the strings are what logs and counters show)."""

    CLOSED = "closed"  # both directions finished with FIN
    RESET = "reset"  # a leg failed (RST, write error): the other leg was reset too
    CONNECT_FAILED = "connect-failed"  # target refused, unreachable or timed out
    ABORTED = "aborted"  # torn down by the table (remove / stop)


# The members as module constants (what the relay and its owners use at run time: cheaper
# than ``Outcome.CLOSED`` on Python 3.11, see ``_ENDED`` below).
OUTCOME_CLOSED = Outcome.CLOSED
OUTCOME_RESET = Outcome.RESET
OUTCOME_CONNECT_FAILED = Outcome.CONNECT_FAILED
OUTCOME_ABORTED = Outcome.ABORTED


class Phase(Enum):
    """Where a :class:`RelaySession` is: once per connection, so a field, not a machine.

    ``CONNECTING`` (accepted, the target connect running), then ``RELAYING`` (an engine moves
    the bytes), then ``ENDED`` (every socket closed, the owner told). A session can also go
    from ``CONNECTING`` straight to ``ENDED`` (the agent left, the connect failed, an abort).
    """

    CONNECTING = "connecting"
    RELAYING = "relaying"
    ENDED = "ended"


# Module-level names for the members: on Python 3.11 ``Phase.ENDED`` is a class attribute
# lookup through the enum machinery, several times the cost of a global (once per connection,
# but the accept path is measured in microseconds).
_CONNECTING, _RELAYING, _ENDED = Phase.CONNECTING, Phase.RELAYING, Phase.ENDED


def _eager_supported() -> bool:
    fd = tcp.Connection
    return twisted.__version__ in EAGER_VERIFIED_TWISTED and all(
        hasattr(fd, name)
        for name in ("dataBuffer", "offset", "_writeDisconnecting", "disconnecting", "connected")
    )


EAGER_SEND = _eager_supported()


class _Transport(ITCPTransport, IPushProducer, IConsumer, ISystemHandle):
    """What a relay leg's transport provides (portforward's ``_MakeTypesHappy`` trick)."""


class LegSink(TypingProtocol):
    """Receives one leg's transport events."""

    def made(self) -> None: ...

    def data(self, data: bytes) -> None: ...

    def read_eof(self) -> None: ...

    def write_shut(self) -> None: ...

    def lost(self, reason: Failure) -> None: ...


class _NullSink:
    """Sink of a leg nobody owns any more: drops everything."""

    def made(self) -> None:
        pass

    def data(self, data: bytes) -> None:
        pass

    def read_eof(self) -> None:
        pass

    def write_shut(self) -> None:
        pass

    def lost(self, reason: Failure) -> None:
        pass


_NULL_SINK = _NullSink()


@implementer(IHalfCloseableProtocol)
class Leg(Protocol):
    """One socket of a relay; forwards each event to ``sink`` (no logic of its own).

    TCP_NODELAY and keepalive are already set: accepted sockets inherit both from their
    listener (``listen.BackoffTCPPort``), the fast endpoint sets them before connecting.
    """

    transport: _Transport
    sink: LegSink = _NULL_SINK

    def __init__(self, sink: LegSink) -> None:
        self.sink = sink

    def connectionMade(self) -> None:
        self.sink.made()

    def dataReceived(self, data: bytes) -> None:
        self.sink.data(data)

    def readConnectionLost(self) -> None:
        self.sink.read_eof()

    def writeConnectionLost(self) -> None:
        self.sink.write_shut()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.sink.lost(reason)


@implementer(IHalfCloseableProtocol, IFileDescriptorReceiver)
class AcceptedLeg(Leg):
    """The accepted leg. A UNIX peer (an agent VMM's uid) may send descriptors
    (``SCM_RIGHTS``) with its bytes: a relay passes bytes only, so each is closed at once and
    said in one line per connection (Twisted's own fallback logs a line per message: the
    peer would fill the daemon's log). The outbound leg needs none of this: its transport
    reads with ``recv``, which drops them. (Not on :class:`Leg` itself: Twisted's client
    endpoints wrap a protocol providing both interfaces as one providing the last only.)"""

    log = Logger()
    _descriptors = 0

    def fileDescriptorReceived(self, descriptor: int) -> None:
        os.close(descriptor)
        self._descriptors += 1
        if self._descriptors == 1:
            self.log.warn(
                "a relayed peer sent file descriptors ({address}); closed: a relay passes "
                "bytes only",
                address=self.transport.getHost(),
            )


class RelayEngine(TypingProtocol):
    """Moves bytes between two connected legs until both directions are finished.

    ``start`` is called once with the accepted (agent) leg and the outbound (target) leg, the
    accepted leg's transport still paused. The engine calls the ``on_end`` callback it was
    built with exactly once, after both legs' connections are lost, with an :class:`Outcome`
    (``CLOSED`` or ``RESET``; ``ABORTED`` after :meth:`abort`).
    """

    @property
    def bytes_in(self) -> int:
        """Bytes moved agent -> target so far."""
        ...

    @property
    def bytes_out(self) -> int:
        """Bytes moved target -> agent so far."""
        ...

    def start(self, inbound: Leg, outbound: Leg) -> None: ...

    def abort(self) -> None: ...

    def pauseProducing(self) -> None:
        """Stop reading both legs (from outside, e.g. to cut a bottle off) until resumed."""

    def resumeProducing(self) -> None: ...


EngineFactory = Callable[[Callable[[Outcome], None]], RelayEngine]


@implementer(IPushProducer)
class _Throttle:
    """The streaming producer registered on a leg's transport: pauses/resumes the peer's reads.

    It forwards to the peer transport, except ``stopProducing`` which does nothing: Twisted
    calls it from ``connectionLost`` and a transport's own ``stopProducing`` is an orderly
    ``loseConnection()``, which would turn a reset into a clean close. Teardown is explicit.
    A resume is held back while the whole relay is paused from outside; ``held`` remembers
    that the consumer still wants the peer paused.
    """

    __slots__ = ("_engine", "_transport", "held")

    def __init__(self, engine: TransportRelay, transport: _Transport) -> None:
        self._engine = engine
        self._transport = transport
        self.held = False

    def pauseProducing(self) -> None:
        self.held = True
        self._transport.pauseProducing()

    def resumeProducing(self) -> None:
        self.held = False
        if not self._engine.paused:
            self._transport.resumeProducing()

    def stopProducing(self) -> None:
        pass


def _idle(d: tcp.Connection) -> bool:
    """Nothing queued in Twisted's write buffer and no close pending (private attributes)."""
    return (
        not d._tempDataLen
        and d.offset == len(d.dataBuffer)
        and bool(d.connected)
        and not d.disconnecting
        and not d._writeDisconnecting
    )


class _Side:
    """One leg as seen by :class:`TransportRelay`: reads from it go to ``dst`` (the peer)."""

    __slots__ = (
        "closed",
        "closing",
        "dst",
        "engine",
        "eof_read",
        "fin_sent",
        "leg",
        "nbytes",
        "throttle",
    )

    def __init__(self, engine: TransportRelay, leg: Leg, dst: _Transport) -> None:
        self.engine = engine
        self.leg = leg
        self.dst = dst
        self.throttle = _Throttle(engine, leg.transport)  # registered on dst: gates our reads
        self.nbytes = 0
        # Half-close, in the words splice.py's _Dir uses too:
        self.eof_read = False  # read EOF seen
        self.fin_sent = False  # our write side shut down (FIN sent)
        self.closing = False  # we called loseConnection after eof_read and fin_sent
        self.closed = False  # connectionLost seen

    def made(self) -> None:
        pass

    def data(self, data: bytes) -> None:
        self.nbytes += len(data)
        dst = self.dst
        if self.engine.eager:
            # "Eager send": with nothing queued on the peer and no close pending, hand the
            # bytes to the kernel now instead of waiting for the next writable event; only the
            # remainder goes through Twisted's buffer (which keeps ordering and backpressure).
            d: tcp.Connection = dst  # type: ignore[assignment]
            # _idle(d), inlined on purpose: this runs per read and a call costs measurably here.
            if (
                not d._tempDataLen
                and d.offset == len(d.dataBuffer)
                and d.connected
                and not d.disconnecting
                and not d._writeDisconnecting
            ):
                try:
                    sent = d.socket.send(data)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    # The send consumed the socket's pending error (ECONNRESET, EPIPE): a
                    # later recv() would only see EOF, so fail the relay here (RST both ways).
                    self.engine._send_failed()
                    return
                if sent == len(data):
                    return
                data = data[sent:]
        dst.write(data)

    def read_eof(self) -> None:
        self.eof_read = True
        dst = self.dst
        peer = self.engine._peer_of(self)
        if not peer.closed:
            # Trap: unregister first, else a paused producer would be resumed by doWrite
            # instead of the FIN being sent (and reading would resume on a socket at EOF).
            dst.unregisterProducer()
            if self.engine.eager and _idle(dst):  # type: ignore[arg-type]
                # "Eager FIN": nothing queued, so do now what doWrite would do on the next
                # writable event (saves a reactor pass and two epoll_ctl per direction).
                # Same state changes as doWrite + _closeWriteConnection, minus the adapter
                # lookup and the wrapper hops back to our own leg.
                d: tcp.Connection = dst  # type: ignore[assignment]
                d._writeDisconnecting = True
                d._writeDisconnected = True
                try:
                    d.socket.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                peer.write_shut()
            else:
                dst.loseWriteConnection()
        self.engine._maybe_close(self)

    def write_shut(self) -> None:
        self.fin_sent = True
        self.engine._maybe_close(self)

    def lost(self, reason: Failure) -> None:
        self.closed = True
        self.engine._lost(self, reason)


class TransportRelay:
    """:class:`RelayEngine` over Twisted transports: producers wired both ways, eager send."""

    def __init__(self, on_end: Callable[[Outcome], None], *, eager: bool | None = None) -> None:
        self._on_end: Callable[[Outcome], None] | None = on_end
        self._eager_wanted = EAGER_SEND if eager is None else eager
        self.eager = False
        self._in: _Side | None = None
        self._out: _Side | None = None
        self._failed = False
        self._aborted = False
        self.paused = False

    @property
    def bytes_in(self) -> int:
        return self._in.nbytes if self._in is not None else 0

    @property
    def bytes_out(self) -> int:
        return self._out.nbytes if self._out is not None else 0

    def start(self, inbound: Leg, outbound: Leg) -> None:
        tin, tout = inbound.transport, outbound.transport
        self.eager = self._eager_wanted and all(isinstance(t, tcp.Connection) for t in (tin, tout))
        self._in = _Side(self, inbound, tout)
        self._out = _Side(self, outbound, tin)
        for t in (tin, tout):
            if isinstance(t, tcp.Connection):
                t.bufferSize = READ_SIZE
        tout.registerProducer(self._in.throttle, True)
        tin.registerProducer(self._out.throttle, True)
        inbound.sink = self._in
        outbound.sink = self._out
        tin.resumeProducing()
        tout.resumeProducing()  # a no-op for Twisted's clients, which read from the start

    def pauseProducing(self) -> None:
        self.paused = True
        for side in (self._in, self._out):
            if side is not None and not side.closed and not side.eof_read:
                side.leg.transport.pauseProducing()

    def resumeProducing(self) -> None:
        self.paused = False
        for side in (self._in, self._out):
            # Never resume a leg at read EOF (it would read the EOF again), nor one whose
            # peer's write buffer is still over its high-water mark.
            if (
                side is not None
                and not side.closed
                and not side.eof_read
                and not side.throttle.held
            ):
                side.leg.transport.resumeProducing()

    def abort(self) -> None:
        self._aborted = True
        for side in (self._in, self._out):
            if side is not None and not side.closed:
                side.leg.transport.abortConnection()

    def _send_failed(self) -> None:
        self._failed = True
        for side in (self._in, self._out):
            if side is not None and not side.closed:
                side.leg.transport.abortConnection()

    def _peer_of(self, side: _Side) -> _Side:
        peer = self._out if side is self._in else self._in
        assert peer is not None
        return peer

    def _maybe_close(self, side: _Side) -> None:
        if side.eof_read and side.fin_sent and not side.closing and not side.closed:
            side.closing = True
            t = side.leg.transport
            if self.eager:
                # Both directions are shut down already: skip Twisted's shutdown(2) before
                # close() (a redundant syscall that mostly fails with ENOTCONN).
                t._shouldShutdown = False  # type: ignore[attr-defined]
            t.loseConnection()

    def _lost(self, side: _Side, reason: Failure) -> None:
        side.leg.sink = _NULL_SINK
        if not side.closing:
            # Not a close we asked for: a reset, a write error or an abort. Reset the peer so
            # its end sees the truncation (RST) rather than a clean EOF.
            self._failed = True
            peer = self._peer_of(side)
            if not peer.closed:
                peer.leg.transport.abortConnection()
        assert self._in is not None and self._out is not None
        if self._in.closed and self._out.closed and self._on_end is not None:
            on_end, self._on_end = self._on_end, None
            if self._aborted:
                on_end(OUTCOME_ABORTED)
            else:
                on_end(OUTCOME_RESET if self._failed else OUTCOME_CLOSED)


class SocketTarget(TypingProtocol):
    """A client endpoint that can also start a connect and hand back the bare socket
    (``connect.FastClientEndpoint``): what :meth:`RelaySession.start_accepted` needs."""

    def open(self) -> tuple[socket.socket | None, int]: ...

    def connect(
        self, protocolFactory: Factory, started: tuple[socket.socket | None, int] | None = None
    ) -> Deferred[Leg]: ...


@frozen
class RelayFailure:
    """Why a relay failed, as a value: the exception's class name and its errno (if any).

    Never a message or a traceback; the owner acts on ``errno`` (EMFILE: back off) and logs
    :meth:`describe`.
    """

    error: str
    errno: int | None = None

    @classmethod
    def of(cls, failure: Failure) -> RelayFailure:
        value = failure.value
        # Twisted's ConnectError keeps the errno as ``osError`` (an int from
        # getConnectError, or an OSError); a plain OSError carries it itself.
        os_error = getattr(value, "osError", None) or value
        code = os_error.errno if isinstance(os_error, OSError) else os_error
        return cls(type(value).__name__, code if type(code) is int else None)

    def describe(self) -> str:
        """``Class`` or ``Class:ERRNO_NAME`` (e.g. ``ConnectError:EMFILE``)."""
        if self.errno is None:
            return self.error
        return f"{self.error}:{errno.errorcode.get(self.errno, self.errno)}"


class RelayOwner(TypingProtocol):
    """Told once when a session is over (all its sockets closed)."""

    def relay_ended(
        self, session: RelaySession, outcome: Outcome, reason: RelayFailure | None
    ) -> None: ...


class _OutboundFactory(Factory):
    """A quiet one-shot factory handing the endpoint the session's pre-built outbound leg."""

    noisy = False

    def __init__(self, leg: Leg) -> None:
        self._leg: Leg | None = leg

    def buildProtocol(self, addr: IAddress | None) -> Leg | None:
        leg, self._leg = self._leg, None
        return leg


@implementer(IPushProducer)
class RelaySession:
    """One accepted connection, from accept to the last closed socket.

    Engine-agnostic: the listener, the connection cap, the counters and teardown only deal
    with sessions; the byte moving is delegated to the engine built by ``engine_factory``.
    """

    def __init__(
        self,
        clock: IReactorTime,
        target: IStreamClientEndpoint,
        owner: RelayOwner,
        *,
        engine_factory: EngineFactory = TransportRelay,
    ) -> None:
        self._target = target
        self._owner = owner
        self._engine_factory = engine_factory
        self.started = clock.seconds()
        # The legs exist only on the transport path (not when start_accepted relays at once).
        self._inbound: Leg | None = None
        self._started: tuple[socket.socket | None, int] | None = None
        self.phase: Phase = _CONNECTING
        self._connect: Deferred[Leg] | None = None  # the target connect, while it runs
        self.engine: RelayEngine | None = None
        self._aborted = False
        # (outcome, reason) decided before the end
        self._failure: tuple[Outcome, RelayFailure] | None = None
        self._paused = False
        self._end: OneShot[None] | None = None  # built by the first when_ended()

    @property
    def inbound(self) -> Leg:
        """The accepted connection's protocol (what a listener's factory returns)."""
        leg = self._inbound
        if leg is None:
            leg = self._inbound = AcceptedLeg(self)
        return leg

    def start_accepted(
        self, sock: socket.socket, adopt: Callable[[Leg], object], target: SocketTarget
    ) -> None:
        """Relay a freshly accepted socket, on the fast path when the target connects at once.

        For an engine that starts from two sockets (``start_sockets``) and a target that can
        :meth:`SocketTarget.open` a connect: when that connect completes inside the call
        (loopback targets nearly always do), the engine starts on both sockets right away, and
        no transport, protocol or Deferred is built for the connection. Otherwise (still in
        progress, or failed) ``adopt(self.inbound)`` wraps the socket in the listener's usual
        (paused) transport and the session goes on as for any accepted connection, with the
        connect that was started (so a failure is reported and reset as usual).
        """
        out, err = target.open()
        if err == 0 and out is not None:
            try:
                # trap 5: splice needs non-blocking sockets (accept() gives a blocking one).
                sock.setblocking(False)
                engine = self._engine_factory(self._engine_ended)
                self.engine = engine
                # RELAYING before the start: an engine that ended inside it stays ENDED.
                self.phase = _RELAYING
                starter: SocketStartingEngine = engine  # type: ignore[assignment]
                starter.start_sockets(sock, out)
            except BaseException:
                out.close()
                raise
            if self._paused:
                engine.pauseProducing()
            return
        self._started = (out, err)
        adopt(self.inbound)

    # Byte counters, live while the relay runs.
    @property
    def bytes_in(self) -> int:
        return self.engine.bytes_in if self.engine is not None else 0

    @property
    def bytes_out(self) -> int:
        return self.engine.bytes_out if self.engine is not None else 0

    @property
    def ended(self) -> bool:
        return self.phase is _ENDED

    def when_ended(self) -> Deferred[None]:
        """A Deferred that fires once every socket of this session is closed."""
        end = self._end
        if end is None:
            # Built on demand: most sessions end with nobody waiting (table removal waits).
            end = self._end = OneShot()
            if self.phase is _ENDED:
                end.fire(None)
        return end.when_fired()

    # IPushProducer: lets outside code stop a relay's traffic without closing it.
    def pauseProducing(self) -> None:
        """Stop reading both legs (also before the engine started) until resumed."""
        self._paused = True
        if self.engine is not None:
            self.engine.pauseProducing()

    def resumeProducing(self) -> None:
        self._paused = False
        if self.engine is not None:
            self.engine.resumeProducing()

    def stopProducing(self) -> None:
        self.abort()

    def abort(self) -> None:
        """Tear the session down now (RST both ways); the end is still reported once."""
        if self.phase is _ENDED or self._aborted:
            return
        self._aborted = True
        if self.engine is not None:
            self.engine.abort()
            return
        if self._connect is not None:
            self._connect.cancel()
        if self.phase is not _ENDED:
            self.inbound.transport.abortConnection()

    # LegSink for the accepted leg during the connect phase.
    def made(self) -> None:
        self.inbound.transport.pauseProducing()
        factory = _OutboundFactory(Leg(_NULL_SINK))
        started, self._started = self._started, None
        if started is not None:
            target = cast(SocketTarget, self._target)
            d: Deferred[Leg] = target.connect(factory, started)
        else:
            d = self._target.connect(factory)  # type: ignore[assignment]
        if d.called:
            d.addCallbacks(self._connected, self._connect_failed)
            return
        self._connect = d
        d.addCallbacks(self._connected, self._connect_failed)

    def data(self, data: bytes) -> None:
        # The accepted leg is paused until the engine starts; nothing can be lost here.
        raise AssertionError("data before the relay started")

    def read_eof(self) -> None:
        pass

    def write_shut(self) -> None:
        pass

    def lost(self, reason: Failure) -> None:
        # The accepted leg is gone (it is ours only while CONNECTING): end, cancelling the
        # connect first (a cancel is not a failure, see _connect_failed).
        if self.phase is _ENDED:
            return
        self.phase = _ENDED
        if self._connect is not None:
            self._connect.cancel()
        self._report(OUTCOME_ABORTED if self._aborted else OUTCOME_RESET)

    def _connected(self, leg: Leg) -> None:
        self._connect = None
        if self.phase is _ENDED or self._aborted:
            leg.transport.abortConnection()
            return
        engine = self._engine_factory(self._engine_ended)
        self.engine = engine
        self.phase = _RELAYING  # before the start, as in start_accepted
        engine.start(self.inbound, leg)
        if self._paused:
            engine.pauseProducing()

    def _connect_failed(self, failure: Failure) -> None:
        self._connect = None
        if failure.check(CancelledError, ierror.ConnectingCancelledError):
            return
        self._failure = (OUTCOME_CONNECT_FAILED, RelayFailure.of(failure))
        if self.phase is not _ENDED:
            self.inbound.transport.abortConnection()

    def _engine_ended(self, outcome: Outcome) -> None:
        if self.phase is _ENDED:
            return
        self.phase = _ENDED
        self._report(outcome)

    def _report(self, outcome: Outcome) -> None:
        """Tell the owner (once: every caller has just moved to ENDED), then the waiters."""
        reason: RelayFailure | None = None
        if self._failure is not None:
            outcome, reason = self._failure
        self._owner.relay_ended(self, outcome, reason)
        if self._end is not None:
            self._end.fire(None)


__all__ = [
    "EAGER_SEND",
    "OUTCOME_ABORTED",
    "OUTCOME_CLOSED",
    "OUTCOME_CONNECT_FAILED",
    "OUTCOME_RESET",
    "READ_SIZE",
    "EngineFactory",
    "Leg",
    "LegSink",
    "Outcome",
    "Phase",
    "RelayEngine",
    "RelayFailure",
    "RelayOwner",
    "RelaySession",
    "SocketTarget",
    "TransportRelay",
]
