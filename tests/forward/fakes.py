"""In-memory fakes for relay unit tests.

``FakeTransport`` models the parts of Twisted's ``FileDescriptor`` a relay depends on: a write
buffer with a high-water mark that pauses the registered streaming producer, resume-on-drain
*instead of* the pending half-close when the producer is paused (the real behaviour behind
trap 1), loseWriteConnection / loseConnection / abortConnection (abort completes on the next
tick, like ``callLater(0)``), and ``stopProducing`` = ``loseConnection``. ``StringTransport``
does not model the drain/half-close interplay, hence this class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionAborted, ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IProtocolFactory
from twisted.python.failure import Failure


class FakeTransport:
    def __init__(self, ticks: list[Callable[[], None]], limit: int = 8) -> None:
        self.ticks = ticks
        self.limit = limit
        self.protocol: Any = None
        self.pending = bytearray()  # written by the relay, not yet taken by the remote end
        self.delivered = bytearray()  # taken by the remote end
        self.producer: Any = None
        self.streaming = False
        self.producer_paused = False
        self.reading = True
        self.writing = False
        self.write_disconnecting = False
        self.write_shut = False
        self.disconnecting = False
        self.aborting = False
        self.closed = False
        self.close_how: str | None = None
        self.writes_after_fin = 0

    def makeConnection(self, protocol: Any) -> None:
        self.protocol = protocol
        protocol.makeConnection(self)

    # IConsumer
    def registerProducer(self, producer: Any, streaming: bool) -> None:
        if self.producer is not None:
            raise RuntimeError("producer already registered")
        if self.closed:
            producer.stopProducing()
            return
        self.producer = producer
        self.streaming = streaming

    def unregisterProducer(self) -> None:
        self.producer = None

    def write(self, data: bytes) -> None:
        assert isinstance(data, bytes)
        if self.write_disconnecting:
            self.writes_after_fin += 1
        if self.closed or self.write_shut or not data:
            return
        self.pending += data
        self.writing = True
        if self.producer is not None and self.streaming and len(self.pending) > self.limit:
            self.producer_paused = True
            self.producer.pauseProducing()

    def flush(self) -> None:
        """One writable event in which the remote end takes everything."""
        if self.closed or not self.writing:
            return
        self.delivered += self.pending
        self.pending.clear()
        self.writing = False
        if self.producer is not None and (not self.streaming or self.producer_paused):
            self.producer_paused = False
            self.producer.resumeProducing()
        elif self.disconnecting:
            self._lost("clean")
        elif self.write_disconnecting and not self.write_shut:
            self.write_shut = True
            self.protocol.writeConnectionLost()

    def loseWriteConnection(self) -> None:
        self.write_disconnecting = True
        self.writing = True

    def loseConnection(self) -> None:
        if self.closed or self.disconnecting:
            return
        self.reading = False
        if self.write_shut:
            self._lost("clean")
        else:
            self.disconnecting = True
            self.writing = True

    def abortConnection(self) -> None:
        if self.closed or self.aborting:
            return
        self.aborting = True
        self.reading = False
        self.writing = False
        self.ticks.append(lambda: self._lost("abort"))

    # IPushProducer
    def pauseProducing(self) -> None:
        self.reading = False

    def resumeProducing(self) -> None:
        if not self.closed and not self.disconnecting and not self.aborting:
            self.reading = True

    def stopProducing(self) -> None:
        self.loseConnection()

    # Remote events
    def remote_reset(self) -> None:
        self._lost("reset")

    def _lost(self, how: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_how = how
        self.reading = False
        self.writing = False
        if self.producer is not None:
            producer, self.producer = self.producer, None
            producer.stopProducing()
        exc: Exception
        if how == "clean":
            exc = ConnectionDone()
        elif how == "abort":
            exc = ConnectionAborted()
        else:
            exc = ConnectionLost()
        self.protocol.connectionLost(Failure(exc))


class FakeEndpoint:
    """A client endpoint whose connection attempts the test completes by hand."""

    def __init__(self) -> None:
        self.attempts: list[tuple[IProtocolFactory, Deferred[Any]]] = []
        self.cancelled = 0

    def connect(self, factory: IProtocolFactory) -> Deferred[Any]:
        def cancel(d: Deferred[Any]) -> None:
            self.cancelled += 1

        d: Deferred[Any] = Deferred(cancel)
        self.attempts.append((factory, d))
        return d

    def succeed(self, transport: FakeTransport) -> Any:
        factory, d = self.attempts[-1]
        proto = factory.buildProtocol(None)
        transport.makeConnection(proto)
        d.callback(proto)
        return proto


class RecordingOwner:
    def __init__(self) -> None:
        self.ends: list[tuple[Any, str, str | None]] = []

    def relay_ended(self, session: Any, outcome: str, reason: Any) -> None:
        self.ends.append((session, outcome, reason))
