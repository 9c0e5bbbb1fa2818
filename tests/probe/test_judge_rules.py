"""Judge and witness rules no test pinned before (mutants J04, J05, J10, J14, W01 of tests-2.md).

Every own endpoint needs its own witness, an empty interface list is a failure, guest-chosen
names never reach a verdict's text unvalidated, and a witness line over the cap is cut at once.
"""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from bottlenet.errors import InvalidArgument
from bottlenet.probe.judge import judge
from bottlenet.probe.witness import MAX_LINE, Witness, WitnessFactory
from tests.probe.test_probe import NONCE, OWN, plan, transcript

SECOND = "unix:/run/bottle/git.sock"


def test_each_own_endpoint_needs_its_own_witness() -> None:
    """J14: two own endpoints, one witnessed: the other is named as not witnessed."""
    p = plan(own=(OWN, SECOND))
    v = judge(p, transcript(p), exit_code=0, witnessed=[OWN])
    assert not v.passed
    assert v.problems == (
        f"own endpoint {SECOND} was not witnessed on the host "
        "(no connection carrying this run's nonce)",
    )
    assert judge(p, transcript(p), exit_code=0, witnessed=[OWN, SECOND]).passed


def test_a_transcript_with_no_interface_lines_fails() -> None:
    """J10: an empty interface listing could hide a NIC; it is a problem of its own."""
    p = plan()
    t = transcript(p, ifaces=())
    v = judge(p, t, exit_code=0, witnessed=[OWN])
    assert v.problems == ("the guest listed no network interfaces",)


def test_an_interface_name_with_control_bytes_never_reaches_the_verdict() -> None:
    """J04: ``e<ESC>[2J`` is counted as an invalid name, not quoted in a problem."""
    p = plan()
    v = judge(p, transcript(p, ifaces=("lo", "e\x1b[2J")), exit_code=0, witnessed=[OWN])
    assert v.problems == ("1 network interface(s) with an invalid name",)


def test_a_gateway_scope_id_with_control_bytes_never_reaches_the_verdict() -> None:
    """J05: ``fe80::1%<ESC>...`` is not a gateway: an unexpected line, never echoed."""
    p = plan(mode="alias")
    v = judge(
        p,
        transcript(p, ifaces=("lo", "eth0"), paths=("gw fe80::1%e\x1b[2J",)),
        exit_code=0,
        witnessed=[OWN],
    )
    assert not v.passed
    assert not any("\x1b" in x for x in v.problems)
    assert "1 transcript line(s) not bound to this run or of no known form" in v.problems


def test_an_overlong_witness_line_is_cut_at_once() -> None:
    """W01: MAX_LINE + 1 bytes without a newline end the connection before any timeout."""
    clock, w = Clock(), Witness(NONCE)
    proto = WitnessFactory(clock, w, OWN, timeout=5).buildProtocol(None)
    tr = StringTransport()
    proto.makeConnection(tr)
    proto.dataReceived(b"x" * MAX_LINE)
    assert not tr.disconnecting  # at the cap: still reading
    proto.dataReceived(b"x")
    assert tr.disconnecting and w.mismatched == 1 and clock.getDelayedCalls() == []


def test_loopback6_vsock_and_udp_checks_are_required() -> None:
    """A transcript without the [::1], vsock or UDP lines is missing checks."""
    p = plan(udp_ports=(123,))
    for gone in ("deny tcp:[::1]:18080 ", "deny vsock:2:18080 ", "deny udp:[::1]:123 "):
        lines = transcript(p).split(b"\n")
        t = b"\n".join(ln for ln in lines if gone.encode() not in ln)
        v = judge(p, t, exit_code=0, witnessed=[OWN])
        assert v.problems == (f"check missing: {gone.strip()}",)


def test_an_icmpv6_target_needs_its_control() -> None:
    """An IPv6 gateway's "blocked" counts only when the icmp6 control said ok."""
    p = plan(mode="alias")
    t = transcript(p, ifaces=("lo", "eth0"), paths=("gw fe80::2%eth0",))
    assert judge(p, t, exit_code=0, witnessed=[OWN]).passed
    no_control = t.replace(f"BNP {NONCE} control icmp6 ok\n".encode(), b"")
    v = judge(p, no_control, exit_code=0, witnessed=[OWN])
    assert v.problems == ("probe tool cannot detect ICMPv6 (control icmp6 failed or missing)",)


def test_a_check_reported_twice_is_a_problem() -> None:
    """J03/J07: exactly one result per check; a repeated line is counted, not overwritten."""
    p = plan()
    t = transcript(p).replace(
        f"BNP {NONCE} end pass\n".encode(),
        f"BNP {NONCE} deny tcp:198.18.0.1:9 blocked\nBNP {NONCE} end pass\n".encode(),
    )
    v = judge(p, t, exit_code=0, witnessed=[OWN])
    assert v.problems == ("1 check(s) reported more than once",)


def test_a_missing_control_line_is_a_failed_control() -> None:
    """J08: no ``control icmp`` line is not an ok control."""
    p = plan()
    t = transcript(p).replace(f"BNP {NONCE} control icmp ok\n".encode(), b"")
    v = judge(p, t, exit_code=0, witnessed=[OWN])
    assert v.problems == ("probe tool cannot detect connections (control icmp failed)",)


def test_an_own_endpoint_the_guest_cannot_reach_fails_even_if_witnessed() -> None:
    """J12: ``own ... fail`` is a problem of its own."""
    p = plan()
    t = transcript(p, override={OWN: "fail"}, end="fail")
    v = judge(p, t, exit_code=1, witnessed=[OWN])
    assert v.problems == (f"own endpoint {OWN} does not connect",)


def test_results_for_checks_that_were_not_planned_fail() -> None:
    """J20: a result the plan did not ask for is not silently accepted."""
    p = plan()
    t = transcript(p).replace(
        f"BNP {NONCE} end pass\n".encode(),
        f"BNP {NONCE} deny tcp:127.0.0.1:1 blocked\nBNP {NONCE} end pass\n".encode(),
    )
    v = judge(p, t, exit_code=0, witnessed=[OWN])
    assert v.problems == ("1 result(s) for checks that were not planned",)


def test_a_failure_the_transcript_does_not_show_fails() -> None:
    """J24: the guest's own ``end fail`` counts even when every line looks clean."""
    p = plan()
    v = judge(p, transcript(p, end="fail"), exit_code=1, witnessed=[OWN])
    assert v.problems == ("the probe reported a failure its transcript does not show",)


def test_a_nonce_with_trailing_text_is_refused() -> None:
    """P01: the nonce is matched whole (it is pasted into the sh script)."""
    with pytest.raises(InvalidArgument):
        plan(nonce=NONCE + ";reboot")
