"""An idle forward table makes no periodic wakeups, with forwards and idle relays open.

The table runs in a child process on a reactor that counts its iterations (returns from
epoll_wait); the test opens relays through every forward, proves each with an echo, then
compares the count across a quiet period. One query costs one wakeup (reading stdin), so a
quiet second must add at most that; any periodic timer (a LoopingCall, a backoff or rate-limit
timer left running, a timeout per relay) would add many.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from bottlenet.forward.splice import splice_supported
from tests.forward.idle_child import ALIASES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUIET_SECONDS = 2.0


class Child:
    def __init__(self, engine: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forward.idle_child", engine],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT),
        )

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def polls(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        word, value = self.line().split()
        assert word == "polls"
        return int(value)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(params=["portable", "splice"])
def child(request: pytest.FixtureRequest) -> Iterator[Child]:
    if request.param == "splice" and not splice_supported():
        pytest.skip("splice() is Linux-only")
    c = Child(request.param)
    try:
        yield c
    finally:
        c.close()


def test_idle_daemon_makes_no_periodic_wakeups(child: Child) -> None:
    ready = child.line().split()
    assert ready[0] == "ready", ready
    ports = [int(p) for p in ready[1:]]
    clients = []
    try:
        for alias, port in zip(ALIASES, ports, strict=True):
            for _ in range(5):
                c = socket.create_connection((alias, port), timeout=5)
                c.sendall(b"ping")
                assert c.recv(4) == b"ping"
                clients.append(c)
        time.sleep(0.3)  # let any one-shot work after the echoes finish
        first = child.polls()
        time.sleep(QUIET_SECONDS)
        second = child.polls()
        # The second query itself wakes the reactor once (stdin readable).
        assert second - first <= 2, f"{second - first} wakeups in {QUIET_SECONDS} s of quiet"
        for c in clients:  # still relaying after the quiet period
            c.sendall(b"pong")
            assert c.recv(4) == b"pong"
    finally:
        for c in clients:
            c.close()
