"""The fake-IP resolver: A answers from 198.18.0.0/15, each address remembering its name.

A client that resolves ``example.com`` gets a fake address; when it connects there, the
listener finds the name again and asks the proxy for ``CONNECT example.com:port``, so the
proxy's allow-list works on names and no name is ever resolved in the guest. Nothing is
forwarded anywhere (a resolver that asked the host would be a DNS tunnel). AAAA and every
other type get an empty answer (IPv6 clients fall back to IPv4); a name that is not a host
name gets NXDOMAIN. The table is bounded: past ``capacity`` names the least recently used is
forgotten (a connect to its address is refused), and an address is handed out again only
after the whole pool went round.
"""

from __future__ import annotations

import ipaddress
import re
import struct
from collections import OrderedDict

POOL = ipaddress.IPv4Network("198.18.0.0/15")
CAPACITY = 8192
TTL = 5
_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
QTYPE_A, QTYPE_AAAA, QCLASS_IN = 1, 28, 1
RCODE_OK, RCODE_FORMERR, RCODE_NXDOMAIN, RCODE_NOTIMP = 0, 1, 3, 4
#: The largest query read (a question is at most 255 bytes of name plus the headers).
MAX_QUERY = 512


def host_name(labels: list[bytes]) -> str | None:
    """The lowercase host name these labels spell, or None when they spell no host name."""
    try:
        words = [label.decode("ascii").lower() for label in labels]
    except UnicodeDecodeError:
        return None
    name = ".".join(words)
    if not words or len(name) > 253 or not all(_LABEL.match(w) for w in words):
        return None
    return name


class NameTable:
    """name <-> fake address, at most ``capacity`` names, least recently used forgotten."""

    def __init__(self, capacity: int = CAPACITY, pool: ipaddress.IPv4Network = POOL) -> None:
        self.capacity = capacity
        self.base = int(pool.network_address)
        self.size = pool.num_addresses
        self.next = 1  # the network address itself is never handed out
        self.by_name: OrderedDict[str, int] = OrderedDict()
        self.by_addr: dict[int, str] = {}

    def address(self, name: str) -> str:
        """The fake address for ``name`` (the same one while it is remembered)."""
        offset = self.by_name.get(name)
        if offset is not None:
            self.by_name.move_to_end(name)
            return str(ipaddress.IPv4Address(self.base + offset))
        offset = self.next
        self.next = self.next + 1 if self.next + 1 < self.size - 1 else 1
        old = self.by_addr.pop(offset, None)
        if old is not None:
            del self.by_name[old]
        while len(self.by_name) >= self.capacity:
            _, gone = self.by_name.popitem(last=False)
            del self.by_addr[gone]
        self.by_name[name] = offset
        self.by_addr[offset] = name
        return str(ipaddress.IPv4Address(self.base + offset))

    def name(self, address: str) -> str | None:
        """The name behind a fake address, None when it is not (or no longer) one of ours."""
        try:
            value = int(ipaddress.IPv4Address(address))
        except ValueError:
            return None
        if not 0 <= value - self.base < self.size:
            return None
        return self.by_addr.get(value - self.base)

    def owns(self, address: str) -> bool:
        """Whether ``address`` lies in the fake pool (remembered or not)."""
        try:
            return ipaddress.ip_address(address) in POOL
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self.by_name)


def _question(query: bytes) -> tuple[list[bytes], int, int, int] | None:
    """(labels, qtype, qclass, end of the question) of a query's one question."""
    at = 12
    labels: list[bytes] = []
    while True:
        if at >= len(query):
            return None
        n = query[at]
        if n == 0:
            at += 1
            break
        if n & 0xC0 or at + 1 + n > len(query) or len(labels) >= 127:
            return None
        labels.append(query[at + 1 : at + 1 + n])
        at += 1 + n
    if at + 4 > len(query):
        return None
    qtype, qclass = struct.unpack_from("!HH", query, at)
    return labels, qtype, qclass, at + 4


def answer(query: bytes, table: NameTable) -> bytes | None:
    """The reply to one query, or None for a datagram that is not a query to answer."""
    if len(query) < 12 or len(query) > MAX_QUERY:
        return None
    ident, flags, qdcount = struct.unpack_from("!HHH", query)
    if flags & 0x8000:  # a response: never answered
        return None
    rd = flags & 0x0100
    opcode = (flags >> 11) & 0xF

    def reply(rcode: int, question: bytes = b"", answers: bytes = b"", count: int = 0) -> bytes:
        head = struct.pack("!HHHHHH", ident, 0x8000 | 0x0400 | rd | 0x0080 | rcode,
                           1 if question else 0, count, 0, 0)  # fmt: skip
        return head + question + answers

    if opcode != 0:
        return reply(RCODE_NOTIMP)
    q = _question(query) if qdcount == 1 else None
    if q is None:
        return reply(RCODE_FORMERR)
    labels, qtype, qclass, end = q
    question = query[12:end]
    name = host_name(labels)
    if name is None:
        return reply(RCODE_NXDOMAIN, question)
    if qtype != QTYPE_A or qclass != QCLASS_IN:
        return reply(RCODE_OK, question)  # NODATA: AAAA and the rest
    ip = ipaddress.IPv4Address(table.address(name)).packed
    rr = struct.pack("!HHHIH", 0xC00C, QTYPE_A, QCLASS_IN, TTL, 4) + ip
    return reply(RCODE_OK, question, rr, 1)
