"""The netlink wire format, for exactly what the guest side sends: messages, attributes, acks,
dumps.

A message is ``nlmsghdr`` + a family header + attributes (type, length, payload padded to 4
bytes; a nested attribute holds attributes). ``Netlink.transact`` sends a list of requests in
one datagram, each asking for an ack, and returns the first error as :class:`NetlinkError`
naming the request it answered, so a caller can say which piece of the kernel refused.
``Netlink.dump`` reads one dump (the layer's routes and the gate's link report, ``links.py``).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Callable, Sequence

NETLINK_ROUTE = 0
NETLINK_NETFILTER = 12
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLM_F_REPLACE = 0x100
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
NLMSG_ERROR = 0x2
NLMSG_DONE = 0x3
NLA_F_NESTED = 0x8000
_HDR = struct.Struct("=IHHII")
#: The largest answer the layer reads (acks and errors are small; an error echoes its request).
RECV_SIZE = 65536
#: The most messages one dump may bring (a guest has a handful of links, addresses, routes).
MAX_DUMP = 4096


class NetlinkError(Exception):
    """The kernel refused request ``index`` (``errno``); ``what`` is the caller's name for it."""

    def __init__(self, err: int, index: int, what: str) -> None:
        super().__init__(f"{what}: {os.strerror(err)} ({errno.errorcode.get(err, err)})")
        self.errno = err
        self.index = index
        self.what = what


def align(n: int) -> int:
    return (n + 3) & ~3


def attr(kind: int, payload: bytes) -> bytes:
    """One attribute, padded to 4 bytes."""
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (align(length) - length)


def nest(kind: int, *attrs: bytes) -> bytes:
    return attr(kind | NLA_F_NESTED, b"".join(attrs))


def u32be(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("!I", value & 0xFFFFFFFF))


def s32be(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("!i", value))


def string(kind: int, value: str) -> bytes:
    return attr(kind, value.encode() + b"\0")


def message(kind: int, flags: int, seq: int, body: bytes) -> bytes:
    return _HDR.pack(_HDR.size + len(body), kind, flags, seq, 0) + body


def parse_attrs(data: bytes) -> dict[int, bytes]:
    """A flat attribute list as {type (without flags): payload}; a malformed one ends it."""
    out: dict[int, bytes] = {}
    at = 0
    while at + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, at)
        if length < 4 or at + length > len(data):
            break
        out[kind & 0x3FFF] = data[at + 4 : at + length]
        at += align(length)
    return out


def replies(data: bytes) -> list[tuple[int, int, bytes]]:
    """The messages of one datagram as (type, seq, body)."""
    out = []
    at = 0
    while at + _HDR.size <= len(data):
        length, kind, _flags, seq, _pid = _HDR.unpack_from(data, at)
        if length < _HDR.size or at + length > len(data):
            break
        out.append((kind, seq, data[at + _HDR.size : at + length]))
        at += align(length)
    return out


Request = tuple[int, int, bytes, str]  # (type, flags, body, what it is called)


class Netlink:
    """One netlink socket of ``protocol``; ``opener`` is injectable for tests."""

    def __init__(
        self,
        protocol: int,
        opener: Callable[[int], socket.socket] | None = None,
        timeout: float = 5.0,
    ) -> None:
        open_ = opener or (lambda p: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, p))
        self.sock = open_(protocol)
        self.sock.settimeout(timeout)
        self.sock.bind((0, 0))
        self.seq = 1

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Netlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def transact(self, requests: Sequence[Request], acked: Sequence[int] = ()) -> None:
        """Send ``requests`` in one datagram; wait for the ack of each index in ``acked``
        (every request when empty). Raises the first error, for the request it answers."""
        first = self.seq
        self.seq += len(requests)
        wanted = set(range(len(requests))) if not acked else set(acked)
        data = b"".join(
            message(kind, flags | NLM_F_REQUEST | (NLM_F_ACK if i in wanted else 0), first + i, b)
            for i, (kind, flags, b, _what) in enumerate(requests)
        )
        self.sock.send(data)
        while wanted:
            for kind, seq, body in replies(self.sock.recv(RECV_SIZE)):
                index = seq - first
                if kind != NLMSG_ERROR or not 0 <= index < len(requests) or len(body) < 4:
                    continue
                (code,) = struct.unpack_from("=i", body)
                if code:
                    raise NetlinkError(-code, index, requests[index][3])
                wanted.discard(index)

    def dump(self, kind: int, body: bytes, what: str) -> list[tuple[int, bytes]]:
        """Every message (type, body) of one dump request; NetlinkError when the kernel
        refuses it, or when it brings more than :data:`MAX_DUMP` messages (``E2BIG``)."""
        seq = self.seq
        self.seq += 1
        self.sock.send(message(kind, NLM_F_REQUEST | NLM_F_DUMP, seq, body))
        out: list[tuple[int, bytes]] = []
        while True:
            for got, at, payload in replies(self.sock.recv(RECV_SIZE)):
                if at != seq:
                    continue
                if got == NLMSG_DONE:
                    return out
                if got == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", payload) if len(payload) >= 4 else (0,)
                    raise NetlinkError(-code or errno.EPROTO, 0, what)
                if len(out) >= MAX_DUMP:
                    raise NetlinkError(errno.E2BIG, 0, what)
                out.append((got, payload))
