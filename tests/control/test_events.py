"""Bottle events: the hub's bounds (unit); a VM bottle's events in order, in process (the
registry and the hub on a clock with the in-memory smolvm, ``tests/bottles/memsmolvm.py``, a
TEST DOUBLE; a real process stands in for the sidecar's VMM, so the test can kill it); and
watchers over real sockets against the daemon in process (``tests/bottles/harness.py``: the
tap's real service tree), the one in the event flow ``bottlenetctl events --json`` as a person
runs it."""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
from twisted.internet.defer import Deferred

from bottlenet.bottles.events import BottleEvent, EventBus
from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.control import codec
from bottlenet.control import commands as C
from bottlenet.control.events import EventHub
from tests.bottles.harness import DaemonCase, in_thread, spec_doc
from tests.bottles.memsmolvm import Rig

from .daemon_helpers import ENV, REPO


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


@pytest.fixture
def rig() -> Iterator[Rig]:
    """The bottles layer on a clock with the in-memory smolvm, in a short private directory."""
    path = tempfile.mkdtemp(prefix="bnu-", dir="/tmp")
    rig = Rig(os.path.join(path, "s"))
    yield rig
    rig.close()
    shutil.rmtree(path, True)


def test_a_vm_bottles_events_are_numbered_in_order(rig: Rig) -> None:
    """A watcher gets a VM bottle's events numbered in order: created (``creating``), ready,
    degraded when its sidecar's VMM exits (naming why), destroyed."""
    vmm = subprocess.Popen(["sleep", "600"])  # the sidecar's VMM: a process the test kills
    try:
        rig.smolvm.pid = vmm.pid
        watcher = FakeConnection()
        EventHub(rig.registry.events.subscribe).watch(watcher)
        doc = spec_doc(os.path.dirname(rig.state_dir))
        rig.run(rig.registry.create_bottle("b1", spec=parse_bottle_spec("b1", doc)))
        created, ready = watcher.sent
        assert (created.kind, created.bottle, created.state) == ("created", "b1", "creating")
        assert (ready.kind, ready.state) == ("ready", "ready")
        assert ready.seq == created.seq + 1
        vmm.kill()
        vmm.wait()
        assert rig.clock.poll(30) == 1  # the sidecar's pidfd, readable: its process exited
        rig.settle()
        degraded = watcher.sent[2]
        assert (degraded.kind, degraded.bottle) == ("degraded", "b1")
        assert degraded.detail == "sidecar VM process exited"
        rig.run(rig.registry.destroy_bottle("b1"))
        destroyed = watcher.sent[3]
        assert (destroyed.kind, destroyed.bottle) == ("destroyed", "b1")
        assert [e.seq for e in watcher.sent] == [1, 2, 3, 4]
    finally:
        vmm.kill()
        vmm.wait()


class JSONLines:
    """Reads one JSON document a line from a child's stdout (blocking: call it off the reactor)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()

    def next(self, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            assert left > 0, "no event"
            if select.select([self.fd], [], [], left)[0]:
                chunk = os.read(self.fd, 65536)
                assert chunk, "bottlenetctl events ended"
                self.buf.extend(chunk)
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf[:] = rest
        event: dict[str, Any] = json.loads(line)
        return event


def drain_until_closed(sock: socket.socket) -> None:
    """Read until the daemon closes ``sock`` (after what was already in flight)."""
    sock.settimeout(30)
    while True:
        try:
            if not sock.recv(65536):
                break
        except ConnectionResetError:
            break


class EventFlowTests(DaemonCase):
    timeout = 300  # a VM bottle through the fake: slow on a loaded machine

    async def test_events_json_numbers_a_bottles_events(self) -> None:
        """``bottlenetctl events --json`` prints a bottle's created, ready and destroyed
        events as JSON lines, numbered in order (a VM bottle's whole flow, degraded included,
        is checked in process above)."""
        client = await self.start(vm_bottles=False)
        argv = self.ctl_argv("events", "--json")
        watcher = subprocess.Popen(argv, env=ENV, cwd=REPO, stdout=subprocess.PIPE)
        try:
            assert watcher.stdout is not None
            lines = JSONLines(watcher.stdout.fileno())
            await self.when_logged("watches events")
            await client.create_bottle("f1")
            created, ready = await in_thread(lines.next), await in_thread(lines.next)
            assert (created["kind"], created["bottle"], created["state"]) == (
                "created",
                "f1",
                "ready",
            )
            assert (ready["kind"], ready["state"]) == ("ready", "ready")
            assert ready["seq"] == created["seq"] + 1
            r = await self.ctl("bottle", "rm", "f1")
            assert r.returncode == 0, r.stderr
            destroyed = await in_thread(lines.next)
            assert (destroyed["kind"], destroyed["bottle"]) == ("destroyed", "f1")
            assert destroyed["seq"] == ready["seq"] + 1
        finally:
            watcher.kill()
            watcher.wait()
            if watcher.stdout is not None:
                watcher.stdout.close()

    async def test_a_watcher_that_never_reads_is_cut_off(self) -> None:
        """A watcher that never reads is dropped at 64 unanswered events; the daemon serves on."""
        client = await self.start(vm_bottles=False)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(self.control)
            sock.sendall(codec.encode_request(C.Watch, b"1", {}))
            for i in range(60):  # 120 events; the bound is 64 unanswered
                await client.create_bottle(f"f{i}")
                await client.destroy_bottle(f"f{i}")
                if "unanswered events" in self.log_text():
                    break
            assert "unanswered events (it reads too slowly)" in self.log_text()
            await client.ping()  # the daemon is fine
            # the slow watcher's connection is closed (after what was already in flight)
            await in_thread(drain_until_closed, sock)
        finally:
            sock.close()
