"""What each network link of this guest can carry, read over rtnetlink: the launch gate's view.

A socket-mode agent VM must have no way out but its mounted sockets, yet the kernel users
boot (libkrunfw's) has the ``dummy`` driver built in, so every guest shows ``dummy0``; and
libkrun's init, when its transparent socket impersonation is on (``tsi_hijack`` on the
kernel command line), brings ``dummy0`` up with an address. A link's name proves nothing; what
it carries does: its kind (``IFLA_INFO_KIND``: ``dummy``, ``veth``, none for a device), its
flags (up or down), its addresses and every route through it, in any table. Three dumps
(``RTM_GETLINK``, ``RTM_GETADDR``, ``RTM_GETROUTE`` for IPv4 and IPv6) over one socket, no
``ip`` binary; the probe prints what :func:`read` returns and the host's judge decides.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

from bottlenet.transparent.netlink import NETLINK_ROUTE, Netlink, parse_attrs

RTM_GETLINK, RTM_NEWLINK = 18, 16
RTM_GETADDR, RTM_NEWADDR = 22, 20
RTM_GETROUTE, RTM_NEWROUTE = 26, 24
IFLA_IFNAME, IFLA_LINKINFO, IFLA_INFO_KIND = 3, 18, 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_DST, RTA_OIF, RTA_MULTIPATH = 1, 4, 9
_IFINFO = struct.Struct("=BxHiII")
_IFADDR = struct.Struct("=BBBBI")
_RTMSG = struct.Struct("=BBBBBBBBI")
_NEXTHOP = struct.Struct("=HBBi")
#: Route types by ``rtm_type`` (``RTN_*``), as ``ip route`` names them.
ROUTE_TYPES = {
    1: "unicast",
    2: "local",
    3: "broadcast",
    4: "anycast",
    5: "multicast",
    6: "blackhole",
    7: "unreachable",
    8: "prohibit",
    9: "throw",
    10: "nat",
}
#: The most addresses and routes reported per link (past it, the link carries plenty).
MAX_PER_LINK = 32


class Link:
    """One link: ``kind`` is ``IFLA_INFO_KIND`` ("" for a device, as ``lo`` or ``eth0``),
    ``flags`` its ``IFF_*`` bits, ``addresses`` ``IP/PREFIX``, ``routes`` ``TYPE DEST/LEN``."""

    def __init__(self, index: int, name: str, kind: str, flags: int) -> None:
        self.index = index
        self.name = name
        self.kind = kind
        self.flags = flags
        self.addresses: list[str] = []
        self.routes: list[str] = []

    def __repr__(self) -> str:
        return (
            f"Link({self.name!r}, {self.kind!r}, {self.flags:#x}, {self.addresses}, {self.routes})"
        )


def _text(data: bytes) -> str:
    return data.split(b"\0", 1)[0].decode("ascii", "replace")


def _ip(family: int, data: bytes) -> str | None:
    size = 4 if family == socket.AF_INET else 16
    if len(data) != size:
        return None
    return socket.inet_ntop(family, data)


def _link(body: bytes) -> Link | None:
    if len(body) < _IFINFO.size:
        return None
    _family, _type, index, flags, _change = _IFINFO.unpack_from(body)
    attrs = parse_attrs(body[_IFINFO.size :])
    kind = parse_attrs(attrs.get(IFLA_LINKINFO, b"")).get(IFLA_INFO_KIND, b"")
    return Link(index, _text(attrs.get(IFLA_IFNAME, b"")), _text(kind), flags)


def _address(body: bytes) -> tuple[int, str] | None:
    if len(body) < _IFADDR.size:
        return None
    family, prefix, _flags, _scope, index = _IFADDR.unpack_from(body)
    attrs = parse_attrs(body[_IFADDR.size :])
    ip = _ip(family, attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS, b""))
    return None if ip is None else (index, f"{ip}/{prefix}")


def _route(body: bytes) -> tuple[list[int], str] | None:
    """(the links it goes through, ``TYPE DEST/LEN``)."""
    if len(body) < _RTMSG.size:
        return None
    family, dst_len, _src, _tos, _table, _proto, _scope, kind, _flags = _RTMSG.unpack_from(body)
    attrs = parse_attrs(body[_RTMSG.size :])
    zero = "0.0.0.0" if family == socket.AF_INET else "::"
    dst = _ip(family, attrs[RTA_DST]) if RTA_DST in attrs else zero
    links = [struct.unpack("=i", attrs[RTA_OIF])[0]] if len(attrs.get(RTA_OIF, b"")) == 4 else []
    hops = attrs.get(RTA_MULTIPATH, b"")
    at = 0
    while at + _NEXTHOP.size <= len(hops):
        length, _hflags, _hops, index = _NEXTHOP.unpack_from(hops, at)
        if length < _NEXTHOP.size:
            break
        links.append(index)
        at += (length + 3) & ~3
    if dst is None:
        return None
    return links, f"{ROUTE_TYPES.get(kind, str(kind))} {dst}/{dst_len}"


def read(opener: Callable[[int], socket.socket] | None = None) -> list[Link]:
    """Every link of this network namespace with its addresses and the routes through it
    (raises OSError or NetlinkError when rtnetlink cannot be read)."""
    with Netlink(NETLINK_ROUTE, opener) as nl:
        unspec = struct.pack("=B3x", socket.AF_UNSPEC)
        links = {}
        for kind, body in nl.dump(RTM_GETLINK, _IFINFO.pack(0, 0, 0, 0, 0), "the links"):
            link = _link(body) if kind == RTM_NEWLINK else None
            if link is not None:
                links[link.index] = link
        for kind, body in nl.dump(RTM_GETADDR, unspec + b"\0" * 4, "the addresses"):
            found = _address(body) if kind == RTM_NEWADDR else None
            if found is not None and found[0] in links:
                _add(links[found[0]].addresses, found[1])
        for family in (socket.AF_INET, socket.AF_INET6):
            request = _RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0)
            for kind, body in nl.dump(RTM_GETROUTE, request, "the routes"):
                route = _route(body) if kind == RTM_NEWROUTE else None
                for index in route[0] if route is not None else ():
                    if index in links:
                        _add(links[index].routes, route[1])  # type: ignore[index]
    return [links[i] for i in sorted(links)]


def _add(into: list[str], value: str) -> None:
    if value not in into and len(into) < MAX_PER_LINK:
        into.append(value)
