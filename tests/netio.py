"""Blocking helpers shared by the real-process tests: an echo target, a round trip, a log reader.

Everything here is plain sockets and threads (no reactor), for tests that drive a daemon in a
subprocess.
"""

from __future__ import annotations

import os
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def refusing_socket(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to a free port on ``host`` and never listening: a connect to that
    port is refused, and while the caller holds the socket no listener (a test's own server,
    a daemon's forward) can take the port. A port merely found free and closed again could be
    handed to the next ``bind(0)``, and a "refused" target would then answer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    return sock


@contextmanager
def echo_server(host: str = "127.0.0.1") -> Iterator[int]:
    """A threaded TCP echo server (one thread per connection); yields its port.

    It stands in for a sidecar's raw port. Connections are served concurrently, so a
    connection someone leaves open never holds up the next one.
    """
    srv = socket.create_server((host, 0), backlog=64)
    srv.settimeout(0.2)
    stop = threading.Event()
    workers: list[threading.Thread] = []

    def echo(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                pass

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(30)
            t = threading.Thread(target=echo, args=(conn,), daemon=True)
            t.start()
            workers.append(t)

    acceptor = threading.Thread(target=serve, daemon=True)
    acceptor.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        acceptor.join(5)
        srv.close()
        for t in workers:
            t.join(5)


def roundtrip(host: str, port: int, payload: bytes, timeout: float = 10) -> bytes:
    """Send ``payload``, half-close, and return everything read until EOF.

    The payload is sent from a second thread while this one reads: a client that writes
    everything before reading deadlocks against an echo once the payload outgrows the socket
    buffers on the way (how much they hold varies with memory pressure).
    """
    with socket.create_connection((host, port), timeout=timeout) as s:
        errors: list[BaseException] = []

        def send() -> None:
            try:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
            except BaseException as e:
                errors.append(e)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        chunks = []
        while data := s.recv(65536):
            chunks.append(data)
        sender.join(timeout)
    if errors:
        raise errors[0]
    return b"".join(chunks)


class OutputReader:
    """Reads a child's output by file descriptor and waits for a line matching a pattern.

    It reads with ``os.read`` and keeps its own buffer. A ``select`` on a pipe followed by a
    buffered ``readline()`` loses lines: ``readline`` pulls every line already written into
    the file object's buffer, and ``select`` then waits on an empty pipe while the line being
    waited for sits in that buffer (more likely the busier the machine, as more lines arrive
    in one read).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.seen = b""
        self._scanned = 0
        self.eof = False

    def wait_for(self, pattern: bytes | re.Pattern[bytes], timeout: float = 60) -> re.Match[bytes]:
        """The first match at or after the end of the previous one; AssertionError if none."""
        regex = re.compile(pattern) if isinstance(pattern, bytes) else pattern
        deadline = time.monotonic() + timeout
        while True:
            m = regex.search(self.seen, self._scanned)
            if m:
                self._scanned = m.end()
                return m
            left = deadline - time.monotonic()
            if self.eof or left <= 0:
                raise AssertionError(
                    f"no {regex.pattern!r} in the output:\n{self.seen.decode(errors='replace')}"
                )
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self.fd, 65536)
                self.eof = not chunk
                self.seen += chunk


def ping_tcp(host: str, port: int, payload: bytes = b"ping", timeout: float = 5) -> bytes:
    """One small write and one read on a fresh TCP connection (is an echo answering there?)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(payload)
        return s.recv(len(payload))


def ping_unix(path: str, payload: bytes = b"ping", timeout: float = 5) -> bytes:
    """:func:`ping_tcp` over a UNIX socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(payload)
        return s.recv(len(payload))


def pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy until ``src`` ends, then half-close ``dst`` (a failure just ends the copy)."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


class ConnectProxy:
    """An HTTP CONNECT proxy stand-in on a UNIX path or on ``127.0.0.1:port`` (0: any free).

    Each request line is kept in ``lines`` (a connection that sends nothing, such as a
    readiness probe, is not). ``route(target)`` says where an allowed target goes, ``(host,
    port)``; None refuses it with 403 and a close. With ``forward_head`` the request itself is
    sent on to that upstream (a real proxy there answers it), else this one answers 200 and
    tunnels."""

    def __init__(
        self,
        where: str | int,
        route: Callable[[str], tuple[str, int] | None],
        *,
        forward_head: bool = False,
    ) -> None:
        self.lines: list[str] = []
        self.route = route
        self.forward_head = forward_head
        if isinstance(where, str):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(where)
        else:
            self.sock = socket.socket()
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(("127.0.0.1", where))
        self.port = 0 if isinstance(where, str) else int(self.sock.getsockname()[1])
        self.sock.listen(64)
        threading.Thread(target=self._loop, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 8192:
                chunk = conn.recv(8192)
                if not chunk:
                    break
                head += chunk
            if not head:
                return
            line = head.split(b"\r\n", 1)[0].decode("ascii", "replace")
            self.lines.append(line)
            words = line.split()
            upstream = self.route(words[1]) if len(words) == 3 and words[0] == "CONNECT" else None
            if upstream is None:
                conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                return
            with socket.create_connection(upstream) as up:
                if self.forward_head:
                    up.sendall(head)
                else:
                    conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                t = threading.Thread(target=pump, args=(conn, up), daemon=True)
                t.start()
                pump(up, conn)
                t.join(30)
