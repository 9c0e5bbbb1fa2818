"""A control connection's declared mode: authenticating -> amp -> switch_pending -> switched,
closing reachable from each (``HardenedAMP.mode``, docs/architecture.md "Declared states")."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import LogEvent
from twisted.python.failure import Failure

from bottlenet.control import codec
from bottlenet.control import commands as C
from bottlenet.control.protocol import ConnectionMode, HardenedAMP, SafeCommandLocator
from bottlenet.control.server import PeerIdentity

from .fakes import Conn, UNIXStringTransport, make_factory


class RecordingSink:
    """A stream sink that records what the connection told it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def attach(self, transport: Any, leftover: bytes) -> None:
        self.calls.append(("attach", leftover))

    def client_data(self, data: bytes) -> None:
        self.calls.append(("data", data))

    def client_lost(self) -> None:
        self.calls.append(("lost",))


class Switcher(SafeCommandLocator):
    """Ping asks for a switch to ``sink``; ``before_answer`` runs before the answer is out,
    and with ``late`` set the switch is asked only once ``late`` fires."""

    def __init__(self) -> None:
        self.proto: HardenedAMP | None = None
        self.sink = RecordingSink()
        self.before_answer: Any = None
        self.late: Deferred[None] | None = None
        self.modes: list[ConnectionMode] = []

    def _switch(self, _: object = None) -> dict[str, Any]:
        assert self.proto is not None
        self.proto.switch_after_answer(self.sink)
        self.modes.append(self.proto.mode)
        if self.before_answer is not None:
            return self.before_answer()  # type: ignore[no-any-return]
        return {}

    @C.Ping.responder
    def ping(self) -> Any:
        if self.late is not None:
            return self.late.addCallback(self._switch)
        return self._switch()


def switching() -> tuple[HardenedAMP, Switcher, StringTransport]:
    locator = Switcher()
    proto = HardenedAMP(locator)
    locator.proto = proto
    transport = StringTransport()
    proto.makeConnection(transport)
    return proto, locator, transport


def ping(tag: bytes = b"1") -> bytes:
    return codec.encode_request(C.Ping, tag, {})


def lose(proto: HardenedAMP) -> None:
    proto.connectionLost(Failure(ConnectionDone()))


def test_an_allowed_unix_peer_is_parsed_from_the_start() -> None:
    """A UNIX peer whose uid is allowed is authenticated at connect: the mode is amp."""
    conn = Conn()
    assert conn.proto.mode is ConnectionMode.AMP
    assert conn.call(C.Ping) == {}


def test_a_refused_uid_is_closing_and_nothing_it_sends_is_parsed() -> None:
    """A refused uid leaves the connection closing: aborted, and its boxes never answered."""
    conn = Conn(make_factory(uid=12345, clock=Clock()))
    assert conn.proto.mode is ConnectionMode.CLOSING
    assert conn.transport.aborted
    conn.send(ping())
    assert conn.transport.value() == b""
    conn.close()


def test_tls_peer_is_authenticating_until_its_certificate_is_checked() -> None:
    """Under TLS the mode is authenticating until the handshake; then amp and parsed."""
    factory = make_factory(clock=Clock(), tls=True)
    transport = UNIXStringTransport()
    proto = factory.buildProtocol(None)
    assert proto is not None
    proto.makeConnection(transport)
    assert proto.mode is ConnectionMode.AUTHENTICATING
    proto.authenticated_as(PeerIdentity("tls", subject="'t'"))
    assert proto.mode is ConnectionMode.AMP
    proto.dataReceived(ping())
    assert transport.value() != b""
    transport.sock.close()


def test_data_before_authentication_drops_the_connection(logs: list[LogEvent]) -> None:
    """A byte while authenticating drops the connection (closing), logged with our reason."""
    factory = make_factory(clock=Clock(), tls=True)
    transport = UNIXStringTransport()
    proto = factory.buildProtocol(None)
    assert proto is not None
    proto.makeConnection(transport)
    proto.dataReceived(ping())
    assert proto.mode is ConnectionMode.CLOSING
    assert transport.aborted and transport.value() == b""
    assert any(e.get("why") == "data before authentication" for e in logs)
    transport.sock.close()


def test_switch_happens_once_the_answer_is_written() -> None:
    """switch_pending while the command runs; switched once answered; then bytes go to the sink."""
    proto, locator, transport = switching()
    proto.dataReceived(ping() + b"after")
    assert locator.modes == [ConnectionMode.SWITCH_PENDING]
    assert proto.mode is ConnectionMode.SWITCHED
    assert transport.value().startswith(b"\x00\x07_answer")
    assert locator.sink.calls == [("attach", b"after")]
    assert transport.producer is None  # the sink registers itself as the producer
    proto.dataReceived(ping(b"2"))
    assert locator.sink.calls[-1] == ("data", ping(b"2"))
    lose(proto)
    assert proto.mode is ConnectionMode.CLOSING
    assert locator.sink.calls[-1] == ("lost",)
    assert locator.sink.calls.count(("lost",)) == 1


def test_switch_resumes_reading_paused_for_our_writes() -> None:
    """A switch clears the pause reasons and resumes the transport the protocol had paused."""
    proto, locator, transport = switching()
    d: Deferred[dict[str, Any]] = Deferred()
    locator.before_answer = lambda: d
    proto.dataReceived(ping())
    proto.pauseProducing()
    assert transport.producerState == "paused" and proto.pause_reasons == {"write"}
    d.callback({})
    assert proto.mode is ConnectionMode.SWITCHED
    assert transport.producerState == "producing" and proto.pause_reasons == frozenset()
    proto.pauseProducing()  # a late pause from the old registration changes nothing
    assert proto.pause_reasons == frozenset()


def test_drop_while_switch_pending_tells_the_sink_lost_and_never_attaches() -> None:
    """Dropped between the switch request and the answer: the sink hears lost, once."""
    proto, locator, _transport = switching()

    def drop_first() -> dict[str, Any]:
        assert locator.proto is not None
        locator.proto.drop("test")
        return {}

    locator.before_answer = drop_first
    proto.dataReceived(ping())
    assert proto.mode is ConnectionMode.CLOSING
    assert locator.sink.calls == [("lost",)]
    lose(proto)
    assert locator.sink.calls == [("lost",)]


def test_connection_lost_while_switch_pending_never_attaches() -> None:
    """The client leaves before the answer: lost at once; the late answer attaches nothing."""
    proto, locator, _transport = switching()
    d: Deferred[dict[str, Any]] = Deferred()
    locator.before_answer = lambda: d
    proto.dataReceived(ping())
    assert proto.mode is ConnectionMode.SWITCH_PENDING
    lose(proto)
    assert locator.sink.calls == [("lost",)]
    d.callback({})
    assert proto.mode is ConnectionMode.CLOSING
    assert locator.sink.calls == [("lost",)]


def test_a_switch_asked_while_closing_is_told_lost_at_the_answer() -> None:
    """A command that asks to switch on a closing connection: its sink hears lost, not attach."""
    proto, locator, _transport = switching()
    locator.late = Deferred()
    proto.dataReceived(ping())
    proto.stopProducing()
    assert proto.mode is ConnectionMode.CLOSING
    locator.late.callback(None)
    assert locator.modes == [ConnectionMode.CLOSING]
    assert locator.sink.calls == [("lost",)]
    lose(proto)
    assert locator.sink.calls == [("lost",)]


def test_a_switch_asked_while_closing_is_told_lost_at_connection_lost() -> None:
    """Lost before the answer is written: the sink of a closing connection hears lost then."""
    proto, locator, _transport = switching()
    locator.late = Deferred()
    locator.before_answer = Deferred
    proto.dataReceived(ping())
    proto.drop("test")
    locator.late.callback(None)
    assert locator.sink.calls == []
    lose(proto)
    assert locator.sink.calls == [("lost",)]


def test_drop_is_logged_once_and_closing_is_final(logs: list[LogEvent]) -> None:
    """A second drop on a closing connection does not log again; closing stays closing."""
    proto, _, transport = switching()
    proto.drop("first")
    proto.drop("second")
    proto.stopProducing()  # closing is final: a later stop leaves it closing
    assert proto.mode is ConnectionMode.CLOSING
    proto.dataReceived(ping())
    assert transport.value() == b""
    assert [e.get("why") for e in logs if "why" in e] == ["first"]
