"""Warm pools (issue 38 item 3): a pool keeps bottles of its spec booted, gated and bridged
with no workload; a create of that spec takes one (its name, tenancy, workload), the pool
fills again; members count against the cap, survive a restart, stop filling while the node
drains, are replaced when one degrades, and are listed apart. In process, on a clock, with
the in-memory smolvm (``tests/bottles/memsmolvm.py``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from bottlenet.bottles.bottle import VMBottle
from bottlenet.bottles.events import BottleEvent
from bottlenet.bottles.pooled import PoolUse, spec_hash
from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.bottles.states import Lifecycle
from bottlenet.bottles.store import StateStore
from bottlenet.bottles.tenancy import Tenancy
from bottlenet.errors import InvalidArgument, ResourceExhausted
from bottlenet.forward.spec import bottle_dir
from bottlenet.node.info import Node
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import Rig, node_of
from vmctl.errors import SmolvmFailed

Rigs = Callable[..., Rig]


def started(rig: Rig, node: Node) -> Node:
    rig.recover()
    node.pools.start()
    rig.settle()
    return node


def pooled(rigs: Rigs, tmp: str, size: int) -> tuple[Rig, Node, dict[str, Any]]:
    """A started node whose one pool of ``size`` members is filled."""
    rig = rigs()
    node = started(rig, node_of(rig))
    doc = doc_of(tmp)
    node.pools.ensure(doc, size)
    rig.settle()
    return rig, node, doc


def doc_of(tmp: str, **kw: Any) -> dict[str, Any]:
    return spec_doc(tmp, workload=("/bin/sleep", "100"), **kw)


def ready(node: Node, doc: dict[str, Any]) -> int:
    return node.pools.report(spec_hash(doc)).ready


def create(rig: Rig, name: str, doc: dict[str, Any], **kw: Any) -> Any:
    return rig.run(rig.registry.create_bottle(name, spec=parse_bottle_spec(name, doc), **kw))


def test_a_pool_fills_and_a_create_of_its_spec_takes_a_member(rigs: Rigs, tmp: str) -> None:
    """Two members are made without their workload and are not listed; a create of the
    spec takes one (no new machine), is named, leased and runs its workload; the pool
    fills again."""
    rig, node, doc = pooled(rigs, tmp, 2)
    assert ready(node, doc) == 2
    assert rig.registry.list_bottles() == [] and rig.registry.held() == 2
    machines = set(rig.smolvm.names())
    assert len(machines) == 4
    assert not any("sleep" in " ".join(argv) for _, argv in rig.smolvm.execs)
    seen: list[BottleEvent] = []
    rig.registry.events.subscribe(seen.append)
    bottle = create(rig, "job1", doc, tenancy=Tenancy(owner="me", lease=None))
    assert bottle.name == "job1" and bottle.tenancy.owner == "me" and bottle.pool is None
    vm = bottle.require_vms()
    assert vm.home is not None and vm.home.startswith("p-")
    assert {vm.sidecar_vm, vm.agent_vm} <= machines  # a member's machines: nothing booted
    assert ("BOTTLENET_BOTTLE", "job1") in vm.env and vm.workload == "running"
    assert any("sleep" in " ".join(argv) for name, argv in rig.smolvm.execs if name == vm.agent_vm)
    assert [e.kind for e in seen if e.bottle == "job1"] == ["created", "ready"]
    assert [b.name for b in rig.registry.list_bottles()] == ["job1"]
    assert [f.spec.bottle for f in rig.registry.list_forwards("job1")] == ["job1", "job1"]
    assert rig.state()["job1"]["home"] == vm.home and vm.home not in rig.state()
    rig.settle()  # the refill, on the next turn
    assert ready(node, doc) == 2 and rig.registry.held() == 3
    rig.run(rig.registry.destroy_bottle("job1"))
    assert vm.agent_vm not in rig.smolvm.names()
    assert not os.path.exists(bottle_dir(rig.state_dir, vm.home))


def test_a_create_with_another_spec_or_pool_off_boots(rigs: Rigs, tmp: str) -> None:
    """Only the same spec document takes a member; ``pool off`` never does; ``pool only``
    with none ready is RESOURCE_EXHAUSTED at once."""
    rig, node, doc = pooled(rigs, tmp, 1)
    other = create(rig, "other", doc_of(tmp, egress=False))
    assert other.require_vms().home is None
    off = create(rig, "off", doc, pool=PoolUse.OFF)
    assert off.require_vms().home is None and ready(node, doc) == 1
    with pytest.raises(ResourceExhausted):
        create(rig, "only", doc_of(tmp, egress=False), pool=PoolUse.ONLY)
    assert create(rig, "taken", doc, pool=PoolUse.ONLY).require_vms().home is not None


def test_members_count_against_the_cap(rigs: Rigs, tmp: str) -> None:
    """A pool fills only into room under --max-bottles; a taken member counts once; a
    bottle leaving lets the pool fill again."""
    rig = rigs(max_bottles=3)
    node = started(rig, node_of(rig))
    doc = doc_of(tmp)
    create(rig, "plain", doc_of(tmp, egress=False))
    node.pools.ensure(doc, 3)
    rig.settle()
    assert ready(node, doc) == 2 and rig.registry.held() == 3
    create(rig, "job", doc)
    rig.settle()
    assert rig.registry.held() == 3 and ready(node, doc) == 1
    with pytest.raises(ResourceExhausted):
        create(rig, "more", doc_of(tmp, egress=False))
    rig.run(rig.registry.destroy_bottle("plain"))
    rig.settle()
    assert ready(node, doc) == 2


def test_a_pool_and_its_members_survive_a_restart(rigs: Rigs, tmp: str) -> None:
    """The pool is the node's record; its members are restored as members (not listed, not
    made again), and a create after the restart takes one."""
    first = rigs()
    node = started(first, node_of(first))
    doc = doc_of(tmp)
    node.pools.ensure(doc, 2)
    first.settle()
    create(first, "job", doc)
    first.settle()
    homes = {h for h, _ in first.registry.members(spec_hash(doc))}
    machines = set(first.smolvm.names())
    first.close()
    second = rigs(smolvm=first.smolvm)
    node = started(second, node_of(second))
    assert {h for h, _ in second.registry.members(spec_hash(doc))} == homes
    assert ready(node, doc) == 2 and set(second.smolvm.names()) == machines
    assert [b.name for b in second.registry.list_bottles()] == ["job"]
    assert second.registry.get_bottle("job").require_vms().home is not None
    assert create(second, "job2", doc).require_vms().home in homes


def test_a_crash_between_the_records_keeps_the_taken_bottle(rigs: Rigs, tmp: str) -> None:
    """A take writes the bottle's record before it removes the member's: a crash between
    leaves both, and recovery keeps the taken bottle, its machines and its directory."""
    first = rigs()
    node = started(first, node_of(first))
    doc = doc_of(tmp)
    node.pools.ensure(doc, 1)
    first.settle()
    home = next(iter(first.registry.members(spec_hash(doc))))[0]
    member_record = first.state()[home]
    node.pools.stop()  # no refill: the crash comes first
    create(first, "job", doc)
    first.store.put(home, member_record)  # as if the removal never reached the disk
    first.close()
    second = rigs(smolvm=first.smolvm)
    node = started(second, node_of(second))
    vm = second.registry.get_bottle("job").require_vms()
    assert vm.home == home and vm.agent_vm in second.smolvm.names()
    assert home not in second.state() and os.path.isdir(bottle_dir(second.state_dir, home))
    assert home not in {h for h, _ in second.registry.members(spec_hash(doc))}


def test_draining_stops_refills_and_empties_the_pools(rigs: Rigs, tmp: str) -> None:
    """A drain destroys the waiting members and makes none; an undrain fills again."""
    rig, node, doc = pooled(rigs, tmp, 2)
    node.drain()
    rig.settle()
    assert rig.registry.held() == 0 and ready(node, doc) == 0
    assert rig.result(rig.start(node.when_empty(5)))
    node.pools.ensure(doc, 3)
    rig.settle()
    assert rig.registry.held() == 0
    node.undrain()
    rig.settle()
    assert ready(node, doc) == 3


def test_a_degraded_member_is_replaced(rigs: Rigs, tmp: str) -> None:
    """A member whose sidecar exits is destroyed and another made; no event reaches the
    wire."""
    rig, _, doc = pooled(rigs, tmp, 1)
    seen: list[BottleEvent] = []
    rig.registry.events.subscribe(seen.append)
    home = next(iter(rig.registry.members(spec_hash(doc))))[0]
    member = rig.registry._owners[home]
    assert isinstance(member, VMBottle)
    member.sidecar_exited()
    rig.settle()
    members = rig.registry.members(spec_hash(doc))
    assert [p for _, p in members] == [Lifecycle.POOLED] and members[0][0] != home
    assert seen == []


def test_a_failed_fill_is_counted_and_retried_after_a_back_off(rigs: Rigs, tmp: str) -> None:
    """A fill whose sidecar does not start is counted with its error and tried again after
    1 s, then 2 s; once one succeeds the pool is full."""
    rig = rigs()
    node = started(rig, node_of(rig))
    doc = doc_of(tmp)
    rig.smolvm.fail_on("start", "*-sidecar", SmolvmFailed("injected: no start"))
    node.pools.ensure(doc, 1)
    rig.settle()
    report = node.pools.report(spec_hash(doc))
    assert (report.ready, report.failed) == (0, 1) and "injected" in (report.detail or "")
    rig.clock.advance(1)
    rig.settle()
    assert node.pools.report(spec_hash(doc)).failed == 2
    rig.clock.advance(1.5)
    rig.settle()
    assert ready(node, doc) == 0 and node.pools.report(spec_hash(doc)).failed == 2
    del rig.smolvm.faults[("start", "*-sidecar")]
    rig.clock.advance(0.5)
    rig.settle()
    assert ready(node, doc) == 1 and node.pools.report(spec_hash(doc)).detail is None


def test_removing_a_pool_destroys_its_members(rigs: Rigs, tmp: str) -> None:
    """``pool rm``: the pool is forgotten durably and its members destroyed."""
    rig, node, doc = pooled(rigs, tmp, 2)
    assert node.pools.remove(spec_hash(doc)) == 2
    rig.settle()
    assert rig.registry.held() == 0 and rig.smolvm.names() == []
    assert StateStore(rig.state_dir).load().node == {"pools": []}


def test_a_pool_spec_is_checked(rigs: Rigs, tmp: str) -> None:
    """A forward-only spec, a spec with volumes, a size beyond the cap: INVALID_ARGUMENT."""
    rig = rigs(max_bottles=4)
    node = started(rig, node_of(rig))
    with pytest.raises(InvalidArgument):
        node.pools.ensure({"mode": "none"}, 1)
    doc = doc_of(tmp)
    doc["agent"]["volumes"] = [f"{tmp}:/data"]
    with pytest.raises(InvalidArgument, match="volumes"):
        node.pools.ensure(doc, 1)
    with pytest.raises(InvalidArgument, match="size"):
        node.pools.ensure(doc_of(tmp), 5)


def test_a_member_is_not_a_bottle_to_any_caller(rigs: Rigs, tmp: str) -> None:
    """A member's home name is NOT_FOUND to status, destroy and exec, and taken by a create
    of that name (ALREADY_EXISTS)."""
    from bottlenet.errors import AlreadyExists, NotFound

    rig, _, doc = pooled(rigs, tmp, 1)
    home = next(iter(rig.registry.members(spec_hash(doc))))[0]
    with pytest.raises(NotFound):
        rig.registry.get_bottle(home)
    with pytest.raises(NotFound):
        rig.run(rig.registry.destroy_bottle(home))
    with pytest.raises(NotFound):
        rig.registry.exec_target(home)
    with pytest.raises(AlreadyExists):
        create(rig, home, doc_of(tmp, egress=False))
