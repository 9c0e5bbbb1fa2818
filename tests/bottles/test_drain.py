"""The node's drain (issue 28): DRAINING refuses creates, bottles held keep working, a wait
for empty, the state kept across a restart, events. In process, on a clock, with the
in-memory smolvm (``tests/bottles/memsmolvm.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from bottlenet.bottles.events import DRAINED, UNDRAINED, BottleEvent
from bottlenet.bottles.model import Role, Source, machine_name
from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.errors import Draining, InvalidArgument, ResourceExhausted
from bottlenet.errors import KvmUnavailable as BnKvmUnavailable
from bottlenet.forward.spec import parse_target
from bottlenet.node.info import MAX_DRAIN_WAITERS, MAX_LABELS, check_labels
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import Rig, node_of
from vmctl.errors import KvmUnavailable

Rigs = Callable[..., Rig]


def fail_a_create_without_kvm(rig: Rig, tmp: str, name: str = "x") -> None:
    """A VM create whose sidecar's start finds no KVM (KVM_UNAVAILABLE)."""
    sidecar = machine_name(name, Role.SIDECAR)
    rig.smolvm.fail_on("start", sidecar, KvmUnavailable("injected: no KVM"))
    with pytest.raises(BnKvmUnavailable):
        rig.run(rig.registry.create_bottle(name, spec=parse_bottle_spec(name, spec_doc(tmp))))


def events_of(rig: Rig) -> list[BottleEvent]:
    seen: list[BottleEvent] = []
    rig.registry.events.subscribe(seen.append)
    return seen


def test_draining_refuses_creates_and_keeps_bottles_working(rigs: Rigs, tmp: str) -> None:
    """While draining a create is DRAINING; a bottle held keeps its forwards and is
    destroyed as usual; after undrain creates work again."""
    rig = rigs()
    node = node_of(rig)
    seen = events_of(rig)
    rig.run(rig.registry.create_bottle("kept"))
    rig.run(rig.registry.create_bottle("vm1", spec=parse_bottle_spec("vm1", spec_doc(tmp))))
    node.drain()
    assert node.report().draining
    with pytest.raises(Draining):
        rig.run(rig.registry.create_bottle("new"))
    with pytest.raises(Draining):
        rig.run(rig.registry.create_bottle("vm2", spec=parse_bottle_spec("vm2", spec_doc(tmp))))
    assert not rig.registry.has_bottle("new") and rig.registry.state_of("new") is None
    # the bottles held keep working: a forward is added and the VM bottle is still ready
    rig.run(rig.registry.add_forward("kept", "web", parse_target("127.0.0.1:9")))
    assert rig.registry.get_bottle("vm1").state == "ready"
    rig.run(rig.registry.destroy_bottle("vm1"))
    assert [(e.kind, e.bottle) for e in seen if e.kind in (DRAINED, UNDRAINED)] == [(DRAINED, "")]
    node.undrain()
    rig.run(rig.registry.create_bottle("new"))
    assert [e.kind for e in seen if e.kind in (DRAINED, UNDRAINED)] == [DRAINED, UNDRAINED]


def test_config_bottles_are_not_refused(rigs: Rigs) -> None:
    """The config file's bottles are made again at every start: a draining node makes them."""
    rig = rigs()
    node = node_of(rig)
    node.drain()
    rig.run(rig.registry.create_bottle("cfg", source=Source.CONFIG))
    assert rig.registry.has_bottle("cfg")


def test_drain_survives_a_restart(rigs: Rigs) -> None:
    """The drain is in the state store: a restarted daemon still refuses; undrain too."""
    first = rigs()
    node_of(first).drain()
    first.close()
    second = rigs()
    node = node_of(second)
    assert node.draining
    with pytest.raises(Draining):
        second.run(second.registry.create_bottle("b1"))
    node.undrain()
    second.close()
    third = rigs()
    assert not node_of(third).draining
    third.run(third.registry.create_bottle("b1"))


def test_wait_for_empty_ends_when_the_last_bottle_goes(rigs: Rigs) -> None:
    """A drain's wait answers True once the last bottle is destroyed, not before."""
    rig = rigs()
    node = node_of(rig)
    rig.run(rig.registry.create_bottle("a"))
    rig.run(rig.registry.create_bottle("b"))
    node.drain()
    waiting = rig.start(node.when_empty(600))
    assert not waiting.called
    rig.run(rig.registry.destroy_bottle("a"))
    rig.clock.advance(0)  # the empty check runs on the turn after a destroy
    assert not waiting.called
    rig.run(rig.registry.destroy_bottle("b"))
    assert rig.result(waiting) is True


def test_wait_for_empty_times_out(rigs: Rigs) -> None:
    """With a bottle still held, the wait answers False after its timeout (on the clock)."""
    rig = rigs()
    node = node_of(rig)
    rig.run(rig.registry.create_bottle("a"))
    node.drain()
    waiting = rig.start(node.when_empty(30))
    rig.clock.advance(29)
    assert not waiting.called
    rig.clock.advance(1)
    assert rig.result(waiting) is False


def test_wait_on_an_empty_node_answers_at_once(rigs: Rigs) -> None:
    """No bottle held: the wait is over before it starts."""
    rig = rigs()
    node = node_of(rig)
    node.drain()
    assert rig.run(node.when_empty(30)) is True


def test_report(rigs: Rigs, tmp: str) -> None:
    """NodeInfo's values: capacity counts bottles and VM bottles, labels, health, KVM."""
    rig = rigs(max_bottles=7)
    node = node_of(rig)
    rig.run(rig.registry.create_bottle("plain"))
    rig.run(rig.registry.create_bottle("vm1", spec=parse_bottle_spec("vm1", spec_doc(tmp))))
    r = node.report()
    assert (r.capacity.max_bottles, r.capacity.bottles, r.capacity.vm_bottles) == (7, 2, 1)
    assert r.capacity.connections_total == rig.table.budget.total
    assert (r.host, r.labels, r.health, r.reasons, r.draining) == (
        "n1",
        (("zone", "a"),),
        "ok",
        (),
        False,
    )
    assert not r.vm_possible and r.vm_why_not == "no smolvm found"


def test_uids_running_short_degrade_the_node_with_a_warning(rigs: Rigs) -> None:
    """N8: the uids left reach the report; fewer than EXTEND_BELOW (no block could be
    claimed) is a health reason and one warning, and the warning ends when uids come back."""
    from twisted.logger import globalLogPublisher

    from vmctl.uids import EXTEND_BELOW, UidSupply

    rig = rigs()
    node = node_of(rig)
    logged: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(logged.append)
    try:
        assert node.report().vm_uids_left is None
        node.learn_uids(UidSupply(left=50_000, retired=3, held=2, blocks=(1,)))
        assert node.report().vm_uids_left == 50_000 and node.report().health == "ok"
        short = UidSupply(left=EXTEND_BELOW - 1, retired=9, held=2, blocks=(1,))
        node.learn_uids(short)
        node.learn_uids(short)
        r = node.report()
        assert r.health == "degraded" and r.vm_uids == short.describe()
        assert r.reasons == (f"per-VM uids are running out: {EXTEND_BELOW - 1} left",)
        node.learn_uids(UidSupply(left=70_000, retired=0, held=2, blocks=(1, 2)))
        assert node.report().health == "ok"
    finally:
        globalLogPublisher.removeObserver(logged.append)
    warnings = [e for e in logged if "running out" in e.get("log_format", "")]
    assert len(warnings) == 1 and warnings[0]["log_level"].name == "warn"


def test_a_kvm_failure_is_learned(rigs: Rigs, tmp: str) -> None:
    """A create that failed with KVM_UNAVAILABLE makes VM bottles impossible, with why."""
    rig = rigs()
    node = node_of(rig)
    node.smolvm_found, node.smolvm_problem, node.smolvm_version = True, None, "1.32.2"
    from vmctl.kvm import KvmStatus

    node.kvm = KvmStatus(True)
    assert node.report().vm_possible
    fail_a_create_without_kvm(rig, tmp)
    r = node.report()
    assert not r.vm_possible and "KVM_UNAVAILABLE" in (r.vm_why_not or "")


def test_unwritable_state_keeps_the_node_open(rigs: Rigs, monkeypatch: Any) -> None:
    """A drain that cannot be made durable is UNAVAILABLE and changes nothing."""
    rig = rigs()
    node = node_of(rig)

    def fail(record: dict[str, Any]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rig.store, "put_node", fail)
    with pytest.raises(Exception) as e:
        node.drain()
    assert getattr(e.value, "code", None) == "UNAVAILABLE"
    assert not node.draining
    rig.run(rig.registry.create_bottle("b1"))


def test_undrain_ends_a_waiting_drain_at_once(rigs: Rigs) -> None:
    """An undrain answers a waiting ``Drain --wait`` False at once, not at its timeout."""
    rig = rigs()
    node = node_of(rig)
    rig.run(rig.registry.create_bottle("a"))
    node.drain()
    waiting = rig.start(node.when_empty(600))
    assert not waiting.called
    node.undrain()
    rig.settle()
    assert waiting.called and rig.result(waiting) is False
    assert rig.clock.seconds() == 0


def test_a_create_that_fails_while_a_drain_waits_leaves_the_node_empty(
    rigs: Rigs, tmp: str
) -> None:
    """A VM create in flight that fails (its DESTROYED comes while it still holds its name)
    ends a waiting drain on the next turn, and the node holds nothing after it."""
    rig = rigs(max_bottles=1)
    node = node_of(rig)
    sidecar = machine_name("vm1", Role.SIDECAR)
    gate = rig.smolvm.hold("start", sidecar)
    rig.smolvm.fail_on("start", sidecar, KvmUnavailable("injected: no KVM"))
    creating = rig.start(
        rig.registry.create_bottle("vm1", spec=parse_bottle_spec("vm1", spec_doc(tmp)))
    )
    assert not creating.called and node.held() == 1
    node.drain()
    waiting = rig.start(node.when_empty(600))
    assert not waiting.called
    gate.callback(None)
    with pytest.raises(BnKvmUnavailable):
        rig.result(creating)
    rig.settle()
    assert rig.clock.seconds() == 0
    assert waiting.called and rig.result(waiting) is True
    assert node.held() == 0
    node.undrain()
    rig.run(rig.registry.create_bottle("after"))  # the failed name no longer counts


def test_drain_waits_do_not_use_up_the_waiter_bound(rigs: Rigs) -> None:
    """More waits than MAX_DRAIN_WAITERS, one after another, each timing out: none is
    refused (the bound is on callers waiting at once)."""
    rig = rigs()
    node = node_of(rig)
    rig.run(rig.registry.create_bottle("a"))
    node.drain()
    for _ in range(MAX_DRAIN_WAITERS + 1):
        waiting = rig.start(node.when_empty(0.1))
        rig.clock.advance(0.1)
        assert rig.result(waiting) is False


def test_a_forward_only_bottle_says_nothing_of_kvm(rigs: Rigs, tmp: str) -> None:
    """After a KVM_UNAVAILABLE create, a forward-only bottle's READY leaves VM bottles
    impossible (it started no VM)."""
    rig = rigs()
    node = node_of(rig)
    node.smolvm_found, node.smolvm_problem, node.smolvm_version = True, None, "1.32.2"
    fail_a_create_without_kvm(rig, tmp)
    rig.run(rig.registry.create_bottle("plain"))
    r = node.report()
    assert not r.vm_possible and "KVM_UNAVAILABLE" in (r.vm_why_not or "")


def test_the_bounds_of_labels_waiters_and_the_connection_budget(rigs: Rigs) -> None:
    """64 labels are taken and 65 refused; 64 callers may wait for the drain at once and the
    65th is RESOURCE_EXHAUSTED; a budget used up exactly is a health reason."""
    assert len(check_labels([f"k{i}=v" for i in range(MAX_LABELS)])) == MAX_LABELS
    with pytest.raises(InvalidArgument, match="at most"):
        check_labels([f"k{i}=v" for i in range(MAX_LABELS + 1)])
    rig = rigs()
    node = node_of(rig)
    rig.run(rig.registry.create_bottle("a"))
    node.drain()
    waiting = [rig.start(node.when_empty(600)) for _ in range(MAX_DRAIN_WAITERS)]
    assert not any(d.called for d in waiting)
    with pytest.raises(ResourceExhausted):
        rig.run(node.when_empty(600))
    budget = rig.table.budget
    budget.configured_total = 5
    budget.total_active = 5
    assert node.report().reasons == ("the relay connection budget is used up",)
    budget.total_active = 0
    node.undrain()
    assert all(rig.result(d) is False for d in waiting)


def test_a_smolvm_with_a_problem_reports_no_version(rigs: Rigs) -> None:
    """NodeInfo names a smolvm version only while that smolvm is usable."""
    rig = rigs()
    node = node_of(rig)
    node.smolvm_found, node.smolvm_problem, node.smolvm_version = True, None, "1.32.2"
    assert node.report().smolvm == "1.32.2"
    node.smolvm_problem = "UNSUPPORTED_VERSION: too old"
    r = node.report()
    assert r.smolvm is None and not r.vm_possible
