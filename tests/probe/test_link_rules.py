"""The gate judges what a guest's network link can carry, not its name (issue 36 follow-up).

libkrunfw's kernel has the ``dummy`` driver built in: every real smolvm guest shows ``dummy0``
(``<BROADCAST,NOARP>``, down, no address), and libkrun's init, with its transparent socket
impersonation on, brings it up with 203.0.113.1/24. In socket mode the judge allows a link
other than ``lo`` only when the guest's rtnetlink report proves it carries nothing: of kind
``dummy``, down, no address, no route through it. These pin each rule on transcripts; the
reader itself runs below in network namespaces and on libkrunfw's kernel in the real-VM tier.
"""

from __future__ import annotations

import pytest

from bottlenet.probe.judge import ALLOWED_LINKS, IFF_LOOPBACK, IFF_UP, judge
from bottlenet.probe.script import render
from bottlenet.transparent import links
from tests.probe.test_probe import OWN, needs_netns, plan, run_in_netns, transcript

LO = ("link lo - 10049", "addr lo 127.0.0.1/8", "route lo local 127.0.0.1/32")
#: dummy0 as libkrunfw's kernel makes it (``<BROADCAST,NOARP>``, down).
INERT = ("link dummy0 dummy 82",)


def problems(
    links: tuple[str, ...], ifaces: tuple[str, ...] = ("lo", "dummy0"), **kw: str
) -> tuple[str, ...]:
    p = plan(**kw)
    v = judge(p, transcript(p, ifaces=ifaces, links=links), exit_code=0, witnessed=[OWN])
    return v.problems


def test_a_down_dummy_link_with_nothing_on_it_passes() -> None:
    """The real guest's dummy0: kind dummy, down, no address, no route."""
    assert problems(LO + INERT) == ()


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        # up, with an address and the routes the kernel makes for it: libkrun's TSI init
        (
            ("link dummy0 dummy c3", "addr dummy0 203.0.113.1/24",
             "route dummy0 unicast 203.0.113.0/24", "route dummy0 local 203.0.113.1/32",
             "route dummy0 broadcast 203.0.113.255/32"),
            "dummy; up; address 203.0.113.1/24; routes unicast 203.0.113.0/24, local"
            " 203.0.113.1/32 and 1 more",
        ),
        (("link dummy0 dummy 83",), "dummy; up"),
        (("link dummy0 dummy 82", "addr dummy0 fe80::1/64"), "dummy; address fe80::1/64"),
        (("link dummy0 dummy 82", "route dummy0 unicast 10.0.0.0/8"),
         "dummy; routes unicast 10.0.0.0/8"),
        # not a dummy: its name proves nothing
        (("link dummy0 veth 1002",), "kind veth"),
        (("link dummy0 - 1002",), "a device, not a dummy link"),
        # no report at all
        ((), "what it carries was not reported"),
        (("links unreadable",), "what it carries was not reported (the guest could not read"
         " rtnetlink)"),
    ],
)  # fmt: skip
def test_a_link_that_could_carry_anything_fails_naming_it_and_why(
    extra: tuple[str, ...], why: str
) -> None:
    """Each way a link could carry something is named, with the link."""
    assert problems(LO + extra) == (
        f"network interface dummy0 in a socket-mode guest ({why}): {ALLOWED_LINKS}",
    )


def test_a_link_only_rtnetlink_reports_is_judged_too() -> None:
    """A link missing from /proc/net/dev but in the rtnetlink report is not overlooked."""
    assert problems((*LO, "link veth9 veth 1043"), ifaces=("lo",)) == (
        f"network interface veth9 in a socket-mode guest (kind veth; up): {ALLOWED_LINKS}",
    )


def test_lo_must_be_the_loopback_device() -> None:
    """A link named lo that is not the loopback device is refused."""
    assert problems(("link lo dummy 82",), ifaces=("lo",)) == (
        f"network interface lo in a socket-mode guest (not the loopback device): {ALLOWED_LINKS}",
    )


def test_alias_mode_allows_any_link() -> None:
    """Alias mode's guest has its NIC: the link rules are socket mode's."""
    assert problems((*LO, "link eth0 - 1043"), ifaces=("lo", "eth0"), mode="alias") == ()


@pytest.mark.parametrize(
    "line",
    [
        "link dummy0 Dummy\x1b[2J 82",  # a kind of no known form
        "link dummy0 dummy zz",  # flags not hex
        "addr dummy0 999.1.1.1/24",  # not an address
        "route dummy0 teleport 10.0.0.0/8",  # not a route type
        "addr eth7 10.0.0.1/8",  # a link never reported
        "route dummy0 unicast",  # words missing
    ],
)
def test_a_malformed_link_line_is_counted_never_echoed(line: str) -> None:
    """What the guest says of its links is validated; a bad line fails the run unquoted."""
    got = problems(LO + INERT[:1] + (line,) if not line.startswith("link") else (*LO, line))
    assert "1 transcript line(s) not bound to this run or of no known form" in got
    assert not any("\x1b" in x or "teleport" in x or "999" in x for x in got)


def test_a_link_reported_twice_is_a_duplicate() -> None:
    """One report per link: a second one for the same name is not taken."""
    assert problems(LO + INERT + INERT) == ("1 check(s) reported more than once",)


# -- the real reader and the real probe, in a network namespace of their own --------------


@needs_netns
def test_the_probe_reports_each_link_and_the_judge_names_a_veth() -> None:
    """The gate's script on the host's python3 (the no-kit path: the reader travels inside
    the script) in a namespace with a veth pair, one end up with an address: both ends are
    named, with what they carry; the namespace's lo passes."""
    p = plan(own=(), witness=False)
    setup = (
        "ip link add v0 type veth peer name v1",
        "ip addr add 10.9.0.1/24 dev v0",
        "ip link set v0 up",
    )
    code, out = run_in_netns(render(p), *setup)
    assert b" link lo - " in out and b" addr v0 10.9.0.1/24\n" in out, out
    v = judge(p, out, exit_code=code, witnessed=None)
    named = {x.split()[2]: x for x in v.problems if x.startswith("network interface")}
    assert sorted(named) == ["v0", "v1"], v.problems
    assert named["v0"].startswith(
        "network interface v0 in a socket-mode guest (kind veth; up; address 10.9.0.1/24"
    ), named
    assert (
        named["v1"] == f"network interface v1 in a socket-mode guest (kind veth): {ALLOWED_LINKS}"
    )


def test_the_reader_sees_kind_flags_addresses_and_routes() -> None:
    """``links.read`` over rtnetlink in this (the suite's) namespace: lo is the loopback
    device with 127.0.0.1/8 and its local route."""
    by_name = {link.name: link for link in links.read()}
    lo = by_name["lo"]
    assert lo.kind == "" and lo.flags & IFF_LOOPBACK and lo.flags & IFF_UP
    assert "127.0.0.1/8" in lo.addresses and "local 127.0.0.1/32" in lo.routes
