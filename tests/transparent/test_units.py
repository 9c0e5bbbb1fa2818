"""The layer's pure parts: the fake-IP table and DNS answers, the netlink batch and how a
kernel's refusal is named."""

from __future__ import annotations

import errno
import socket
import struct

import pytest

from bottlenet.transparent import listener, nftables
from bottlenet.transparent.names import NameTable, answer
from bottlenet.transparent.netlink import NLMSG_ERROR, Netlink, NetlinkError, replies


def query(name: str, qtype: int = 1, ident: int = 0x4242, flags: int = 0x0100) -> bytes:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack("!HHHHHH", ident, flags, 1, 0, 0, 0) + labels + struct.pack("!HH", qtype, 1)


def test_a_name_keeps_its_fake_address_and_maps_back() -> None:
    """The same name gets the same address from 198.18.0.0/15; the address names it."""
    t = NameTable()
    a = t.address("example.com")
    assert a == t.address("example.com") and a.startswith("198.18.")
    assert t.name(a) == "example.com"
    assert t.name("198.19.255.1") is None and t.owns("198.19.255.1")
    assert t.name("203.0.113.7") is None and not t.owns("203.0.113.7")


def test_the_table_is_bounded_and_forgets_the_least_recently_used() -> None:
    """Past its capacity the oldest name is forgotten; a name used again is kept."""
    t = NameTable(capacity=3)
    first = t.address("a.test")
    second = t.address("b.test")
    t.address("c.test")
    t.address("a.test")  # used again: b.test is now the oldest
    t.address("d.test")
    assert len(t) == 3
    assert t.name(first) == "a.test" and t.name(second) is None


def test_an_address_is_handed_out_again_only_after_the_pool_went_round() -> None:
    """A pool of 4 (2 usable): the third name takes the first one's address."""
    import ipaddress

    t = NameTable(capacity=100, pool=ipaddress.IPv4Network("10.0.0.0/30"))
    a, b = t.address("a.test"), t.address("b.test")
    c = t.address("c.test")
    assert a != b and c == a
    assert t.name(a) == "c.test" and "a.test" not in t.by_name


def test_an_a_query_is_answered_from_the_pool() -> None:
    """One A record, TTL 5, the question echoed, recursion flags kept."""
    t = NameTable()
    reply = answer(query("Example.COM"), t)
    assert reply is not None
    ident, flags, qd, an = struct.unpack_from("!HHHH", reply)
    assert (ident, qd, an) == (0x4242, 1, 1) and flags & 0x8000 and flags & 0x0100
    assert flags & 0xF == 0
    assert socket.inet_ntoa(reply[-4:]) == t.address("example.com")


@pytest.mark.parametrize(
    ("data", "rcode", "answers"),
    [
        (query("example.com", qtype=28), 0, 0),  # AAAA: NODATA
        (query("bad name.test"), 3, 0),  # not a host name: NXDOMAIN
        (query("x" * 64 + ".test"), 1, 0),  # a label too long: malformed
        (query("example.com", flags=0x0900), 4, 0),  # opcode 1: not implemented
        (query("example.com")[:14], 1, 0),  # cut short: FORMERR
    ],
)
def test_other_queries_get_no_address(data: bytes, rcode: int, answers: int) -> None:
    """Only A queries for host names get an address."""
    reply = answer(data, NameTable())
    assert reply is not None
    _, flags, _, an = struct.unpack_from("!HHHH", reply)
    assert (flags & 0xF, an) == (rcode, answers)


def test_responses_and_runts_are_not_answered() -> None:
    """A response (QR set) or a datagram shorter than a header gets nothing back."""
    assert answer(query("example.com", flags=0x8100), NameTable()) is None
    assert answer(b"\0" * 11, NameTable()) is None
    assert answer(b"\0" * 600, NameTable()) is None


def test_the_install_batch_is_well_formed() -> None:
    """Begin, the table made anew, two chains, eight rules, end; each a whole message."""
    reqs = nftables.install_batch(1001)
    kinds = [k & 0xFF for k, _, _, _ in reqs]
    assert kinds[0] == nftables.BATCH_BEGIN and kinds[-1] == nftables.BATCH_END
    assert kinds[1:6] == [nftables.NEWTABLE, nftables.DELTABLE, nftables.NEWTABLE,
                          nftables.NEWCHAIN, nftables.NEWCHAIN]  # fmt: skip
    assert kinds[6:-1] == [nftables.NEWRULE] * 8
    assert all(what in nftables.NEEDS for _, _, _, what in reqs[1:-1] if what != "the batch")
    # the listener's port is in the redirect rule, big-endian
    assert struct.pack("!H", 1001) in reqs[10][2]


class FakeNetlink:
    """A netlink socket whose kernel refuses the request at ``refuse`` (an index)."""

    def __init__(self, refuse: int | None, code: int) -> None:
        self.refuse, self.code = refuse, code
        self.answers: list[bytes] = []

    def settimeout(self, t: float) -> None:
        pass

    def bind(self, addr: object) -> None:
        pass

    def close(self) -> None:
        pass

    def send(self, data: bytes) -> int:
        out = b""
        for i, (_, seq, _) in enumerate(replies(data)):
            code = -self.code if i == self.refuse else 0
            body = struct.pack("=i", code) + b"\0" * 16
            out += struct.pack("=IHHII", 16 + len(body), NLMSG_ERROR, 0, seq, 0) + body
        self.answers.append(out)
        return len(data)

    def recv(self, n: int) -> bytes:
        return self.answers.pop(0)


def test_a_refused_request_is_named() -> None:
    """The error answers request 10 (the TCP redirect rule): the layer names the redir
    expression, the piece that kernel lacks."""
    sock = FakeNetlink(refuse=10, code=errno.ENOENT)
    with pytest.raises(nftables.Missing) as e:
        nftables.install(1001, opener=lambda p: sock)
    assert e.value.what == "redir"
    assert "CONFIG_NFT_REDIR" in nftables.NEEDS[e.value.what]


def test_a_kernel_without_nf_tables_netlink_is_named() -> None:
    """No NETLINK_NETFILTER at all (the socket cannot be made): "netlink"."""

    def no_netfilter(protocol: int) -> socket.socket:
        raise OSError(errno.EPROTONOSUPPORT, "Protocol not supported")

    with pytest.raises(nftables.Missing) as e:
        nftables.install(1001, opener=no_netfilter)
    assert e.value.what == "netlink" and "CONFIG_NF_TABLES" in nftables.NEEDS["netlink"]


def test_other_errors_stay_errors() -> None:
    """EPERM (not root) is not a missing piece."""
    sock = FakeNetlink(refuse=1, code=errno.EPERM)
    with pytest.raises(NetlinkError) as e:
        nftables.install(1001, opener=lambda p: sock)
    assert e.value.errno == errno.EPERM


def test_a_transaction_waits_for_every_ack() -> None:
    """All acks 0: no error; the sequence numbers go on across transactions."""
    sock = FakeNetlink(refuse=None, code=0)
    nl = Netlink(0, opener=lambda p: sock)  # type: ignore[arg-type,return-value]
    nl.transact([(1, 0, b"", "a"), (2, 0, b"", "b")])
    nl.transact([(3, 0, b"", "c")])
    assert nl.seq == 4


def test_proxy_answers_and_targets() -> None:
    """2xx opens the tunnel; any other status or junk does not; fake addresses name."""
    assert listener.answered(b"HTTP/1.1 200 Connection established")
    assert not listener.answered(b"HTTP/1.1 403 Forbidden")
    assert not listener.answered(b"SSH-2.0 200")
    assert not listener.answered(b"HTTP/1.1 2000 x")
    import threading

    t, lock = NameTable(), threading.Lock()
    fake = t.address("example.com")
    assert listener.target_of(fake, 443, t, lock) == "example.com:443"
    assert listener.target_of("198.19.0.9", 443, t, lock) is None  # ours, forgotten
    assert listener.target_of("2001:db8::1", 443, t, lock) == "[2001:db8::1]:443"
    assert listener.is_loopback("127.0.0.1") and listener.is_loopback("::ffff:127.0.0.1")


@pytest.mark.parametrize(
    ("argv", "parsed"),
    [
        (["run", "--proxy", "/run/bottle/egress.sock"], ("run", "/run/bottle/egress.sock", 1001)),
        (["serve", "--port", "2000", "--proxy", "/p"], ("serve", "/p", 2000)),
        (["install"], ("install", None, 1001)),
        (["remove"], ("remove", None, 1001)),
        (["run"], None),  # no proxy
        (["install", "--proxy", "/p"], None),
        (["remove", "--port", "1"], None),
        (["run", "--proxy"], None),
        (["run", "--proxy", "/p", "--port", "0"], None),
        (["bogus"], None),
        ([], None),
    ],
)
def test_the_layer_command_line(argv: list[str], parsed: object) -> None:
    """The kit's subcommand arguments: exactly the forms the daemon sends."""
    from bottlenet.transparent.layer import parse

    assert parse(argv) == parsed
