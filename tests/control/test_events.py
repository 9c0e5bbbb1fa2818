"""Bottle events: the hub's bounds (unit), and watchers over real sockets against the real
daemon with the fake smolvm (a TEST DOUBLE: a "VMM" is a host process the test can kill)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time
from typing import Any

import pytest
from twisted.internet.defer import Deferred

from bottlenet.bottles.events import BottleEvent, EventBus
from bottlenet.control import codec
from bottlenet.control import commands as C
from bottlenet.control.events import EventHub

from .daemon_helpers import ENV, REPO
from .vmdaemon import VMDaemon, wait_for


class FakeConnection:
    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.pending: list[Deferred[Any]] = []
        self.dropped: str | None = None

    def callRemote(self, commandType: Any, *a: Any, **kw: Any) -> Deferred[Any]:
        self.sent.append(kw["event"])
        d: Deferred[Any] = Deferred()
        self.pending.append(d)
        return d

    def drop(self, why: str) -> None:
        self.dropped = why


def test_hub_numbers_filters_and_bounds_each_watcher() -> None:
    bus = EventBus()
    hub = EventHub(bus.subscribe, max_unanswered=3)
    fast, slow, only_b2 = FakeConnection(), FakeConnection(), FakeConnection()
    assert hub.watch(fast) == 0
    hub.watch(slow)
    hub.watch(only_b2, "b2")
    for i in range(5):
        bus.emit(BottleEvent("created", "b1", float(i)))
        for d in fast.pending:  # the fast watcher answers every event
            d.callback({})
        fast.pending.clear()
    bus.emit(BottleEvent("destroyed", "b2", 9.0, detail="x"))
    assert [e.seq for e in fast.sent] == [1, 2, 3, 4, 5, 6]
    assert fast.dropped is None
    # the slow watcher got 3, then was cut off at the 4th (never buffered beyond the bound)
    assert [e.seq for e in slow.sent] == [1, 2, 3]
    assert slow.dropped is not None and "unanswered" in slow.dropped
    assert [(e.kind, e.bottle, e.detail) for e in only_b2.sent] == [("destroyed", "b2", "x")]
    assert hub.watchers == 2
    hub.forget(fast)
    hub.close()
    bus.emit(BottleEvent("created", "b1", 10.0))
    assert len(fast.sent) == 6


def test_a_connection_watches_a_bounded_number_of_bottles_by_name() -> None:
    from bottlenet.control.events import MAX_WATCHED
    from bottlenet.errors import InvalidArgument

    hub = EventHub(EventBus().subscribe)
    conn = FakeConnection()
    for i in range(MAX_WATCHED):
        hub.watch(conn, f"b{i}")
    hub.watch(conn, "b0")  # again: nothing new to hold
    with pytest.raises(InvalidArgument, match="watch every bottle"):
        hub.watch(conn, "one-more")
    hub.watch(conn)  # every bottle is still possible
    hub.watch(FakeConnection(), "one-more")  # the bound is per connection


@pytest.mark.skipif(os.geteuid() != 0, reason="exec-netns (unshare) needs root")
def test_events_json_created_ready_degraded_destroyed() -> None:
    d = VMDaemon().start()
    watcher: subprocess.Popen[bytes] | None = None
    try:
        watcher = subprocess.Popen(
            d.ctl_argv("events", "--json"), env=ENV, cwd=REPO, stdout=subprocess.PIPE
        )
        assert watcher.stdout is not None
        fd = watcher.stdout.fileno()
        buf = bytearray()

        def next_event(timeout: float = 60) -> dict[str, Any]:
            deadline = time.monotonic() + timeout
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                assert left > 0, "no event"
                if select.select([fd], [], [], left)[0]:
                    chunk = os.read(fd, 65536)
                    assert chunk, "bottlenetctl events ended"
                    buf.extend(chunk)
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            event: dict[str, Any] = json.loads(line)
            return event

        wait_for(lambda: "watches events" in d.log(), 30, "the watcher to subscribe")
        d.create_vm_bottle("b1")
        created, ready = next_event(), next_event()
        assert (created["kind"], created["bottle"], created["state"]) == (
            "created",
            "b1",
            "creating",
        )
        assert (ready["kind"], ready["state"]) == ("ready", "ready")
        assert ready["seq"] == created["seq"] + 1
        os.kill(d.machine_pid("bn-b1-sidecar"), signal.SIGKILL)
        killed = time.monotonic()
        degraded = next_event()
        latency = time.monotonic() - killed
        assert (degraded["kind"], degraded["bottle"]) == ("degraded", "b1")
        assert degraded["detail"] == "sidecar VM process exited"
        print(f"degraded event {latency * 1000:.0f} ms after the sidecar VMM was killed")
        r = d.ctl("bottle", "rm", "b1")
        assert r.returncode == 0, r.stderr
        destroyed = next_event()
        assert (destroyed["kind"], destroyed["bottle"]) == ("destroyed", "b1")
    finally:
        if watcher is not None:
            watcher.kill()
            watcher.wait()
        assert not d.cleanup()


def test_a_watcher_that_never_reads_is_cut_off() -> None:
    d = VMDaemon().start()
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(d.control)
        sock.sendall(codec.encode_request(C.Watch, b"1", {}))
        with d.client() as c:
            for i in range(60):  # 120 events; the bound is 64 unanswered
                c.create_bottle(f"f{i}")
                c.destroy_bottle(f"f{i}")
                if "unanswered events" in d.log():
                    break
            assert "unanswered events (it reads too slowly)" in d.log()
            c.ping()  # the daemon is fine
        # the slow watcher's connection is closed (after what was already in flight)
        sock.settimeout(30)
        while True:
            try:
                if not sock.recv(65536):
                    break
            except ConnectionResetError:
                break
        sock.close()
    finally:
        assert not d.cleanup()
