"""Real-socket helpers for forward tests: small target servers and a collecting client."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, UNIXClientEndpoint
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure
from zope.interface import implementer

from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import AliasPool

POOL = AliasPool.parse("127.77.0.0/16")


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def registry_with(*pairs: tuple[str, str]) -> AliasRegistry:
    reg = AliasRegistry(POOL)
    for bottle, alias in pairs:
        reg.claim(bottle, alias)
    return reg


def pattern(n: int, seed: int = 1) -> bytes:
    """Deterministic incompressible-ish bytes."""
    out = bytearray()
    block = hashlib.sha256(str(seed).encode()).digest()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block * 32
    return bytes(out[:n])


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@implementer(IHalfCloseableProtocol)
class Collector(Protocol):
    """A client or server end: sends ``to_send`` (then FIN if ``fin``), collects what it gets."""

    def __init__(self, to_send: bytes = b"", fin: bool = True) -> None:
        self.to_send = to_send
        self.fin = fin
        self.received = bytearray()
        self.eof = False
        self.reason: Failure | None = None
        self.done: defer.Deferred[Collector] = defer.Deferred()
        self.on_data: Callable[[Collector], None] | None = None
        self.after_eof: bytes | None = None

    def connectionMade(self) -> None:
        if self.to_send:
            self.transport.write(self.to_send)  # type: ignore[union-attr]
        if self.fin:
            self.transport.loseWriteConnection()  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        if self.on_data is not None:
            self.on_data(self)

    def readConnectionLost(self) -> None:
        self.eof = True
        if self.after_eof is not None:
            # Keep talking after the peer's FIN, then finish our side too.
            self.transport.write(self.after_eof)  # type: ignore[union-attr]
            self.transport.loseWriteConnection()  # type: ignore[union-attr]
            return
        self.transport.loseConnection()  # type: ignore[union-attr]

    def writeConnectionLost(self) -> None:
        if self.eof:
            self.transport.loseConnection()  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.reason = reason
        self.done.callback(self)

    @property
    def clean(self) -> bool:
        reason = self.reason
        return self.eof and reason is not None and reason.check(ConnectionDone) is not None


@implementer(IHalfCloseableProtocol)
class Echo(Protocol):
    """Echo, and pass the half-close back once everything is echoed."""

    def dataReceived(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[union-attr]

    def readConnectionLost(self) -> None:
        self.transport.loseWriteConnection()  # type: ignore[union-attr]

    def writeConnectionLost(self) -> None:
        self.transport.loseConnection()  # type: ignore[union-attr]


@implementer(IHalfCloseableProtocol)
class ReplyAfterEOF(Protocol):
    """Read everything until EOF, then answer with sha256(received) + ``extra`` bytes."""

    def __init__(self, extra: bytes) -> None:
        self.extra = extra
        self.got = bytearray()

    def dataReceived(self, data: bytes) -> None:
        self.got += data

    def readConnectionLost(self) -> None:
        self.transport.write(sha(bytes(self.got)).encode() + self.extra)  # type: ignore[union-attr]
        self.transport.loseConnection()  # type: ignore[union-attr]

    def writeConnectionLost(self) -> None:
        pass


@implementer(IHalfCloseableProtocol)
class SendThenFINThenRead(Protocol):
    """The target half-closes first: sends ``payload`` + FIN, then keeps reading until EOF."""

    def __init__(self, payload: bytes, result: defer.Deferred[bytes]) -> None:
        self.payload = payload
        self.result = result
        self.got = bytearray()

    def connectionMade(self) -> None:
        self.transport.write(self.payload)  # type: ignore[union-attr]
        self.transport.loseWriteConnection()  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        self.got += data

    def readConnectionLost(self) -> None:
        self.result.callback(bytes(self.got))
        self.transport.loseConnection()  # type: ignore[union-attr]

    def writeConnectionLost(self) -> None:
        pass


class ResetAfter(Protocol):
    """Send ``payload``, then reset the connection once ``n`` bytes were received."""

    def __init__(self, n: int, payload: bytes = b"") -> None:
        self.n = n
        self.payload = payload
        self.count = 0

    def connectionMade(self) -> None:
        if self.payload:
            self.transport.write(self.payload)  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        self.count += len(data)
        if self.count >= self.n:
            self.transport.abortConnection()  # type: ignore[attr-defined, union-attr]


class StreamOut(Protocol):
    """Push ``total`` bytes as fast as the consumer allows (a push producer), then close."""

    CHUNK = 256 * 1024

    def __init__(self, total: int) -> None:
        self.total = total
        self.sent = 0
        self.paused = False
        self.finished = False
        self.digest = hashlib.sha256()

    def connectionMade(self) -> None:
        self.transport.registerProducer(self, True)  # type: ignore[union-attr]
        reactor.callLater(0, self.resumeProducing)  # type: ignore[attr-defined]

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        while not self.paused and self.sent < self.total:
            n = min(self.CHUNK, self.total - self.sent)
            chunk = pattern(n, seed=self.sent)
            self.digest.update(chunk)
            self.sent += n
            self.transport.write(chunk)  # type: ignore[union-attr]
        if self.sent >= self.total and not self.paused and not self.finished:
            self.finished = True
            self.transport.unregisterProducer()  # type: ignore[union-attr]
            self.transport.loseConnection()  # type: ignore[union-attr]

    def stopProducing(self) -> None:
        pass


def factory_of(build: Callable[[], Protocol]) -> Factory:
    f = Factory()
    f.noisy = False
    f.buildProtocol = lambda addr: build()  # type: ignore[method-assign, assignment]
    return f


def connect_tcp(host: str, port: int, proto: Protocol) -> defer.Deferred[Any]:
    ep = TCP4ClientEndpoint(reactor, host, port, timeout=5)
    return ep.connect(factory_of(lambda: proto))


def connect_unix(path: str, proto: Protocol) -> defer.Deferred[Any]:
    ep = UNIXClientEndpoint(reactor, path, timeout=5)
    return ep.connect(factory_of(lambda: proto))
