"""The daemon's side of the transparent egress layer: what it makes of the guest's lines
(counted only when valid, targets bounded) and why a layer that never came up did not."""

from __future__ import annotations

from bottlenet.bottles import egresslayer
from bottlenet.bottles.egresslayer import LayerCounters, LayerSession, Outcome
from bottlenet.ops.metrics import SnapshotSource, render_metrics


def session() -> LayerSession:
    s = LayerSession(b"", LayerCounters())
    s.ready.callback(None)
    return s


def test_only_valid_report_lines_are_counted() -> None:
    """Targets of a host name, an IPv4 or a bracketed IPv6 literal, and known outcomes;
    anything else (a payload-looking line, an unknown outcome, an upper-case name) is not."""
    s = session()
    s._reports(
        b"BNE conn example.com:443 ok\nBNE conn [2001:db8::1]:443 refused\n"
        b"BNE conn 203.0.113.7:443 unreachable\nBNE conn - loop\n"
        b"BNE conn Example.COM:443 ok\nBNE conn x:1 exploded\nGET / HTTP/1.1\n"
        b"BNE conn half"
    )
    c = s.counters
    assert c.outcomes[Outcome.OK] == 1 and c.outcomes[Outcome.REFUSED] == 1
    assert c.outcomes[Outcome.UNREACHABLE] == 1 and c.outcomes[Outcome.LOOP] == 1
    assert c.total == 4
    assert c.targets == {
        "example.com:443": [1, 0, 0],
        "[2001:db8::1]:443": [0, 1, 0],
        "203.0.113.7:443": [0, 0, 1],
    }
    s._reports(b":80 ok\n")  # the rest of the cut line: "BNE conn half:80 ok"
    assert c.targets["half:80"] == [1, 0, 0]


def test_targets_are_bounded() -> None:
    """Past MAX_TARGETS distinct targets, the rest are counted as ``other``."""
    c = LayerCounters()
    for i in range(egresslayer.MAX_TARGETS + 10):
        c.count(f"h{i}.test:443", Outcome.REFUSED)
    c.count("h0.test:443", Outcome.OK)  # a known one is still its own
    assert len(c.targets) == egresslayer.MAX_TARGETS + 1
    assert c.targets["other"] == [0, 10, 0] and c.targets["h0.test:443"] == [1, 1, 0]
    rows = c.rows("b1")
    assert rows[0].bottle == "b1" and len(rows) == egresslayer.MAX_TARGETS + 1
    c.reset()
    assert c.total == 0 and c.targets == {}


def test_why_a_layer_did_not_come_up_names_the_piece() -> None:
    """``BNE missing KEY`` with exit 5: the kernel option; an unknown key is not repeated."""
    s = LayerSession(b"", LayerCounters())
    s._out = bytearray(b"BNE missing redir\n")
    assert "lacks the redir expression (CONFIG_NFT_REDIR)" in s.why_not_ready(5)
    s._out = bytearray(b"BNE missing bogus-thing\n")
    assert s.why_not_ready(5) == "it ended before it was ready (exit 5)"
    s._out = bytearray(b"BNE failed bind EADDRINUSE\n")
    assert s.why_not_ready(6) == "its bind step failed (EADDRINUSE)"
    s._out = bytearray(b"BNE notool\n")
    assert "no python3" in s.why_not_ready(4)


def test_metrics_count_transparent_connects_by_outcome() -> None:
    source = SnapshotSource(list, tuple, lambda: [("b1", "ok", 3), ("b1", "refused", 1)])
    text = render_metrics(source)
    assert 'bottlenet_transparent_connects_total{bottle="b1",outcome="ok"} 3' in text
    assert 'bottlenet_transparent_connects_total{bottle="b1",outcome="refused"} 1' in text
