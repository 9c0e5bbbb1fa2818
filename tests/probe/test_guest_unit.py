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
        self.reachable: set[str] = set()  # "tcp:H:P" / "unix:P" that connect
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
        monkeypatch.setattr(guest, "ping", ping)
        monkeypatch.setattr(guest, "resolves", lambda name: name in self.resolving)
        monkeypatch.setattr(guest, "controls", lambda: True)

    def file(self, path: str, text: str) -> None:
        p = self.root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    def use(self, p: ProbePlan, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(guest, "PLAN", plan_literal(p))

    def run(self, p: ProbePlan, capsys: pytest.CaptureFixture[str]) -> tuple[int, Verdict]:
        """main() under ``p``; the real judge's verdict on what it printed (own witnessed)."""
        code = guest.main()
        out = capsys.readouterr().out
        head = f"BNP {p.nonce} begin 1\nBNP {p.nonce} iface lo\nBNP {p.nonce} tool image\n"
        head += "".join(f"BNP {p.nonce} control {c} ok\n" for c in ("tcp", "unix", "icmp"))
        return code, judge(p, (head + out).encode(), exit_code=code, witnessed=[OWN])


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGuest]:
    g = FakeGuest(tmp_path / "root", monkeypatch)
    g.use(plan(), monkeypatch)
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


def test_a_reachable_host_port_via_the_gateway_is_reported(
    fake: Fake, capsys: pytest.CaptureFixture[str]
) -> None:
    """A connect that succeeds is reported reachable, and the guest exits 1."""
    fake.file("/proc/net/route", ROUTE)
    fake.reachable.add("tcp:10.0.2.2:18080")
    code, v = fake.run(plan(mode="alias"), capsys)
    assert code == 1
    assert v.problems == (
        "leak: tcp:10.0.2.2:18080 (host port 18080 via the default gateway 10.0.2.2) is reachable",
    )


def test_loopback_is_probed_without_any_nameserver(
    fake: Fake, capsys: pytest.CaptureFixture[str]
) -> None:
    """G05 unmasked: no resolv.conf naming 127.0.0.1, so only the loopback rule dials it."""
    fake.reachable.add("tcp:127.0.0.1:18080")
    code, v = fake.run(plan(), capsys)
    assert code == 1
    assert v.problems == (
        "leak: tcp:127.0.0.1:18080 (host port 18080 via the loopback 127.0.0.1) is reachable",
    )


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
    fake: Fake, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """G12 end to end: the judge sees the host's hash in the guest's transcript."""
    fake.file("/etc/machine-id", "0123abcd\n")
    fake.file("/proc/sys/kernel/hostname", "guest\n")
    p = plan(host_ids=(host_id_hash(NONCE, "0123abcd"), host_id_hash(NONCE, "host")))
    fake.use(p, monkeypatch)
    _, v = fake.run(p, capsys)
    assert v.problems == ("the guest's machine-id is the host's",)


def test_a_writable_read_only_volume_is_reported(
    fake: Fake, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """G13: the write probe succeeds, the guest says so (and leaves no file behind)."""
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    p = plan(ro=(str(ro),), rw=(str(rw),))
    fake.use(p, monkeypatch)
    _, v = fake.run(p, capsys)
    assert v.problems == (f"read-only volume {ro} accepts writes",)
    assert os.listdir(ro) == []
    assert (rw / f".bottlenet-gate-{NONCE}").read_text() == NONCE + "\n"


def test_a_read_only_volume_that_refuses_writes_is_ok(
    fake: Fake, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other side of G13: a write that fails (EROFS, EACCES) is what read-only means."""
    p = plan(ro=(str(tmp_path / "missing"),))
    fake.use(p, monkeypatch)
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
