"""The listener every redirected TCP connect arrives at, and the resolver beside it.

Each accepted connection's original destination comes from ``SO_ORIGINAL_DST`` (IPv4:
``SOL_IP``/80; IPv6: ``SOL_IPV6``/80). A connection made to the listener itself (not
redirected: its original destination is loopback) is refused, or it would loop. A fake
address is mapped back to its name; the listener then opens ``CONNECT name:port`` (or
``ip:port``, ``[v6]:port``) on the named service's mounted socket, and on a 2xx answer relays
bytes both ways with half-close. Any other answer, or none, ends the client's connection with
a reset (``SO_LINGER`` 0): to a client a refused destination looks like "connected, then
reset". At most ``MAX_CONNECTIONS`` at a time (more wait in the listen backlog); each one is
reported as ``BNE conn <target> <outcome>`` (never a payload byte).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
import threading
import time
from collections.abc import Callable

from bottlenet.transparent.names import MAX_QUERY, NameTable, answer
from bottlenet.transparent.relay import pump, spawn

SO_ORIGINAL_DST = 80
SOL_IPV6 = 41
MAX_CONNECTIONS = 256
CHUNK = 64 * 1024
#: The longest proxy answer head read before the relay (status line and headers).
MAX_HEAD = 8192
#: How long the proxy may take to answer a CONNECT.
CONNECT_TIMEOUT = 30.0
OK, REFUSED, UNREACHABLE, LOOP, UNKNOWN = "ok", "refused", "unreachable", "loop", "unknown"

Report = Callable[[str, str], None]


def original_dst(conn: socket.socket, family: int) -> tuple[str, int] | None:
    """Where the client meant to connect, None when the kernel has no record of it."""
    try:
        if family == socket.AF_INET6:
            raw = conn.getsockopt(SOL_IPV6, SO_ORIGINAL_DST, 28)
            return socket.inet_ntop(socket.AF_INET6, raw[8:24]), struct.unpack("!H", raw[2:4])[0]
        raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        return socket.inet_ntoa(raw[4:8]), struct.unpack("!H", raw[2:4])[0]
    except OSError:
        return None


def is_loopback(host: str) -> bool:
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def target_of(host: str, port: int, table: NameTable, lock: threading.Lock) -> str | None:
    """``name:port`` for a fake address (None once forgotten), else the literal's."""
    if table.owns(host):
        with lock:
            name = table.name(host)
        return None if name is None else f"{name}:{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def reset(sock: socket.socket) -> None:
    """Close with a reset: the client sees its connection refused by the far end."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """The proxy's answer head and whatever followed it (b"" head: none within bounds)."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD:
            return b"", b""
        chunk = sock.recv(4096)
        if not chunk:
            return b"", b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def answered(head: bytes) -> bool:
    words = head.split(b"\r\n", 1)[0].split()
    return (
        len(words) >= 2
        and words[0].startswith(b"HTTP/1.")
        and len(words[1]) == 3
        and words[1][:1] == b"2"
    )


def open_tunnel(path: str, target: str) -> tuple[socket.socket | None, str, bytes]:
    """A tunnel to ``target`` through the proxy at ``path``: (socket, OK, early bytes), or
    (None, REFUSED or UNREACHABLE, b"")."""
    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    up.settimeout(CONNECT_TIMEOUT)
    try:
        up.connect(path)
    except OSError:
        up.close()
        return None, UNREACHABLE, b""
    try:
        up.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        head, rest = read_head(up)
    except OSError:
        up.close()
        return None, UNREACHABLE, b""
    if not answered(head):
        up.close()
        return None, REFUSED, b""
    up.settimeout(None)
    return up, OK, rest


class Listener:
    """The listener and resolver of one layer: ``proxy`` is the mounted socket of the
    service named by ``transparent_egress``."""

    def __init__(
        self,
        proxy: str,
        port: int,
        report: Report,
        table: NameTable | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.proxy = proxy
        self.port = port
        self.report = report
        self.table = table if table is not None else NameTable()
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(max_connections)
        self.sockets: list[tuple[socket.socket, int]] = []
        self.resolvers: list[socket.socket] = []

    def bind(self) -> None:
        """The TCP listeners (127.0.0.1 and, where the kernel has IPv6, [::1]) and the
        resolver's sockets (127.0.0.53:53, [::1]:53); raises OSError when one cannot bind."""
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            s = _bound(family, socket.SOCK_STREAM, (host, self.port), optional=family != 2)
            if s is not None:
                s.listen(128)
                self.sockets.append((s, family))
        for family, host in ((socket.AF_INET, "127.0.0.53"), (socket.AF_INET6, "::1")):
            d = _bound(family, socket.SOCK_DGRAM, (host, 53), optional=family != 2)
            if d is not None:
                self.resolvers.append(d)

    def start(self) -> None:
        for s, family in self.sockets:
            spawn(self.accept_loop, s, family)
        for d in self.resolvers:
            spawn(self.resolve_loop, d)

    def close(self) -> None:
        for s, _ in self.sockets:
            s.close()
        for d in self.resolvers:
            d.close()

    def resolve_loop(self, sock: socket.socket) -> None:
        while True:
            try:
                query, peer = sock.recvfrom(MAX_QUERY + 1)
            except OSError as e:
                if e.errno == errno.EBADF:
                    return
                continue
            with self.lock:
                reply = answer(query, self.table)
            if reply is not None:
                try:
                    sock.sendto(reply, peer)
                except OSError:
                    pass

    def accept_loop(self, listener: socket.socket, family: int) -> None:
        while True:
            self.slots.acquire()
            try:
                conn, _ = listener.accept()
            except OSError as e:
                self.slots.release()
                if e.errno == errno.EBADF:
                    return
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(0.1)
                continue
            try:
                spawn(self.handle, conn, family)
            except RuntimeError:  # no thread to be had: this connection ends
                reset(conn)
                self.slots.release()

    def handle(self, conn: socket.socket, family: int) -> None:
        try:
            self._handle(conn, family)
        finally:
            self.slots.release()

    def _handle(self, conn: socket.socket, family: int) -> None:
        dst = original_dst(conn, family)
        if dst is None or is_loopback(dst[0]):
            self.report("-", LOOP)  # made to the listener itself: refused, it would loop
            reset(conn)
            return
        target = target_of(dst[0], dst[1], self.table, self.lock)
        if target is None:
            self.report(f"{dst[0]}:{dst[1]}", UNKNOWN)
            reset(conn)
            return
        up, outcome, early = open_tunnel(self.proxy, target)
        self.report(target, outcome)
        if up is None:
            reset(conn)
            return
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if early:
                conn.sendall(early)
            t = spawn(pump, conn, up, CHUNK)
            pump(up, conn, CHUNK)
            t.join()
        except (OSError, RuntimeError):
            pass
        finally:
            conn.close()
            up.close()


def _bound(family: int, kind: int, addr: tuple[str, int], optional: bool) -> socket.socket | None:
    try:
        s = socket.socket(family, kind)
    except OSError:
        if optional:
            return None
        raise
    try:
        if kind == socket.SOCK_STREAM:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind(addr)
    except OSError as e:
        s.close()
        if optional and e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            return None
        raise
    return s
