"""The layer's one nf_tables table, as the netlink batch that installs it atomically.

The ruleset (``nft list ruleset`` would print it so)::

    table inet bottlenet_egress {
      chain nat_out {
        type nat hook output priority -100; policy accept;
        meta nfproto ipv4 udp dport 53 dnat ip to 127.0.0.53:53   # any resolver -> ours
        meta nfproto ipv6 udp dport 53 redirect to :53            # ([::1]:53)
        meta nfproto ipv4 ip daddr 127.0.0.0/8 return
        meta nfproto ipv6 ip6 daddr ::1 return
        meta l4proto tcp redirect to :LISTEN_PORT                 # every other TCP connect
      }
      chain filter_out {
        type filter hook output priority 0; policy accept;     # after nat: sees ours
        meta nfproto ipv4 ip daddr 127.0.0.0/8 accept
        meta nfproto ipv6 ip6 daddr ::1 accept
        drop                                      # UDP, ICMP, the rest: EPERM at once
      }
    }

One batch replaces the table whole (create, delete, create: no window without rules, nothing
left of an older one). A kernel that lacks a piece refuses the request that needs it, and
:func:`missing` names the piece and the kernel option that builds it.
"""

from __future__ import annotations

import errno
import socket
import struct

from bottlenet.transparent.netlink import (
    NETLINK_NETFILTER,
    NLM_F_CREATE,
    Netlink,
    NetlinkError,
    Request,
    attr,
    nest,
    s32be,
    string,
    u32be,
)

TABLE = "bottlenet_egress"
NAT_CHAIN = "nat_out"
FILTER_CHAIN = "filter_out"
NFPROTO_INET, NFPROTO_IPV4, NFPROTO_IPV6 = 1, 2, 10
_SUBSYS = 10 << 8  # NFNL_SUBSYS_NFTABLES
BATCH_BEGIN, BATCH_END = 0x10, 0x11
NEWTABLE, DELTABLE, NEWCHAIN, NEWRULE = 0, 2, 3, 6
NF_INET_LOCAL_OUT = 3
# registers, verdicts, expression attributes (linux/netfilter/nf_tables.h)
REG_VERDICT, REG_1, REG_2 = 0, 1, 2
NF_DROP, NF_ACCEPT, NFT_RETURN = 0, 1, -5
META_NFPROTO, META_L4PROTO = 15, 16
PAYLOAD_NETWORK, PAYLOAD_TRANSPORT = 1, 2
NAT_DNAT = 1
#: Where the resolver listens (the DNAT target for IPv4 UDP/53).
RESOLVER_V4 = "127.0.0.53"
DNS_PORT = 53


def _nfgen(family: int) -> bytes:
    return struct.pack("=BBH", family, 0, 0)


def _expr(name: str, *attrs: bytes) -> bytes:
    return nest(1, string(1, name), nest(2, *attrs))  # NFTA_LIST_ELEM(NFTA_EXPR_NAME, _DATA)


def _meta(key: int) -> bytes:
    return _expr("meta", u32be(2, key), u32be(1, REG_1))  # KEY, DREG


def _cmp_eq(value: bytes) -> bytes:
    return _expr("cmp", u32be(1, REG_1), u32be(2, 0), nest(3, attr(1, value)))  # SREG, OP, DATA


def _payload(base: int, offset: int, length: int) -> bytes:
    return _expr("payload", u32be(1, REG_1), u32be(2, base), u32be(3, offset), u32be(4, length))


def _immediate(reg: int, value: bytes) -> bytes:
    return _expr("immediate", u32be(1, reg), nest(2, attr(1, value)))


def _verdict(code: int) -> bytes:
    return _expr("immediate", u32be(1, REG_VERDICT), nest(2, nest(2, s32be(1, code))))


def _port(port: int) -> bytes:
    return struct.pack("!H", port)


def _nfproto(family: int) -> list[bytes]:
    return [_meta(META_NFPROTO), _cmp_eq(bytes([family]))]


def _l4(proto: int) -> list[bytes]:
    return [_meta(META_L4PROTO), _cmp_eq(bytes([proto]))]


def _loopback(family: int) -> list[bytes]:
    """``ip daddr 127.0.0.0/8`` (its first byte) or ``ip6 daddr ::1``."""
    if family == NFPROTO_IPV4:
        return [*_nfproto(family), _payload(PAYLOAD_NETWORK, 16, 1), _cmp_eq(b"\x7f")]
    ip = socket.inet_pton(socket.AF_INET6, "::1")
    return [*_nfproto(family), _payload(PAYLOAD_NETWORK, 24, 16), _cmp_eq(ip)]


def _dns(family: int) -> list[bytes]:
    return [*_nfproto(family), *_l4(socket.IPPROTO_UDP), _payload(PAYLOAD_TRANSPORT, 2, 2),
            _cmp_eq(_port(DNS_PORT))]  # fmt: skip


def _dnat_v4(address: str, port: int) -> list[bytes]:
    return [
        _immediate(REG_1, socket.inet_aton(address)),
        _immediate(REG_2, _port(port)),
        # TYPE, FAMILY, REG_ADDR_MIN, REG_PROTO_MIN
        _expr("nat", u32be(1, NAT_DNAT), u32be(2, NFPROTO_IPV4), u32be(3, REG_1), u32be(5, REG_2)),
    ]


def _redirect(port: int) -> list[bytes]:
    return [_immediate(REG_1, _port(port)), _expr("redir", u32be(1, REG_1))]  # REG_PROTO_MIN


def rules(listen_port: int) -> list[tuple[str, str, list[bytes]]]:
    return [
        (NAT_CHAIN, "nat",
         [*_dns(NFPROTO_IPV4), *_dnat_v4(RESOLVER_V4, DNS_PORT)]),
        (NAT_CHAIN, "redir",
         [*_dns(NFPROTO_IPV6), *_redirect(DNS_PORT)]),
        (NAT_CHAIN, "match",
         [*_loopback(NFPROTO_IPV4), _verdict(NFT_RETURN)]),
        (NAT_CHAIN, "match",
         [*_loopback(NFPROTO_IPV6), _verdict(NFT_RETURN)]),
        (NAT_CHAIN, "redir",
         [*_l4(socket.IPPROTO_TCP), *_redirect(listen_port)]),
        (FILTER_CHAIN, "match",
         [*_loopback(NFPROTO_IPV4), _verdict(NF_ACCEPT)]),
        (FILTER_CHAIN, "match",
         [*_loopback(NFPROTO_IPV6), _verdict(NF_ACCEPT)]),
        (FILTER_CHAIN, "match", [_verdict(NF_DROP)]),
    ]  # fmt: skip


#: What each piece of the ruleset needs of the kernel, by the key the guest reports.
NEEDS = {
    "netlink": "nf_tables over netlink (CONFIG_NETFILTER, CONFIG_NETFILTER_NETLINK,"
    " CONFIG_NF_TABLES)",
    "table": "an inet table (CONFIG_NF_TABLES_INET)",
    "nat-chain": "the nat chain type in the inet family (CONFIG_NFT_NAT, CONFIG_NF_NAT,"
    " CONFIG_NF_CONNTRACK)",
    "filter-chain": "the filter chain type (CONFIG_NF_TABLES_INET)",
    "nat": "the nat expression (CONFIG_NFT_NAT)",
    "redir": "the redir expression (CONFIG_NFT_REDIR)",
    "match": "the meta, payload, cmp and immediate expressions (CONFIG_NF_TABLES)",
}


def _msg(kind: int, body: bytes, what: str, flags: int = 0) -> Request:
    return (_SUBSYS | kind, flags, _nfgen(NFPROTO_INET) + body, what)


def _chain(name: str, kind: str, priority: int) -> Request:
    hook = nest(4, u32be(1, NF_INET_LOCAL_OUT), s32be(2, priority))
    body = string(1, TABLE) + string(3, name) + hook + u32be(5, NF_ACCEPT) + string(7, kind)
    return _msg(NEWCHAIN, body, f"{kind}-chain", NLM_F_CREATE)


def _batch(kind: int) -> Request:
    return (kind, 0, struct.pack("=BBH", 0, 0, socket.htons(10)), "the batch")


def install_batch(listen_port: int) -> list[Request]:
    """The whole table, replacing any older one, in one batch."""
    table = string(1, TABLE)
    reqs = [
        _batch(BATCH_BEGIN),
        _msg(NEWTABLE, table, "table", NLM_F_CREATE),
        _msg(DELTABLE, table, "table"),
        _msg(NEWTABLE, table, "table", NLM_F_CREATE),
        _chain(NAT_CHAIN, "nat", -100),
        _chain(FILTER_CHAIN, "filter", 0),
    ]
    for chain, what, exprs in rules(listen_port):
        body = string(1, TABLE) + string(2, chain) + nest(4, *exprs)
        reqs.append(_msg(NEWRULE, body, what, NLM_F_CREATE | 0x800))  # NLM_F_APPEND
    reqs.append(_batch(BATCH_END))
    return reqs


def remove_batch() -> list[Request]:
    """Delete the table (what a guest root's ``nft flush ruleset`` does to it)."""
    return [
        _batch(BATCH_BEGIN),
        _msg(NEWTABLE, string(1, TABLE), "table", NLM_F_CREATE),
        _msg(DELTABLE, string(1, TABLE), "table"),
        _batch(BATCH_END),
    ]


class Missing(Exception):
    """The kernel lacks what the layer needs: ``what`` is its key in :data:`NEEDS`."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def _inner(reqs: list[Request]) -> list[int]:
    return list(range(1, len(reqs) - 1))


def missing(error: BaseException) -> str | None:
    """What the kernel lacks (a key of :data:`NEEDS`), from an error of :func:`apply`; None
    for any other failure."""
    if isinstance(error, NetlinkError) and error.errno in (
        errno.ENOENT, errno.EOPNOTSUPP, errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT,
    ):  # fmt: skip
        return error.what
    if isinstance(error, OSError) and error.errno in (errno.EPROTONOSUPPORT, errno.ENOPROTOOPT):
        return "netlink"
    return None


def apply(reqs: list[Request], opener: object = None) -> None:
    """Send one batch; a kernel that lacks a piece raises :class:`Missing` naming it."""
    try:
        with Netlink(NETLINK_NETFILTER, opener) as nl:  # type: ignore[arg-type]
            nl.transact(reqs, acked=_inner(reqs))
    except (OSError, NetlinkError) as e:
        what = missing(e)
        if what is not None:
            raise Missing(what) from None
        raise


def install(listen_port: int, opener: object = None) -> None:
    apply(install_batch(listen_port), opener)


def remove(opener: object = None) -> None:
    apply(remove_batch(), opener)
