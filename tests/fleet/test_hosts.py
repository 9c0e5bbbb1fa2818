"""The placing process's table of hosts (``bottlenet.fleet.hosts``) without a cluster: Ray's
actor start, ``wait`` and ``kill`` are fakes here; tests/fleet/test_inprocess.py runs the real
ones."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import pytest

from bottlenet.fleet import hosts
from bottlenet.fleet.hosts import JobHosts
from tests.control.daemon_helpers import ENV, REPO

#: Three nodes (Ray checks a node id is 28 bytes of hex).
A, B, C = ("a" * 56, "b" * 56, "c" * 56)


@attrs.define(eq=False)
class FakeRef:
    """A host's ``keep`` call: resolved once the host has ended."""

    number: int
    ended: bool = False

    def hex(self) -> str:
        return f"{self.number:040x}"


@attrs.define(eq=False)
class FakeHost:
    node: str
    owner: Any
    label: str
    keeper: FakeRef

    @property
    def keep(self) -> _Keep:
        return _Keep(self.keeper)


@attrs.define
class _Keep:
    """``host.keep`` as Ray's method handle: ``remote()`` is the call's ObjectRef."""

    ref: FakeRef

    def remote(self) -> FakeRef:
        return self.ref


@attrs.define
class FakeRay:
    """Ray's actor start (as ``_RemoteHost``), ``wait`` and ``kill`` as the table uses them."""

    started: list[FakeHost] = attrs.field(factory=list)
    killed: list[FakeHost] = attrs.field(factory=list)
    #: called with each host as it is started (another thread's work, in a test)
    on_start: Callable[[FakeHost], None] = lambda host: None
    _node: str = ""

    def options(self, **options: Any) -> FakeRay:
        self._node = options["scheduling_strategy"].node_id
        return self

    def remote(self, owner: Any, label: str) -> FakeHost:
        host = FakeHost(self._node, owner, label, FakeRef(len(self.started)))
        self.started.append(host)
        self.on_start(host)
        return host

    def wait(
        self, refs: Sequence[FakeRef], *, num_returns: int, timeout: float
    ) -> tuple[list[FakeRef], list[FakeRef]]:
        assert timeout == 0  # the table never blocks on a host
        return [r for r in refs if r.ended], [r for r in refs if not r.ended]

    def kill(self, host: FakeHost) -> None:
        self.killed.append(host)

    def get_runtime_context(self) -> Any:
        return _Context()


class _Context:
    def get_job_id(self) -> str:
        return "01"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeRay:
    fake = FakeRay()
    monkeypatch.setattr(hosts, "_RemoteHost", fake)
    monkeypatch.setattr(hosts, "ray", fake)
    return fake


def test_one_host_per_node_started_once_with_the_owner(fake: FakeRay) -> None:
    """The first call starts a host on each node with the owner's handle and label; later
    calls reuse them, and only a new node gets a new host."""
    table = JobHosts("owner", "ray-job-01")
    first = table.on([B, A, B])
    assert sorted(first) == [A, B]
    assert [(h.node, h.owner, h.label) for h in fake.started] == [
        (A, "owner", "ray-job-01"),
        (B, "owner", "ray-job-01"),
    ]
    again = table.on([A, C])
    assert again[A] is first[A] and again[C].node == C
    assert len(fake.started) == 3 and fake.killed == []


def test_a_host_that_ended_is_replaced_on_its_node_only(fake: FakeRay) -> None:
    """A host whose ``keep`` call resolved (its owner gone, or it died) is dropped: the next
    call starts another on that node and keeps the other nodes' hosts."""
    table = JobHosts("owner", "ray-job-01")
    first = table.on([A, B])
    first[A].keeper.ended = True
    second = table.on([A, B])
    assert second[A] is not first[A] and second[A].node == A
    assert second[B] is first[B]


def test_forget_drops_only_the_host_it_names(fake: FakeRay) -> None:
    """``forget`` with a host's handle drops it; with a handle that is no longer the node's
    host (another was started since) it drops nothing."""
    table = JobHosts("owner", "ray-job-01")
    old = table.on([A])[A]
    table.forget(A, old)
    new = table.on([A])[A]
    assert new is not old
    table.forget(A, old)
    assert table.on([A])[A] is new


def test_two_threads_starting_one_nodes_host_keep_one_and_kill_the_other(fake: FakeRay) -> None:
    """A thread that finds another's host published while it started its own (the race of
    two first placements) uses that one and kills its own, which holds nothing yet: one
    host per node, no lock."""
    table = JobHosts("owner", "ray-job-01")
    rival = FakeHost(A, "owner", "ray-job-01", FakeRef(99))

    def other_thread_publishes(host: FakeHost) -> None:
        table._hosts.setdefault(A, hosts._Host(rival, rival.keeper))

    fake.on_start = other_thread_publishes
    got = table.on([A])[A]
    assert got is rival
    assert fake.killed == fake.started and len(fake.started) == 1


def test_the_hosts_of_an_owner_are_one_table(
    fake: FakeRay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hosts_of`` gives every placement of one owner the same table (so one host per node),
    another owner another; its bottles' owner label is the job's."""
    monkeypatch.setattr(hosts, "_by_owner", {})
    one = hosts.hosts_of("owner-1")
    assert hosts.hosts_of("owner-1") is one
    assert one.owner_label == "ray-job-01"
    assert hosts.hosts_of("owner-2") is not one


def test_a_hosts_worker_imports_neither_the_placer_nor_the_pool() -> None:
    """A Ray worker that starts a host imports ``bottlenet.fleet.host`` (and so the package):
    not the placer, the pool and its progress bar, which a trainer's first pool would wait
    for on every node (``bottlenet/fleet/__init__.py`` imports its names on first use)."""
    probe = (
        "import sys, bottlenet.fleet.host; "
        "print(' '.join(m for m in ('bottlenet.fleet.placement', 'bottlenet.fleet.pool') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=ENV, cwd=REPO, capture_output=True, check=True
    )
    assert out.stdout.decode().split() == []
