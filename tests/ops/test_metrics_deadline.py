"""Security-2 T7: a metrics request must arrive within a total deadline from its first byte."""

from __future__ import annotations

from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs

from bottlenet.ops import metrics


def _connection(clock: Clock) -> tuple[metrics.CappedFactory, StringTransport, Any]:
    site = metrics.metrics_site(metrics.SnapshotSource(list), clock)
    capped = metrics.CappedFactory(site, 16, clock)
    proto = capped.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    assert proto is not None
    transport = StringTransport()
    proto.makeConnection(transport)
    return capped, transport, proto


def test_slow_header_bytes_cannot_hold_a_metrics_slot() -> None:
    """T7: one header byte every 5 s used to reset the idle timer and hold the slot forever."""
    clock = Clock()
    capped, transport, proto = _connection(clock)
    with capturedLogs() as events:
        for byte in b"GET":
            assert not transport.disconnecting
            proto.dataReceived(bytes([byte]))
            clock.advance(4)  # well inside the 15 s idle timeout each time
    assert transport.disconnecting and capped.slow == 1  # at 10 s from the first byte
    assert [e["log_format"] for e in events if "took over" in e.get("log_format", "")]


def test_prompt_requests_keep_their_connection() -> None:
    """A scraper that sends its request at once is answered, and may send another later."""
    clock = Clock()
    _capped, transport, proto = _connection(clock)
    for _ in range(3):
        proto.dataReceived(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert transport.value().startswith(b"HTTP/1.1 200")
        transport.clear()
        clock.advance(metrics.METRICS_REQUEST_DEADLINE + 1)
        assert not transport.disconnecting
