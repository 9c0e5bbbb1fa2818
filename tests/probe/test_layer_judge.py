"""The transparent egress layer's check: canaries, the host's witness, and the judge's
"redirected and refused" outcome (``judge_layer``)."""

from __future__ import annotations

import pytest

from bottlenet.probe.judge import Redirect, judge_layer, redirect_outcome
from bottlenet.probe.plan import LayerPlan

NONCE = "0123456789abcdef0123456789abcdef"
PLAN = LayerPlan(nonce=NONCE, outside="198.51.100.7:443")


def transcript(results: dict[str, str], udp: str = "blocked", icmp: str = "blocked",
               end: str = "pass") -> bytes:  # fmt: skip
    lines = [f"BNP {NONCE} begin 1", f"BNP {NONCE} iface lo"]
    lines += [f"BNP {NONCE} control {c} ok" for c in ("tcp", "unix", "icmp")]
    lines += [f"BNP {NONCE} redirect {c} {r}" for c, r in results.items()]
    lines += [
        f"BNP {NONCE} deny udp:198.51.100.7:443 {udp}",
        f"BNP {NONCE} icmp 198.51.100.7 {icmp}",
    ]
    lines.append(f"BNP {NONCE} end {end}")
    return "\n".join(lines).encode()


def all_connected() -> dict[str, str]:
    return dict.fromkeys(PLAN.canaries(), "connected")


def test_canaries_come_from_the_nonce_in_reserved_ranges() -> None:
    """A v4 literal in 192.0.2.0/24, a v6 literal in 2001:db8::/32 and a name under .invalid."""
    v4, v6, name = PLAN.canaries()
    assert v4.startswith("tcp:192.0.2.") and v6.startswith("tcp:[2001:db8::")
    assert name == f"name:{NONCE[:16]}.gate.bottlenet.invalid:443"
    assert PLAN.connect_target(name) == f"{NONCE[:16]}.gate.bottlenet.invalid:443"
    assert LayerPlan(nonce="f" * 32).canaries() != PLAN.canaries()


def test_every_canary_redirected_and_refused_passes() -> None:
    """Each connected in the guest and witnessed as CONNECT on the host: PASS, with the
    outcome named per canary."""
    seen = [PLAN.connect_target(c) for c in PLAN.canaries()]
    v = judge_layer(PLAN, transcript(all_connected()), exit_code=0, connects=seen)
    assert v.passed, v.problems
    assert all(n.endswith(": redirected and refused") for n in v.notes) and len(v.notes) == 3


def test_a_canary_the_host_never_saw_is_a_leak() -> None:
    """Connected in the guest but no CONNECT at the proxy: it went elsewhere."""
    v4, v6, name = PLAN.canaries()
    seen = [PLAN.connect_target(v6), PLAN.connect_target(name)]
    v = judge_layer(PLAN, transcript(all_connected()), exit_code=0, connects=seen)
    assert not v.passed
    target = PLAN.connect_target(v4)
    assert f"leak: canary {target} connected, never seen at the proxy (no CONNECT {target})" in (
        v.problems
    )


@pytest.mark.parametrize(
    ("udp", "icmp", "problem"),
    [
        ("reachable", "blocked",
         "leak: udp:198.51.100.7:443 (the outside address over UDP) is reachable"),
        ("blocked", "answers", "leak: the outside address answers ICMP echo"),
    ],
)  # fmt: skip
def test_udp_and_icmp_must_still_go_nowhere(udp: str, icmp: str, problem: str) -> None:
    seen = [PLAN.connect_target(c) for c in PLAN.canaries()]
    v = judge_layer(
        PLAN, transcript(all_connected(), udp, icmp, "fail"), exit_code=1, connects=seen
    )
    assert not v.passed and problem in v.problems


def test_a_canary_the_layer_did_not_take_fails() -> None:
    results = all_connected()
    name = PLAN.canaries()[2]
    results[name] = "failed"
    v = judge_layer(PLAN, transcript(results, end="fail"), exit_code=1, connects=[])
    assert (
        f"transparent egress: canary {PLAN.connect_target(name)} not taken by the layer"
        in v.problems
    )


def test_outcomes() -> None:
    assert redirect_outcome("connected", True) is Redirect.REDIRECTED
    assert redirect_outcome("connected", False) is Redirect.LEAKED
    assert redirect_outcome("failed", True) is Redirect.NOT_TAKEN
    assert redirect_outcome(None, True) is None


def test_a_missing_or_foreign_line_fails() -> None:
    """A canary without a result, or a line of another nonce: FAIL."""
    results = all_connected()
    results.pop(PLAN.canaries()[0])
    v = judge_layer(PLAN, transcript(results), exit_code=0, connects=[])
    assert any(p.startswith("check missing: redirect tcp:192.0.2.") for p in v.problems)
    bad = transcript(all_connected()) + b"\nBNP ffff redirect x connected"
    assert not judge_layer(PLAN, bad, exit_code=0, connects=[]).passed
