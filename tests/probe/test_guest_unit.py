"""``guest.py``'s detection as a unit, without a VM: fake guest files, fake network answers.

The guest program is imported as a module with ``PLAN`` set from a real plan. Its reads go
to a fake root (``/proc/net/route``, ``/proc/net/ipv6_route``, ``/etc/resolv.conf``,
``/etc/machine-id`` ...) and its network checks to a table of what answers, so each
detection rule (gateways, nameservers, loopback, ICMP, DNS, identity, volumes) is pinned in
the fast suite, and the real judge reads what the guest printed. The same program runs for
real in ``test_probe.py``'s network namespaces and in the real-VM tier.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import bottlenet.probe.guest as guest
from bottlenet.probe.judge import Verdict, judge
from bottlenet.probe.plan import ProbePlan, host_id_hash
from bottlenet.probe.script import plan_literal
from bottlenet.transparent import links
from tests.probe.test_probe import NONCE, OWN, plan

#: A guest with an IPv4 default route via 10.0.2.2 on eth0 (flags UP|GATEWAY) and a local net.
ROUTE = (
    "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
    "eth0\t00000000\t0202000A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
    "eth0\t0002000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
)
#: An IPv6 default route via fe80::2 on eth0, and a link-local route with no next hop.
ROUTE6 = (
    "00000000000000000000000000000000 00 00000000000000000000000000000000 00 "
    "fe800000000000000000000000000002 00000400 00000001 00000000 00000003 eth0\n"
    "fe800000000000000000000000000000 40 00000000000000000000000000000000 00 "
    "00000000000000000000000000000000 00000100 00000001 00000000 00000001 eth0\n"
)
RESOLV = "# generated\nsearch example\nnameserver 10.0.2.3\nnameserver fd00::3\noptions ndots:1\n"


class FakeGuest:
    """The module under test, with a fake root and a table of which checks answer."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.monkeypatch = monkeypatch
        self.reachable: set[str] = set()  # "tcp:H:P", "udp:H:P", "vsock:C:P", "unix:P"
        self.answers: set[str] = set()  # addresses that answer ICMP echo
        self.resolving: set[str] = set()  # DNS names that resolve
        self.dialled: list[str] = []
        self.pinged: list[str] = []
        real_open = builtins.open

        def fake_open(path: Any, *a: Any, **kw: Any) -> Any:
            if isinstance(path, str) and path.startswith(("/proc/", "/etc/")):
                return real_open(self.root / path.lstrip("/"), *a, **kw)
            return real_open(path, *a, **kw)

        def connect(kind: str, addr: str, send: bytes | None = None, timeout: Any = None) -> bool:
            self.dialled.append(f"{kind}:{addr}")
            return f"{kind}:{addr}" in self.reachable

        def ping(addr: str) -> bool:
            self.pinged.append(addr)
            return addr in self.answers

        monkeypatch.setattr(guest, "open", fake_open, raising=False)
        monkeypatch.setattr(guest, "connect", connect)
        monkeypatch.setattr(guest, "datagram", lambda addr: connect("udp", addr))
        monkeypatch.setattr(guest, "ping", ping)
        monkeypatch.setattr(guest, "resolves", lambda name: name in self.resolving)
        monkeypatch.setattr(guest, "controls", lambda: True)
        #: What rtnetlink reports (the test's own namespace is not the guest's): lo only.
        self.links = [links.Link(1, "lo", "", 0x49)]
        monkeypatch.setattr(links, "read", lambda: self.links)

    def file(self, path: str, text: str) -> None:
        p = self.root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    def run(self, p: ProbePlan, capsys: pytest.CaptureFixture[str]) -> tuple[int, Verdict]:
        """main() under ``p``; the real judge's verdict on what it printed (own witnessed)."""
        self.monkeypatch.setattr(guest, "PLAN", plan_literal(p))
        code = guest.main()
        out = capsys.readouterr().out
        head = f"BNP {p.nonce} begin 1\nBNP {p.nonce} iface lo\nBNP {p.nonce} tool image\n"
        head += "".join(f"BNP {p.nonce} control {c} ok\n" for c in ("tcp", "unix", "icmp"))
        return code, judge(p, (head + out).encode(), exit_code=code, witnessed=[OWN])


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGuest]:
    g = FakeGuest(tmp_path / "root", monkeypatch)
    monkeypatch.setattr(guest, "PLAN", plan_literal(plan()))
    g.reachable.add(OWN)
    yield g


Fake = FakeGuest


# -- paths: what the guest knows of the way to its host ------------------------------------


def test_paths_finds_ipv4_and_ipv6_default_gateways_and_nameservers(fake: Fake) -> None:
    """G02 G03 G04: the default routes of both tables and every nameserver, once each."""
    fake.file("/proc/net/route", ROUTE)
    fake.file("/proc/net/ipv6_route", ROUTE6 + ROUTE6)
    fake.file("/etc/resolv.conf", RESOLV)
    assert guest.paths() == [
        ("gw", "10.0.2.2"),
        ("gw", "fe80::2%eth0"),
        ("ns", "10.0.2.3"),
        ("ns", "fd00::3"),
    ]


def test_routes_that_are_not_a_default_gateway_are_not_paths(fake: Fake) -> None:
    """A default route without the GATEWAY flag, or a v6 default with no next hop, is local."""
    fake.file("/proc/net/route", ROUTE.replace("\t0003\t", "\t0001\t"))
    fake.file("/proc/net/ipv6_route", ROUTE6.replace("fe800000000000000000000000000002", "0" * 32))
    assert guest.paths() == []


def test_a_global_ipv6_gateway_has_no_scope(fake: Fake) -> None:
    """Only a link-local next hop carries ``%dev`` (the judge validates that name)."""
    fake.file("/proc/net/ipv6_route", ROUTE6.replace("fe80", "2001", 1))
    assert guest.paths() == [("gw", "2001::2")]


def test_a_guest_without_proc_or_resolv_reports_no_paths(fake: Fake) -> None:
    """Unreadable files are no paths (the judge still requires loopback and outside)."""
    assert guest.paths() == []


# -- main: every path is probed and every answer reported -----------------------------------


def test_an_isolated_guest_passes_and_probes_loopback_and_every_path(
    fake: Fake, capsys: pytest.CaptureFixture[str]
) -> None:
    """G05: host ports are dialled via 127.0.0.1 and via each gateway and nameserver."""
    fake.file("/proc/net/route", ROUTE)
    fake.file("/etc/resolv.conf", RESOLV)
    p = plan(mode="alias")
    code, v = fake.run(p, capsys)
    assert (code, v.problems) == (0, ())
    for host in ("127.0.0.1", "10.0.2.2", "10.0.2.3", "[fd00::3]"):
        assert f"tcp:{host}:18080" in fake.dialled
    assert fake.pinged == ["10.0.2.2", "198.18.0.1"]


@pytest.mark.parametrize(
    ("route", "reachable", "problem"),
    [
        (ROUTE, "tcp:10.0.2.2:18080", "host port 18080 via the default gateway 10.0.2.2"),
        # G05 unmasked: no resolv.conf naming 127.0.0.1, only the loopback rule dials it
        ("", "tcp:127.0.0.1:18080", "host port 18080 via the loopback 127.0.0.1"),
    ],
)
def test_a_reachable_host_port_is_reported(
    fake: Fake, capsys: pytest.CaptureFixture[str], route: str, reachable: str, problem: str
) -> None:
    """A connect that succeeds is reported reachable, and the guest exits 1."""
    fake.file("/proc/net/route", route)
    fake.reachable.add(reachable)
    code, v = fake.run(plan(mode="alias"), capsys)
    assert code == 1
    assert v.problems == (f"leak: {reachable} ({problem}) is reachable",)


def test_a_gateway_answering_icmp_is_reported(
    fake: Fake, capsys: pytest.CaptureFixture[str]
) -> None:
    """G08: an echo answer from the gateway is a leak."""
    fake.file("/proc/net/route", ROUTE)
    fake.answers.add("10.0.2.2")
    code, v = fake.run(plan(mode="alias"), capsys)
    assert code == 1
    assert v.problems == ("leak: the default gateway 10.0.2.2 answers ICMP echo",)


def test_a_name_that_resolves_is_reported(fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    """G09: DNS working in the guest is a leak."""
    fake.resolving.add("gate.invalid")
    code, v = fake.run(plan(), capsys)
    assert code == 1
    assert v.problems == ("leak: DNS name gate.invalid resolves",)


# -- identity and volumes ---------------------------------------------------------------------


def test_the_guest_hashes_its_identity_as_the_host_does(fake: Fake) -> None:
    """G12: the trailing newline of machine-id is not part of the value."""
    fake.file("/etc/machine-id", "0123abcd\n")
    assert guest.ident_hash("/etc/machine-id") == host_id_hash(NONCE, "0123abcd")
    fake.file("/etc/machine-id", "\n")
    assert guest.ident_hash("/etc/machine-id") == "none"
    assert guest.ident_hash("/etc/absent") == "none"


def test_a_guest_sharing_the_hosts_machine_id_fails(
    fake: Fake, capsys: pytest.CaptureFixture[str]
) -> None:
    """G12 end to end: the judge sees the host's hash in the guest's transcript."""
    fake.file("/etc/machine-id", "0123abcd\n")
    fake.file("/proc/sys/kernel/hostname", "guest\n")
    p = plan(host_ids=(host_id_hash(NONCE, "0123abcd"), host_id_hash(NONCE, "host")))
    _, v = fake.run(p, capsys)
    assert v.problems == ("the guest's machine-id is the host's",)


def test_a_writable_read_only_volume_is_reported(
    fake: Fake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """G13: the write probe succeeds, the guest says so (and leaves no file behind)."""
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    p = plan(ro=(str(ro),), rw=(str(rw),))
    _, v = fake.run(p, capsys)
    assert v.problems == (f"read-only volume {ro} accepts writes",)
    assert os.listdir(ro) == []
    assert (rw / f".bottlenet-gate-{NONCE}").read_text() == NONCE + "\n"


def test_a_read_only_volume_that_refuses_writes_is_ok(
    fake: Fake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The other side of G13: a write that fails (EROFS, EACCES) is what read-only means."""
    p = plan(ro=(str(tmp_path / "missing"),))
    code, v = fake.run(p, capsys)
    assert (code, v.problems) == (0, ())


# -- the machinery: parallel checks and the positive controls ---------------------------------


def test_parallel_waits_for_slow_checks_and_keeps_the_order(fake: Fake) -> None:
    """G14: a check still running is waited for, not read as None (= blocked)."""
    import threading

    started = threading.Barrier(3)

    def slow(item: str) -> str:
        started.wait()  # all three run at once, none has returned yet
        return item.upper()

    assert guest.parallel(slow, ["a", "b", "c"]) == ["A", "B", "C"]


def test_a_control_that_fails_ends_the_run_blind(
    fake: Fake, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """G15: the real controls on this loopback, with ICMP unusable: not ok, icmp fail."""
    monkeypatch.undo()  # the real controls() and connect(); ping stays unusable
    monkeypatch.setattr(guest, "PLAN", plan_literal(plan(timeout=1.0)))
    monkeypatch.setattr(guest, "ping", lambda addr: None)
    assert guest.controls() is False
    out = capsys.readouterr().out
    assert f"BNP {NONCE} control tcp ok\n" in out
    assert f"BNP {NONCE} control icmp fail\n" in out


# -- the paths read from code and now probed: [::1], vsock, UDP, ICMPv6 ------------------------


def test_loopback6_vsock_and_udp_are_probed_on_every_path(
    fake: Fake, capsys: pytest.CaptureFixture[str]
) -> None:
    """Host ports via [::1] and over vsock to CID 2; UDP ports on every path and outside."""
    fake.file("/proc/net/route", ROUTE)
    p = plan(mode="alias", udp_ports=(123,))
    code, v = fake.run(p, capsys)
    assert (code, v.problems) == (0, ())
    for t in ("tcp:[::1]:18080", "vsock:2:18080", "udp:127.0.0.1:123", "udp:[::1]:123"):
        assert t in fake.dialled
    assert {"udp:10.0.2.2:123", "udp:198.18.0.1:9"} <= set(fake.dialled)


@pytest.mark.parametrize(
    ("reachable", "problem"),
    [
        ("tcp:[::1]:18080", "tcp:[::1]:18080 (host port 18080 via the loopback ::1)"),
        ("vsock:2:18080", "vsock:2:18080 (host port 18080 over vsock to the host (CID 2))"),
        (
            "udp:10.0.2.2:123",
            "udp:10.0.2.2:123 (host UDP port 123 via the default gateway 10.0.2.2)",
        ),
        ("udp:198.18.0.1:9", "udp:198.18.0.1:9 (the outside address over UDP)"),
    ],
)
def test_each_new_path_that_answers_is_a_named_leak(
    fake: Fake, capsys: pytest.CaptureFixture[str], reachable: str, problem: str
) -> None:
    """What answers on [::1], vsock or UDP is reported and judged a leak."""
    fake.file("/proc/net/route", ROUTE)
    fake.reachable.add(reachable)
    code, v = fake.run(plan(mode="alias", udp_ports=(123,)), capsys)
    assert code == 1
    assert v.problems == (f"leak: {problem} is reachable",)


def test_an_ipv6_gateway_is_pinged_with_icmpv6_after_its_control(
    fake: Fake, capsys: pytest.CaptureFixture[str]
) -> None:
    """G04's consequence: the IPv6 gateway gets TCP, UDP and ICMPv6; ::1 is the control."""
    fake.file("/proc/net/ipv6_route", ROUTE6)
    fake.answers.update({"::1", "fe80::2%eth0"})
    code, v = fake.run(plan(mode="alias"), capsys)
    assert fake.pinged[0] == "::1" and "fe80::2%eth0" in fake.pinged
    assert "tcp:[fe80::2%eth0]:18080" in fake.dialled
    assert code == 1
    assert v.problems == ("leak: the default gateway fe80::2%eth0 answers ICMPv6 echo",)


def test_a_failed_icmpv6_control_is_not_a_pass(
    fake: Fake, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a working ICMPv6 echo to ::1, "blocked" for the v6 gateway means nothing."""
    fake.file("/proc/net/ipv6_route", ROUTE6)
    code, v = fake.run(plan(mode="alias"), capsys)
    assert code == 1
    assert v.problems == ("probe tool cannot detect ICMPv6 (control icmp6 failed or missing)",)


def test_datagram_counts_only_an_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real UDP echo on this loopback answers; a closed port (ICMP unreachable) does not."""
    import socket
    import threading

    monkeypatch.setattr(guest, "PLAN", plan_literal(plan(timeout=5.0)))
    echo = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    echo.bind(("127.0.0.1", 0))
    port = echo.getsockname()[1]
    got: list[bytes] = []

    def serve() -> None:
        data, peer = echo.recvfrom(512)
        got.append(data)
        echo.sendto(b"", peer)  # even an empty datagram is an answer

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    assert guest.datagram(f"127.0.0.1:{port}") is True
    th.join()
    echo.close()
    assert got == [f"BNP-UDP {NONCE}\n".encode()]
    assert guest.datagram(f"127.0.0.1:{port}") is False  # closed now: refused


def test_the_udp_hello_is_a_query_a_dns_or_ntp_server_answers() -> None:
    """Port 53 gets a well-formed DNS query (root NS), 123 an NTP client request."""
    import struct

    dns = guest.hello(53)
    _, flags, qd, an, ns, ar = struct.unpack("!HHHHHH", dns[:12])
    assert (flags, qd, an, ns, ar) == (0x0100, 1, 0, 0, 0)
    assert dns[12:] == b"\0" + struct.pack("!HH", 2, 1)
    ntp = guest.hello(123)
    assert len(ntp) == 48 and ntp[0] & 0x07 == 3  # mode 3: client


def test_icmpv6_echo_to_this_loopback_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real ICMPv6 echo (the gate's icmp6 control) against ::1 of this namespace."""
    import socket

    try:
        socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6).close()
        socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).connect(("::1", 9))
    except OSError:
        pytest.skip("no ICMPv6 raw socket or no ::1 here")
    monkeypatch.setattr(guest, "PLAN", plan_literal(plan(timeout=5.0)))
    assert guest.ping("::1") is True
    assert guest.ping("127.0.0.1") is True
