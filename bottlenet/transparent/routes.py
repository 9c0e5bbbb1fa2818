"""The layer's routes over rtnetlink: ``lo`` up, ``default dev lo src 127.0.0.1`` and IPv6
``default dev lo``, each replacing whatever default route was there.

The ``src`` is required: without it the kernel picks source 0.0.0.0, the connect completes
through the redirect, and no byte ever comes back (egress-prototype.md). No sysctl is needed.
"""

from __future__ import annotations

import socket
import struct

from bottlenet.transparent.netlink import (
    NETLINK_ROUTE,
    NLM_F_CREATE,
    NLM_F_REPLACE,
    Netlink,
    Request,
    attr,
)

RTM_NEWLINK, RTM_NEWROUTE, RTM_DELROUTE = 16, 24, 25
IFF_UP = 0x1
RT_TABLE_MAIN = 254
RTPROT_STATIC = 4
RT_SCOPE_UNIVERSE, RT_SCOPE_LINK = 0, 253
RTN_UNICAST = 1
RTA_OIF, RTA_PRIORITY, RTA_PREFSRC = 4, 6, 7
#: The metric the kernel gives an IPv6 route by default (``ip -6 route`` shows 1024).
V6_METRIC = 1024


def _ifinfo(index: int, flags: int, change: int) -> bytes:
    return struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, flags, change)


def _rtmsg(family: int, scope: int) -> bytes:
    return struct.pack("=BBBBBBBBI", family, 0, 0, 0, RT_TABLE_MAIN, RTPROT_STATIC, scope,
                       RTN_UNICAST, 0)  # fmt: skip


def lo_index() -> int:
    return socket.if_nametoindex("lo")


def requests(lo: int) -> list[Request]:
    oif = attr(RTA_OIF, struct.pack("=I", lo))
    v4 = _rtmsg(socket.AF_INET, RT_SCOPE_LINK) + oif
    v4 += attr(RTA_PREFSRC, socket.inet_aton("127.0.0.1"))
    v6 = _rtmsg(socket.AF_INET6, RT_SCOPE_UNIVERSE) + oif
    v6 += attr(RTA_PRIORITY, struct.pack("=I", V6_METRIC))
    replace = NLM_F_CREATE | NLM_F_REPLACE
    return [
        (RTM_NEWLINK, 0, _ifinfo(lo, IFF_UP, IFF_UP), "setting lo up"),
        (RTM_NEWROUTE, replace, v4, "the route default dev lo src 127.0.0.1"),
        (RTM_NEWROUTE, replace, v6, "the IPv6 route default dev lo"),
    ]


def install(opener: object | None = None) -> None:
    with Netlink(NETLINK_ROUTE, opener) as nl:  # type: ignore[arg-type]
        nl.transact(requests(lo_index()))
