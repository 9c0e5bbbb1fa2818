"""Refused control peers (wrong uid) are logged at most once per uid per interval."""

from __future__ import annotations

from attrs import evolve
from twisted.internet.task import Clock
from twisted.logger import LogEvent

from bottlenet.control.context import REFUSED_PEER_LOG_INTERVAL
from bottlenet.control.peercred import PeerCred
from bottlenet.control.server import ControlServerFactory

from .fakes import Conn, make_factory


def _refused(logs: list[LogEvent]) -> list[LogEvent]:
    return [e for e in logs if "refused peer" in str(e.get("log_format"))]


def _summaries(logs: list[LogEvent]) -> list[LogEvent]:
    return [e for e in logs if "similar events suppressed" in str(e.get("log_format"))]


def _connect(factory: ControlServerFactory) -> None:
    c = Conn(factory)
    assert c.transport.aborted  # refused whatever the logger decided
    c.close()


def test_flood_from_one_uid_is_one_line_per_interval(logs: list[LogEvent]) -> None:
    clock = Clock()
    factory = make_factory(uid=0, clock=clock)
    for _ in range(500):
        _connect(factory)
    assert [(e["uid"], e["suppressed"]) for e in _refused(logs)] == [(0, 0)]
    clock.advance(REFUSED_PEER_LOG_INTERVAL)
    # The 499 dropped ones are reported once, by the summary timer, not again later.
    (summary,) = _summaries(logs)
    assert summary["suppressed"] == 499
    _connect(factory)
    events = _refused(logs)
    assert [(e["uid"], e["suppressed"]) for e in events] == [(0, 0), (0, 0)]


def test_uids_are_limited_separately(logs: list[LogEvent]) -> None:
    uids = iter([0, 2000, 0, 2000, 3000])
    factory = make_factory(clock=Clock())
    factory.admission = evolve(
        factory.admission, peer_credentials=lambda sock: PeerCred(uid=next(uids), pid=7)
    )
    for _ in range(5):
        _connect(factory)
    assert [e["uid"] for e in _refused(logs)] == [0, 2000, 3000]


def test_periodic_flush_reports_a_quiet_uid(logs: list[LogEvent]) -> None:
    clock = Clock()
    factory = make_factory(uid=0, clock=clock)
    factory.doStart()
    try:
        for _ in range(10):
            _connect(factory)
        assert len(_refused(logs)) == 1 and _summaries(logs) == []
        clock.advance(REFUSED_PEER_LOG_INTERVAL)
        (summary,) = _summaries(logs)
        assert summary["suppressed"] == 9
        assert summary["ratelimit_key"] == "refused-peer/0"
    finally:
        factory.doStop()
    assert clock.getDelayedCalls() == []


def test_stop_reports_what_is_pending_without_a_clock(logs: list[LogEvent]) -> None:
    factory = make_factory(uid=0)
    factory.doStart()
    for _ in range(3):
        _connect(factory)
    factory.doStop()
    assert len(_refused(logs)) == 1
    # Without a reactor the interval has not passed yet, so nothing is summed up early,
    # but nothing raises either; the counts stay with the limiter for the next refusal.
    assert factory.context.refused_log.limiter.allow(("refused-peer", 0)) is None


def test_connections_themselves_add_no_lines() -> None:
    """Issue 13 item 5: stock AMP logged "connection established/lost" for every peer, even a
    refused one (500 refused connections gave 1001 lines); now only the rate-limited refusal."""
    from twisted.logger import capturedLogs

    factory = make_factory(uid=0, clock=Clock())
    with capturedLogs() as events:
        for _ in range(500):
            _connect(factory)
        allowed = Conn(make_factory())  # an allowed peer: no per-connection line either
        allowed.close()
    assert [e["log_format"] for e in events if "refused peer" not in e["log_format"]] == []
    assert len(events) == 1


def test_no_timer_while_nothing_was_dropped(logs: list[LogEvent]) -> None:
    # The daemon must not wake up periodically when idle: the summary timer exists only
    # while refusals are waiting to be reported, and is gone once they are.
    clock = Clock()
    factory = make_factory(uid=0, clock=clock)
    factory.doStart()
    try:
        assert clock.getDelayedCalls() == []
        _connect(factory)  # logged at once: nothing dropped, still no timer
        assert clock.getDelayedCalls() == []
        _connect(factory)  # dropped: one timer to report it
        assert len(clock.getDelayedCalls()) == 1
        clock.advance(REFUSED_PEER_LOG_INTERVAL)
        assert [e["suppressed"] for e in _summaries(logs)] == [1]
        assert clock.getDelayedCalls() == []
    finally:
        factory.doStop()
