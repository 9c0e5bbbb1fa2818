"""The host side of the own-endpoint check: the daemon's own listener sees the probe's nonce.

During the gate, before the endpoint carries any agent traffic, the forward's listener hands
its connections to a :class:`WitnessFactory` instead of the relay (``ForwardTable.divert``).
A connection that sends ``BNP-WITNESS <nonce> <endpoint>`` within the window is recorded;
anything else is recorded as a mismatch (never logged, never repeated) and closed. The relay
itself is untouched, so the data plane stays byte-transparent for everything after the gate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Factory, Protocol

#: The longest witness line: "BNP-WITNESS " + 64-hex nonce + " " + an endpoint.
MAX_LINE = 512


class Witness:
    """What the host saw during one gate run (shared by the factories of its endpoints)."""

    def __init__(self, nonce: str) -> None:
        self.nonce = nonce
        self.seen: set[str] = set()
        self.mismatched = 0
        self.open = True

    def expect(self, endpoint: str) -> bytes:
        return f"BNP-WITNESS {self.nonce} {endpoint}".encode()

    def close(self) -> None:
        """The probe window is over: later connections count for nothing."""
        self.open = False


class _WitnessProtocol(Protocol):
    def __init__(self, factory: WitnessFactory) -> None:
        self.factory = factory
        self.buf = b""
        self.timer: IDelayedCall | None = None

    def connectionMade(self) -> None:
        assert self.transport is not None
        resume = getattr(self.transport, "resumeProducing", None)
        if resume is not None:
            resume()  # the forward's accepted transports start paused
        self.timer = self.factory.clock.callLater(self.factory.timeout, self._give_up)

    def dataReceived(self, data: bytes) -> None:
        self.buf += data
        if b"\n" in self.buf or len(self.buf) > MAX_LINE:
            line = self.buf.split(b"\n", 1)[0]
            self._done(line == self.factory.witness.expect(self.factory.endpoint))

    def _give_up(self) -> None:
        self.timer = None
        self._done(False)

    def _done(self, good: bool) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        w = self.factory.witness
        if w.open:
            if good:
                w.seen.add(self.factory.endpoint)
            else:
                w.mismatched += 1
        self.factory.on_used()
        assert self.transport is not None
        self.transport.loseConnection()

    def connectionLost(self, reason: object = None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class WitnessFactory(Factory):
    """One endpoint's witness; ``on_used`` runs after its first connection (one shot)."""

    noisy = False

    def __init__(
        self,
        clock: IReactorTime,
        witness: Witness,
        endpoint: str,
        on_used: Callable[[], None] = lambda: None,
        timeout: float = 10.0,
    ) -> None:
        self.clock = clock
        self.witness = witness
        self.endpoint = endpoint
        self.on_used = on_used
        self.timeout = timeout

    def buildProtocol(self, addr: Any) -> _WitnessProtocol:
        return _WitnessProtocol(self)


class ConnectWitness:
    """What the host saw at the proxy service during the layer's check: the ``CONNECT``
    targets it expected (a canary's), and a count of anything else (never repeated)."""

    def __init__(self, expected: Iterable[str]) -> None:
        self.expected = frozenset(expected)
        self.seen: set[str] = set()
        self.other = 0
        self.open = True
        #: Told once, when every expected target has been seen.
        self.on_all: Callable[[], None] = lambda: None

    def close(self) -> None:
        self.open = False


class _ConnectProtocol(Protocol):
    """One connection at the diverted proxy endpoint: its request head is read (bounded), its
    target recorded when expected, and it is answered 403 (the canary is refused)."""

    def __init__(self, factory: ConnectWitnessFactory) -> None:
        self.factory = factory
        self.buf = b""
        self.timer: IDelayedCall | None = None
        self.done = False

    def connectionMade(self) -> None:
        assert self.transport is not None
        resume = getattr(self.transport, "resumeProducing", None)
        if resume is not None:
            resume()
        self.timer = self.factory.clock.callLater(self.factory.timeout, self._finish, None)

    def dataReceived(self, data: bytes) -> None:
        if self.done:
            return
        self.buf += data
        if b"\r\n\r\n" in self.buf or len(self.buf) > MAX_LINE:
            words = self.buf.split(b"\r\n", 1)[0].split(b" ")
            target = None
            if len(words) == 3 and words[0] == b"CONNECT" and words[2].startswith(b"HTTP/1."):
                target = words[1].decode("ascii", "replace")
            self._finish(target)

    def _finish(self, target: str | None) -> None:
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None
        if self.done:
            return
        self.done = True
        w = self.factory.witness
        if w.open:
            if target is not None and target in w.expected:
                w.seen.add(target)
                if w.seen == w.expected:
                    w.on_all()
            else:
                w.other += 1
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
        self.transport.loseConnection()

    def connectionLost(self, reason: object = None) -> None:
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None


class ConnectWitnessFactory(Factory):
    """The proxy endpoint's witness while the layer is checked (every connection, until the
    endpoint is given back to its relay)."""

    noisy = False

    def __init__(self, clock: IReactorTime, witness: ConnectWitness, timeout: float = 10.0) -> None:
        self.clock = clock
        self.witness = witness
        self.timeout = timeout

    def buildProtocol(self, addr: Any) -> _ConnectProtocol:
        return _ConnectProtocol(self)
