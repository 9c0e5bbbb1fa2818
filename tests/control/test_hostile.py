"""Hostile input on the control protocol (reliability catalogue B1-B6, G1)."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.logger import LogEvent
from twisted.protocols import amp

from bottlenet.control import codec
from bottlenet.control import commands as C
from bottlenet.control.framing import MAX_BOX_BYTES, MAX_KEYS_PER_BOX, BoxParser, FramingError
from bottlenet.control.protocol import MAX_IN_FLIGHT
from bottlenet.errors import InvalidArgument

from .fakes import Conn, FakeBackend, UNIXStringTransport, make_factory

CANARY = "CANARY-7f3e9a"


def kv(key: bytes, value: bytes) -> bytes:
    return len(key).to_bytes(2, "big") + key + len(value).to_bytes(2, "big") + value


def raw_command(command: bytes, tag: bytes = b"1", /, **args: bytes) -> bytes:
    body = kv(b"_command", command) + kv(b"_ask", tag)
    for k, v in args.items():
        body += kv(k.encode(), v)
    return body + b"\x00\x00"


def assert_no_canary(logs: list[LogEvent], canary: str = CANARY) -> None:
    from twisted.logger import formatEvent

    text = "\n".join(formatEvent(e) + repr(e) for e in logs)
    assert canary not in text
    assert canary.encode().hex() not in text


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff\xff" + b"x" * 100,  # key length 65535
        b"\x01\x00" + b"k" * 256,  # key length 256 > 255
        b"\x00\x00",  # an empty box
        b"\x00\x01k\x00\x01v\x00\x00",  # neither command nor answer
        raw_command(b"bottlenet.Ping")[:-2].replace(b"_ask", b"_axe") + b"\x00\x00",
    ],
)
def test_garbage_closes_that_connection(conn: Conn, garbage: bytes, logs: list[LogEvent]) -> None:
    conn.send(garbage)
    assert conn.transport.aborted
    other = Conn(conn.factory)
    assert other.call(C.Ping) == {}
    other.close()
    assert not any(e.get("log_failure") for e in logs)


def test_truncated_frame_then_eof(conn: Conn, logs: list[LogEvent]) -> None:
    from twisted.internet.error import ConnectionDone
    from twisted.python.failure import Failure

    conn.send(raw_command(b"bottlenet.Ping")[:-5])
    assert conn.transport.value() == b""
    conn.proto.connectionLost(Failure(ConnectionDone()))
    assert any("mid-box" in str(e.get("log_format")) for e in logs)
    assert not any(e.get("log_failure") for e in logs)


def test_unterminated_box_is_capped_with_bounded_memory(conn: Conn) -> None:
    value = b"v" * 0xFFFF
    chunk = b"".join(kv(b"k%04d" % i, value) for i in range(8))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(3000 // 8):
            conn.send(chunk)
            if conn.transport.aborted:
                break
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert conn.transport.aborted
    assert peak < 5 * 1024 * 1024
    assert conn.proto.unparsed == 0


def test_too_many_small_keys() -> None:
    parser = BoxParser()
    parser.feed(b"".join(kv(b"k%d" % i, b"") for i in range(MAX_KEYS_PER_BOX + 1)))
    with pytest.raises(FramingError, match="keys"):
        while parser.next_box() is not None:
            pass


def test_box_exactly_at_cap_passes() -> None:
    parser = BoxParser(max_box_bytes=MAX_BOX_BYTES)
    data = kv(b"a", b"x" * 0xFFFF) + kv(b"b", b"x" * 0xFFFF) + kv(b"c", b"x" * 0xFFFF)
    parser.feed(data + b"\x00\x00")
    box = parser.next_box()
    assert box is not None and len(box) == 3


def test_duplicate_key_rejected() -> None:
    parser = BoxParser()
    parser.feed(kv(b"a", b"1") + kv(b"a", b"2") + b"\x00\x00")
    with pytest.raises(FramingError, match="duplicate"):
        parser.next_box()


@pytest.mark.parametrize(
    ("command", "args"),
    [
        (b"bottlenet.ListBottles", {"offset": CANARY.encode()}),
        (b"bottlenet.ListBottles", {"limit": b" 12"}),
        (b"bottlenet.ListBottles", {"limit": b"1_0"}),
        (b"bottlenet.ListBottles", {"limit": b"9" * 400}),
        (b"bottlenet.AddForward", {"bottle": b"b", "label": b"l", "target": b"t", "port": b"80.0"}),
        (b"bottlenet.AddForward", {"bottle": b"b", "label": b"l", "target": b"t", "port": b"True"}),
        (b"bottlenet.AddForward", {"bottle": b"b", "label": b"l"}),
        (b"bottlenet.CreateBottle", {"name": b"\xff\xfe" + CANARY.encode()}),
        (b"bottlenet.CreateBottle", {"name": CANARY.encode() + b"/../x\n"}),
        (b"bottlenet.CreateBottle", {"name": b"ok\x00" + CANARY.encode()}),
        (b"bottlenet.CreateBottle", {"name": b"x" * 0xFFFF}),
        (b"bottlenet.CreateBottle", {}),
        (b"bottlenet.Hello", {"client_version": b"x", "protocols": CANARY.encode()}),
    ],
)
def test_wrong_types_are_typed_errors_without_echo(
    conn: Conn, logs: list[LogEvent], command: bytes, args: dict[str, bytes]
) -> None:
    conn.send(raw_command(command, b"9", **args))
    (box,) = conn.boxes()
    assert box[b"_error"] == b"9"
    with pytest.raises(InvalidArgument) as info:
        codec.decode_answer(C.Ping, box)
    assert CANARY not in info.value.message
    assert b"\xff" not in box[b"_error_description"]
    assert not conn.transport.aborted
    backend = conn.factory.context.backend
    assert isinstance(backend, FakeBackend)
    assert backend.calls == []
    assert_no_canary(logs)
    assert not any(e.get("log_failure") for e in logs)
    assert conn.call(C.Ping) == {}


def test_unknown_extra_argument_is_ignored(conn: Conn) -> None:
    """Forward compatibility: unknown keys are ignored (a newer client's optional args)."""
    conn.send(raw_command(b"bottlenet.Ping", b"3", future=b"1"))
    (box,) = conn.boxes()
    assert box == {b"_answer": b"3"}


@pytest.mark.parametrize(
    "box",
    [
        kv(b"_answer", CANARY.encode()) + b"\x00\x00",
        kv(b"_error", CANARY.encode())
        + kv(b"_error_code", b"X")
        + kv(b"_error_description", b"y")
        + b"\x00\x00",
        kv(b"_error", b"1") + b"\x00\x00",
    ],
)
def test_stray_answers_drop_without_traceback(conn: Conn, logs: list[LogEvent], box: bytes) -> None:
    conn.send(box)
    assert conn.transport.aborted
    assert not any(e.get("log_failure") for e in logs)
    assert_no_canary(logs)


def test_duplicate_ask_tags_answered_each(conn: Conn) -> None:
    conn.send(raw_command(b"bottlenet.Ping", b"5") * 2)
    assert [b[b"_answer"] for b in conn.boxes()] == [b"5", b"5"]


def test_start_tls_and_string_responders_unreachable(conn: Conn) -> None:
    conn.send(raw_command(b"StartTLS", b"1"))
    (box,) = conn.boxes()
    assert box[b"_error_code"] == b"UNHANDLED"


class BackpressureTransport(UNIXStringTransport):
    """Pauses its producer above ``limit`` buffered bytes, like a real FileDescriptor."""

    limit = 4096

    def __init__(self) -> None:
        super().__init__()
        self.max_buffered = 0

    def write(self, data: bytes) -> None:
        super().write(data)
        size = len(self.io.getvalue())
        self.max_buffered = max(self.max_buffered, size)
        if size > self.limit and self.producer is not None:
            self.producer.pauseProducing()


def test_pipelined_flood_is_bounded() -> None:
    factory = make_factory()
    transport = BackpressureTransport()
    proto = factory.buildProtocol(None)
    proto.makeConnection(transport)
    assert transport.producer is proto and transport.streaming
    n = 10_000
    proto.dataReceived(b"".join(raw_command(b"bottlenet.Ping", b"%x" % i) for i in range(n)))
    assert transport.producerState == "paused"  # reading stopped
    assert transport.max_buffered < transport.limit + 1024
    answered = 0
    parser = BoxParser()
    rounds = 0
    while answered < n:
        rounds += 1
        parser.feed(transport.value())
        transport.clear()
        while parser.next_box() is not None:
            answered += 1
        proto.resumeProducing()  # the buffer drained
    assert answered == n
    assert rounds > 20
    assert transport.max_buffered < transport.limit + 1024
    assert transport.producerState == "producing"
    transport.sock.close()


def test_in_flight_cap_pauses_reading() -> None:
    from twisted.internet.defer import Deferred

    backend = FakeBackend()
    gate: Deferred[None] = Deferred()

    async def slow_destroy(name: str) -> None:
        backend.calls.append(("destroy_bottle", (name,)))
        await gate

    backend.destroy_bottle = slow_destroy  # type: ignore[method-assign]
    c = Conn(make_factory(backend))
    c.send(
        b"".join(raw_command(b"bottlenet.DestroyBottle", b"%d" % i, name=b"b") for i in range(40))
    )
    assert len(backend.calls) == MAX_IN_FLIGHT
    assert c.transport.producerState == "paused"
    gate.callback(None)
    assert len(backend.calls) == 40
    assert len(c.boxes()) == 40
    assert c.transport.producerState == "producing"
    c.close()


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.binary(max_size=300), max_size=20))
def test_arbitrary_bytes_never_raise_or_reach_backend(chunks: list[bytes]) -> None:
    backend = FakeBackend()
    c = Conn(make_factory(backend))
    try:
        for chunk in chunks:
            c.proto.dataReceived(chunk)
        assert backend.calls == []
    finally:
        c.close()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.dictionaries(
            st.binary(min_size=1, max_size=20), st.binary(max_size=200), min_size=1, max_size=5
        ),
        min_size=1,
        max_size=5,
    ),
    st.data(),
)
def test_parser_chunking_invariance(boxes: list[dict[bytes, bytes]], data: st.DataObject) -> None:
    wire = b"".join(amp.AmpBox(b).serialize() for b in boxes)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=10)))
    parser = BoxParser()
    out = []
    prev = 0
    for cut in [*cuts, len(wire)]:
        parser.feed(wire[prev:cut])
        prev = cut
        while (box := parser.next_box()) is not None:
            out.append(dict(box))
    assert out == boxes


def test_tls_mode_stops_parsing_but_not_reading_and_caps_input() -> None:
    from bottlenet.control.protocol import MAX_UNPARSED
    from bottlenet.control.server import PeerIdentity

    factory = make_factory(clock=Clock(), tls=True)
    transport = UNIXStringTransport()
    proto = factory.buildProtocol(None)
    proto.makeConnection(transport)
    proto.authenticated_as(PeerIdentity("tls", subject="'t'"))
    proto.pauseProducing()  # the TLS layer is buffering our writes (e.g. mid-handshake)
    assert transport.producerState == "producing"  # reading is never paused under TLS
    proto.dataReceived(raw_command(b"bottlenet.Ping", b"1"))
    assert transport.value() == b""  # parsed later, not now
    proto.resumeProducing()
    assert codec.decode_answer(C.Ping, _one(transport)) == {}
    proto.pauseProducing()
    proto.dataReceived(b"\x00" * (MAX_UNPARSED + 1))
    assert transport.aborted
    transport.sock.close()


def _one(transport: UNIXStringTransport) -> amp.AmpBox:
    p = BoxParser()
    p.feed(transport.value())
    box = p.next_box()
    assert box is not None
    return box


def test_tls_peer_without_certificate_dropped() -> None:
    factory = make_factory(clock=Clock(), tls=True)
    transport = UNIXStringTransport()
    transport.getPeerCertificate = lambda: None  # type: ignore[attr-defined]
    proto = factory.buildProtocol(None)
    proto.makeConnection(transport)
    proto.dataReceived(raw_command(b"bottlenet.Ping", b"1"))  # before the handshake: refused
    assert transport.aborted and transport.value() == b""
    transport.sock.close()
