"""Security-2 T2: silent TCP peers of the TLS control listener cannot hold its slots.

Unit tests on a fake clock and string transports; the real-socket check is in
``test_realsocket.TLSTests.test_silent_connections_do_not_lock_out_a_launcher``.
"""

from __future__ import annotations

from typing import Any

from OpenSSL.crypto import X509
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import ISSLTransport
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from zope.interface import implementer

from bottlenet.control import codec
from bottlenet.control import commands as C
from bottlenet.control.admission import (
    HANDSHAKE_DEADLINE,
    MAX_PENDING_PER_SOURCE,
    MAX_PENDING_TOTAL,
)
from bottlenet.control.server import ControlServerFactory, ControlServerProtocol

from . import certs
from .fakes import make_factory
from .test_hostile import raw_command

_CLIENT = certs.issue(certs.make_ca("admission CA"), "launcher-1", server=False)


@implementer(ISSLTransport)
class _TLSStringTransport(StringTransport):
    """A TCP peer at ``host`` whose TLS layer presents the launcher's certificate."""

    def __init__(self, host: str) -> None:
        super().__init__(peerAddress=IPv4Address("TCP", host, 40000))
        self.aborted = False

    def getPeerCertificate(self) -> X509:
        return X509.from_cryptography(_CLIENT.cert)

    def abortConnection(self) -> None:
        self.aborted = True
        super().abortConnection()


def _connect(factory: ControlServerFactory, host: str) -> tuple[Any, _TLSStringTransport]:
    transport = _TLSStringTransport(host)
    proto = factory.buildProtocol(None)
    assert proto is not None  # a TLS connection is never refused before its handshake
    proto.makeConnection(transport)
    return proto, transport


def _tls_factory(max_connections: int = 64) -> tuple[ControlServerFactory, Clock]:
    clock = Clock()
    return make_factory(clock=clock, max_connections=max_connections, tls=True), clock


def _launcher_pings(proto: ControlServerProtocol, transport: _TLSStringTransport) -> bool:
    proto.handshakeCompleted()
    proto.dataReceived(raw_command(b"bottlenet.Ping", b"1"))
    return not transport.aborted and codec.decode_answer(C.Ping, _one_box(transport)) == {}


def _one_box(transport: StringTransport) -> Any:
    from bottlenet.control.framing import BoxParser

    parser = BoxParser()
    parser.feed(transport.value())
    return parser.next_box()


def test_tls_silent_connections_take_no_slot_and_yield_to_a_launcher() -> None:
    """T2: 1,000 silent peers (one source) hold no slot; a launcher from there still gets in."""
    factory, _clock = _tls_factory()
    with capturedLogs() as events:
        silent = [_connect(factory, "10.0.0.9") for _ in range(1000)]
        assert factory.open_connections == 0  # no slot before a verified certificate
        held = [t for _, t in silent if not t.aborted]
        assert len(held) == MAX_PENDING_PER_SOURCE  # the oldest gave way to each newcomer
        proto, transport = _connect(factory, "10.0.0.9")
        assert _launcher_pings(proto, transport)
    assert factory.open_connections == 1
    text = [e.get("log_format", "") for e in events]
    assert sum("unauthenticated TLS" in t for t in text) == 1  # one line for the cause
    assert not any(e.get("log_failure") for e in events)  # no traceback


def test_tls_pending_total_cap_spans_sources() -> None:
    """T2: many sources together hold at most the total cap of unauthenticated connections."""
    factory, _clock = _tls_factory()
    conns = [_connect(factory, f"10.1.{i // 250}.{i % 250}") for i in range(MAX_PENDING_TOTAL * 3)]
    assert sum(not t.aborted for _, t in conns) == MAX_PENDING_TOTAL
    assert all(t.aborted for _, t in conns[: MAX_PENDING_TOTAL * 2])  # the oldest went first


def test_tls_handshake_deadline_ends_silent_peers() -> None:
    """T2: a peer that has not completed its handshake by the deadline is closed, once logged."""
    factory, clock = _tls_factory()
    with capturedLogs() as events:
        conns = [_connect(factory, f"10.2.0.{i}") for i in range(10)]
        early, _ = conns[0]
        early.handshakeCompleted()  # authenticated before the deadline: kept
        clock.advance(HANDSHAKE_DEADLINE)
    assert [t.aborted for _, t in conns] == [False] + [True] * 9
    assert factory.admission is not None and factory.admission.handshakes.waiting == 0
    text = [e.get("log_format", "") for e in events]
    assert sum("did not complete its handshake" in t for t in text) == 1


def test_tls_slots_count_authenticated_peers_only() -> None:
    """T2: the connection cap applies at handshake completion; a surplus peer is closed."""
    factory, _clock = _tls_factory(max_connections=2)
    conns = [_connect(factory, "10.3.0.1") for _ in range(3)]
    for proto, _ in conns:
        proto.handshakeCompleted()
    assert [t.aborted for _, t in conns] == [False, False, True]
    assert (factory.open_connections, factory.refused) == (2, 1)
    conns[0][0].connectionLost(Failure(ConnectionDone()))
    assert factory.open_connections == 1
    proto, transport = _connect(factory, "10.3.0.1")
    assert _launcher_pings(proto, transport)


def test_tls_a_speaking_handshake_outlives_silent_newcomers() -> None:
    """T2: silent peers that keep arriving from the launcher's own address evict each other,
    never the launcher's handshake in progress (its ClientHello came at once)."""
    factory, _clock = _tls_factory()
    for _ in range(MAX_PENDING_PER_SOURCE):
        _connect(factory, "10.4.0.1")
    proto, transport = _connect(factory, "10.4.0.1")
    proto.first_bytes_received()  # the TLS layer saw its ClientHello
    later = [_connect(factory, "10.4.0.1") for _ in range(1000)]
    assert not transport.aborted
    assert sum(not t.aborted for _, t in later) == MAX_PENDING_PER_SOURCE - 1
    assert _launcher_pings(proto, transport)


def test_tls_settled_handshakes_give_their_source_slot_back() -> None:
    """T2: a source whose handshakes complete is never capped by them (tests-3 A08): two
    caps' worth of launchers from one address, one after another, are each served."""
    factory, _clock = _tls_factory()
    for _ in range(2 * MAX_PENDING_PER_SOURCE + 1):
        proto, transport = _connect(factory, "10.5.0.1")
        assert _launcher_pings(proto, transport)
        proto.connectionLost(Failure(ConnectionDone()))
    assert factory.admission is not None and factory.admission.handshakes.waiting == 0
    assert factory.admission.handshakes.ended == 0


def test_tls_a_source_at_its_cap_evicts_only_its_own() -> None:
    """T2: a flooding source churns its own connections, never another source's pending
    handshake, and never holds more than its cap (tests-3 A05)."""
    factory, _clock = _tls_factory()
    _other, other = _connect(factory, "10.6.0.9")
    flood = [_connect(factory, "10.6.0.1") for _ in range(MAX_PENDING_PER_SOURCE + 4)]
    assert not other.aborted
    assert sum(not t.aborted for _, t in flood) == MAX_PENDING_PER_SOURCE
    assert factory.admission is not None
    assert factory.admission.handshakes.waiting == MAX_PENDING_PER_SOURCE + 1


def test_tls_the_deadline_is_five_seconds() -> None:
    """T2: the documented 5 s (docs/security.md T2), as a literal: a peer is kept at 4.9 s
    and closed at 5 s (tests-3 A12: the other tests advance by the imported constant)."""
    factory, clock = _tls_factory()
    _proto, transport = _connect(factory, "10.7.0.1")
    clock.advance(4.9)
    assert not transport.aborted
    clock.advance(0.1)
    assert transport.aborted


def test_tls_layer_reports_first_bytes_to_the_admission(tmp_path: Any) -> None:
    """T2: the real TLS wrapper of the listener tells the admission a peer spoke, so a
    launcher mid-handshake outlives silent newcomers from its address (tests-3 A10)."""
    from twisted.internet.testing import MemoryReactor

    from bottlenet.control.endpoints import tls_control_endpoint

    ca = certs.make_ca("admission CA")
    key, cert = certs.write(str(tmp_path), "server", certs.issue(ca, "localhost", server=True))
    ca_path = certs.write(str(tmp_path), "ca", ca)[1]
    reactor = MemoryReactor()
    factory, _clock = _tls_factory()
    tls_control_endpoint(reactor, 0, "127.0.0.1", key, cert, ca_path).listen(factory)
    tls_factory = reactor.tcpServers[0][1]

    def connect() -> tuple[Any, _TLSStringTransport]:
        transport = _TLSStringTransport("10.8.0.1")
        tls: Any = tls_factory.buildProtocol(transport.getPeer())
        tls.makeConnection(transport)
        return tls, transport

    tls, launcher = connect()
    # The first bytes of a ClientHello record: OpenSSL waits for the rest.
    tls.dataReceived(b"\x16\x03\x01\x02\x00")
    silent = [connect()[1] for _ in range(MAX_PENDING_PER_SOURCE)]
    assert not launcher.aborted
    assert sum(t.aborted for t in silent) == 1  # the oldest silent one gave way
