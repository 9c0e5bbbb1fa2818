"""D10: at the fd limit the listener backs off (no busy loop) and recovers once fds free up.

The limit is lowered in a child process (never in the test runner). The test runner holds the
client sockets and a threaded echo target, so only the child's relays count against its limit.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def echo_port() -> Iterator[int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(256)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                pass  # the relay resets connections it cannot serve

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    srv.close()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def backlog(port: int) -> int:
    """How many connections wait in the accept queue of the listener on 127.77.0.9:``port``
    (a listening socket's ``rx_queue`` in /proc/net/tcp, in this test's network namespace)."""
    (addr,) = struct.unpack("=I", socket.inet_aton("127.77.0.9"))
    local = f"{addr:08X}:{port:04X}"
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if fields[1] == local and fields[3] == "0A":
                return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"no listener on 127.77.0.9:{port}")


def sort_out(c: socket.socket, port: int, out: Lines, waiting: int) -> str:
    """What became of the ``x`` that ``c`` has sent: ``echoed``; ``ended`` (the relay reset or
    closed it); or ``waiting`` in the backlog (behind ``waiting`` earlier clients) once the
    listener has hit the fd limit. Events, never a timeout per client."""
    deadline = time.monotonic() + 60
    while True:
        if select.select([c], [], [], 0.02)[0]:
            try:
                return "echoed" if c.recv(1) == b"x" else "ended"
            except OSError:
                return "ended"
        if int(out.last("stats")) >= 1 and backlog(port) > waiting:
            return "waiting"  # the listener has paused: it waits with the others
        assert time.monotonic() < deadline, "neither relayed nor waiting after 60 s"


def echo_ok(c: socket.socket) -> bool:
    try:
        c.sendall(b"x")
        return c.recv(1) == b"x"
    except OSError:
        return False


class Lines:
    """Reads the child's stdout in a thread; ``last(prefix)`` is the newest such value."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)

    def last(self, prefix: str, timeout: float = 10) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in reversed(self.lines):
                if line.startswith(prefix):
                    return line.split()[1]
            time.sleep(0.02)
        raise AssertionError(f"no {prefix!r} line from the child")


def test_accept_backs_off_at_fd_limit_and_recovers(echo_port: int) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    child = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tests/forward/emfile_child.py"), str(echo_port), "40"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    clients: list[socket.socket] = []
    try:
        assert child.stdout is not None
        out = Lines(child.stdout)
        port = int(out.last("port"))
        working = []
        waited = 0
        for _ in range(30):  # more relays than 40 fds can hold
            c = socket.create_connection(("127.77.0.9", port), timeout=2)
            clients.append(c)
            c.sendall(b"x")
            fate = sort_out(c, port, out, waited)
            if fate == "echoed":
                working.append(c)
            waited += fate == "waiting"
        assert 5 < len(working) < 20, len(working)
        # At the limit: the child must idle, not spin on a readable listener.
        time.sleep(0.3)
        before = int(out.last("stats"))
        cpu0, t0 = cpu_seconds(child.pid), time.monotonic()
        time.sleep(1.5)
        cpu1, t1 = cpu_seconds(child.pid), time.monotonic()
        time.sleep(0.3)
        after = int(out.last("stats"))
        assert before >= 1, "accept never hit EMFILE"
        assert after - before < 40, f"{after - before} EMFILE retries in ~2 s: a busy loop"
        assert (cpu1 - cpu0) / (t1 - t0) < 0.5
        # Free fds: a connection that waited in the backlog is served after the backoff.
        for c in working:
            c.close()
        # The backlog is FIFO and every waiting client must still be there (none accepted
        # just to be reset while the limit lasted): the oldest one is served first.
        waiting = [c for c in clients if c not in working]
        waiting[0].settimeout(5)
        assert echo_ok(waiting[0]), "accepting did not resume after fds were freed"
        for c in clients:
            c.close()
        # Once the backlog is gone and its relays closed, new connections work normally.
        for _ in range(20):
            fresh = socket.create_connection(("127.77.0.9", port), timeout=5)
            fresh.settimeout(5)
            clients.append(fresh)
            if echo_ok(fresh):
                break
            time.sleep(0.25)
        else:
            raise AssertionError("new connections fail after the fd limit was left")
    finally:
        for c in clients:
            c.close()
        child.terminate()
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
