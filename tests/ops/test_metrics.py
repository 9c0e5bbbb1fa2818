"""Metrics: endpoint validation, the exposition format (parsed by prometheus_client), recorders."""

from __future__ import annotations

import math

import pytest
from attrs import frozen
from prometheus_client.parser import text_string_to_metric_families

from bottlenet.bottles.model import Bottle
from bottlenet.errors import InvalidArgument
from bottlenet.forward.spec import AliasPool
from bottlenet.forward.table import ForwardCounters
from bottlenet.ops import metrics
from tests.control.fakes import counters as make_counters


# Stand-ins with the shapes the forward table and the bottle registry expose:
# ForwardInfo(spec=ForwardSpec(bottle, label, ...), bound, counters=ForwardCounters(...)).
@frozen
class Spec:
    bottle: str
    label: str


@frozen
class Info:
    spec: Spec
    bound: object
    counters: ForwardCounters


def _fwd(bottle: str, label: str, **counters: int) -> Info:
    return Info(Spec(bottle, label), None, make_counters(**counters))


# -- endpoint validation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tcp:9464:interface=127.0.0.1", metrics.MetricsEndpoint("tcp", 9464, "127.0.0.1")),
        ("tcp:port=0:interface=127.0.0.2", metrics.MetricsEndpoint("tcp", 0, "127.0.0.2")),
        ("tcp:interface=127.0.0.1:port=80", metrics.MetricsEndpoint("tcp", 80, "127.0.0.1")),
        ("tcp6:9464:interface=\\:\\:1", metrics.MetricsEndpoint("tcp6", 9464, "::1")),
        ("unix:/run/bn/metrics.sock", metrics.MetricsEndpoint("unix", path="/run/bn/metrics.sock")),
        (
            "unix:path=/run/bn/m.sock:mode=0660",
            metrics.MetricsEndpoint("unix", path="/run/bn/m.sock", mode=0o660),
        ),
    ],
)
def test_accepted_endpoints(text: str, expected: metrics.MetricsEndpoint) -> None:
    assert metrics.parse_metrics_endpoint(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("tcp:9464", "every address"),
        ("tcp:9464:interface=", "every address"),
        ("tcp6:9464", "every address"),
        ("tcp:9464:interface=0.0.0.0", "not a loopback"),
        ("tcp:9464:interface=10.1.2.3", "not a loopback"),
        ("tcp:9464:interface=127.1", "canonical"),
        ("tcp:9464:interface=0x7f.0.0.1", "canonical"),
        ("tcp:9464:interface=localhost", "canonical"),
        ("tcp:9464:interface= 127.0.0.1", "canonical"),
        ("tcp6:9464:interface=\\:\\:", "::1"),
        ("tcp6:9464:interface=\\:\\:ffff\\:127.0.0.1", "::1"),
        ("tcp:99999:interface=127.0.0.1", "port"),
        ("tcp:-1:interface=127.0.0.1", "port"),
        ("tcp:9464:interface=127.0.0.1:backlog=5", "unknown argument"),
        ("tcp:9464:interface=127.0.0.1:interface=127.0.0.2", "twice"),
        ("ssl:9464:interface=127.0.0.1", "use tcp"),
        ("systemd:domain=INET:index=0", "use tcp"),
        ("unix:relative.sock", "absolute"),
        ("unix:/tmp/m.sock:mode=0666", "every local user"),
        ("unix:/tmp/m.sock:mode=rw", "octal"),
        ("unix:/" + "x" * 200, "longer"),
        ("", "non-empty"),
    ],
)
def test_refused_endpoints(text: str, reason: str) -> None:
    with pytest.raises(InvalidArgument, match=reason):
        metrics.parse_metrics_endpoint(text)


def test_refuses_an_address_in_the_alias_pool() -> None:
    pool = AliasPool.parse("127.77.0.0/16")
    with pytest.raises(InvalidArgument, match="alias pool"):
        metrics.parse_metrics_endpoint("tcp:9464:interface=127.77.0.9", pool)
    assert metrics.parse_metrics_endpoint("tcp:9464:interface=127.0.0.1", pool).port == 9464


def test_refusal_message_does_not_echo_hostile_text() -> None:
    with pytest.raises(InvalidArgument) as e:
        metrics.parse_metrics_endpoint("tcp:9464:interface=\x1b[2J\n")
    assert "\x1b" not in e.value.message and "\n" not in e.value.message


# -- exposition format --------------------------------------------------------------------


def _families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_forward_and_bottle_metrics_parse() -> None:
    source = metrics.SnapshotSource(
        lambda: [
            _fwd(
                "demo", "git", accepted=5, active=2, refused=1, failed=1, bytes_in=10, bytes_out=20
            ),
            _fwd("demo", "egress", accepted=1, bytes_out=7),
            _fwd("other-1", "git"),
        ],
        lambda: [
            Bottle("demo", None, 1.0, state="ready"),
            Bottle("other-1", None, 1.0, state="ready"),
            Bottle("x", None, 1.0, state="starting"),
        ],
    )
    text = metrics.render_metrics(source)
    assert text.endswith("\n")
    families = _families(text)
    assert families["bottlenet_relays_accepted"].type == "counter"  # type: ignore[attr-defined]
    assert families["bottlenet_relays_active"].type == "gauge"  # type: ignore[attr-defined]
    s = _samples(text)
    git = (("bottle", "demo"), ("forward", "git"))
    assert s[("bottlenet_relays_accepted_total", git)] == 5
    assert s[("bottlenet_relays_active", git)] == 2
    assert s[("bottlenet_relays_refused_total", git)] == 1
    assert s[("bottlenet_relays_failed_total", git)] == 1
    assert s[("bottlenet_relay_bytes_total", (*git[:1], ("direction", "in"), git[1]))] == 10
    assert s[("bottlenet_relay_bytes_total", (*git[:1], ("direction", "out"), git[1]))] == 20
    assert s[("bottlenet_bottles", (("state", "ready"),))] == 2
    assert s[("bottlenet_bottles", (("state", "starting"),))] == 1
    assert s[("bottlenet_metrics_invalid_series", ())] == 0
    assert s[("bottlenet_build_info", (("version", metrics.__version__),))] == 1


def test_invalid_labels_are_dropped_and_counted() -> None:
    hostile = 'x"} 1\nbottlenet_relays_active{bottle="forged'
    source = metrics.SnapshotSource(
        lambda: [_fwd(hostile, "git", active=9), _fwd("demo", "GIT", active=9), _fwd("ok", "a")],
        lambda: [Bottle("b", None, 1.0, state="Bad State\n")],
    )
    text = metrics.render_metrics(source)
    assert "forged" not in text and "GIT" not in text
    s = _samples(text)
    assert s[("bottlenet_metrics_invalid_series", ())] == 2
    assert [k for k in s if k[0] == "bottlenet_relays_active"] == [
        ("bottlenet_relays_active", (("bottle", "ok"), ("forward", "a")))
    ]
    assert s[("bottlenet_bottles", (("state", "other"),))] == 1


def test_duplicate_forwards_are_summed_not_repeated() -> None:
    source = metrics.SnapshotSource(
        lambda: [_fwd("a", "b", accepted=1), _fwd("a", "b", accepted=2)]
    )
    text = metrics.render_metrics(source)
    assert text.count('bottlenet_relays_accepted_total{bottle="a",forward="b"}') == 1
    assert (
        _samples(text)[("bottlenet_relays_accepted_total", (("bottle", "a"), ("forward", "b")))]
        == 3
    )


def test_label_escaping_round_trips() -> None:
    value = 'a\\b"c\nd'
    line = f"m{metrics._labels([('l', value)])} 1\n"
    [family] = text_string_to_metric_families(line)
    assert family.samples[0].labels == {"l": value}


def test_smolvm_histogram_and_control_counter() -> None:
    calls = metrics.CallStats()
    calls.record("create", "ok", 0.3)
    calls.record("create", "ok", 7.0)
    calls.record("create", "timeout", 400.0)
    calls.record("machine start; rm -rf", "ok", float("nan"))
    commands = metrics.CommandStats(results=frozenset({"OK", "NOT_FOUND"}))
    commands.record("CreateBottle", "OK")
    commands.record("CreateBottle", "OK")
    commands.record("DestroyBottle", "NOT_FOUND")
    commands.record("DestroyBottle", "SOMETHING_NEW")
    text = metrics.render_metrics(metrics.SnapshotSource(list), calls, commands)
    families = _families(text)
    assert families["bottlenet_smolvm_call_duration_seconds"].type == "histogram"  # type: ignore[attr-defined]
    s = _samples(text)
    name = "bottlenet_smolvm_call_duration_seconds"
    ok = (("result", "ok"), ("subcommand", "create"))
    assert s[(f"{name}_count", ok)] == 2
    assert math.isclose(s[(f"{name}_sum", ok)], 7.3)
    assert s[(f"{name}_bucket", (("le", "0.5"), *ok))] == 1
    assert s[(f"{name}_bucket", (("le", "10.0"), *ok))] == 2
    assert s[(f"{name}_bucket", (("le", "+Inf"), *ok))] == 2
    timeout = (("result", "timeout"), ("subcommand", "create"))
    assert s[(f"{name}_bucket", (("le", "300.0"), *timeout))] == 0
    assert s[(f"{name}_bucket", (("le", "+Inf"), *timeout))] == 1
    other = (("result", "ok"), ("subcommand", "other"))
    assert s[(f"{name}_count", other)] == 1 and s[(f"{name}_sum", other)] == 0
    cmd = "bottlenet_control_commands_total"
    assert s[(cmd, (("command", "CreateBottle"), ("result", "OK")))] == 2
    assert s[(cmd, (("command", "DestroyBottle"), ("result", "NOT_FOUND")))] == 1
    assert s[(cmd, (("command", "DestroyBottle"), ("result", "other")))] == 1


def test_recorders_bound_their_series() -> None:
    stats = metrics.CommandStats()
    for i in range(metrics.MAX_SERIES + 50):
        stats.record(f"c{i}", "OK")
    snap = stats.snapshot()
    assert len(snap) == metrics.MAX_SERIES + 1
    assert snap[("other", "other")] == 50


def test_vm_uids_left_is_a_gauge_only_when_counted() -> None:
    """N8: ``bottlenet_vm_uids_left`` appears once per-VM uids are counted (as root)."""
    assert "bottlenet_vm_uids_left" not in metrics.render_metrics(metrics.SnapshotSource(list))
    text = metrics.render_metrics(metrics.SnapshotSource(list, count_vm_uids=lambda: 4095))
    assert _families(text)["bottlenet_vm_uids_left"].type == "gauge"  # type: ignore[attr-defined]
    assert _samples(text)[("bottlenet_vm_uids_left", ())] == 4095
