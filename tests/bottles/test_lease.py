"""Leases (issue 28): a bottle whose owner stopped renewing is reaped by the daemon, and only
it; a wall-clock jump reaps nothing early; a restart keeps counting and gives the grace
again. In process, on clocks, with the in-memory smolvm (``tests/bottles/memsmolvm.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import LogEvent, formatEvent, globalLogPublisher

from bottlenet.bottles.bottle import VMBottle
from bottlenet.bottles.events import LEASE_EXPIRED, BottleEvent
from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.bottles.tenancy import Tenancy
from bottlenet.errors import InvalidArgument, NotFound
from bottlenet.node.lease import MAX_SLEEP, RETRY, LeasePolicy
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import Rig
from tests.bottles.test_drain import node_of

Rigs = Callable[..., Rig]


class Monotonic:
    """A monotonic clock of the test's own: the reactor's (wall) clock may jump apart."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lease(seconds: float, owner: str = "trainer-1") -> Tenancy:
    t = Tenancy.requested(owner, seconds, None)
    assert t is not None
    return t


def advance(rig: Rig, mono: Monotonic, seconds: float) -> None:
    """Both clocks move on together (no jump), a second at a time."""
    for _ in range(int(seconds)):
        mono.now += 1
        rig.clock.advance(1)
        rig.settle()


def kinds(seen: list[BottleEvent], name: str) -> list[str]:
    return [e.kind for e in seen if e.bottle == name]


def test_an_abandoned_bottle_is_reaped_and_only_it(rigs: Rigs, tmp: str) -> None:
    """Not renewed: reaped after lease + grace (event, log line, destroy); renewed: kept;
    no lease: never touched."""
    rig = rigs()
    mono = Monotonic()
    node = node_of(rig, mono, grace=30)
    seen: list[BottleEvent] = []
    rig.registry.events.subscribe(seen.append)
    logged: list[LogEvent] = []
    globalLogPublisher.addObserver(logged.append)
    try:
        spec = parse_bottle_spec("gone", spec_doc(tmp))
        rig.run(rig.registry.create_bottle("gone", spec=spec, tenancy=lease(60)))
        rig.run(rig.registry.create_bottle("kept", tenancy=lease(60)))
        rig.run(rig.registry.create_bottle("plain"))
        advance(rig, mono, 50)
        node.renew_lease("kept", 60)
        advance(rig, mono, 39)  # 89 s: "gone"'s lease (60) and grace (30) have not passed
        assert rig.registry.has_bottle("gone")
        advance(rig, mono, 2)
        assert not rig.registry.has_bottle("gone")
        assert kinds(seen, "gone")[-2:] == [LEASE_EXPIRED, "destroyed"]
        assert rig.smolvm.machines == {} or all("gone" not in m for m in rig.smolvm.machines)
        text = "\n".join(formatEvent(e) for e in logged)
        assert "bottle gone: lease of 60s ran out" in text and "owner 'trainer-1'" in text
        assert rig.registry.has_bottle("kept") and rig.registry.has_bottle("plain")
        advance(rig, mono, 200)
        assert not rig.registry.has_bottle("kept")
        assert rig.registry.has_bottle("plain")
        assert LEASE_EXPIRED not in kinds(seen, "plain")
    finally:
        globalLogPublisher.removeObserver(logged.append)


def test_a_wall_clock_jump_reaps_nothing_early(rigs: Rigs) -> None:
    """The reactor's clock jumps a day ahead: the keeper wakes, the monotonic clock says the
    lease is live, nothing is reaped; it is reaped when the lease really runs out."""
    rig = rigs()
    mono = Monotonic()
    node_of(rig, mono, grace=30)
    rig.run(rig.registry.create_bottle("b1", tenancy=lease(60)))
    rig.clock.advance(86400)
    rig.settle()
    assert rig.registry.has_bottle("b1")
    advance(rig, mono, 89)
    assert rig.registry.has_bottle("b1")
    advance(rig, mono, 2)
    assert not rig.registry.has_bottle("b1")


def test_a_restart_keeps_counting_and_gives_the_grace_again(rigs: Rigs) -> None:
    """The lease's expiry is in the state file: after a restart what is left of it counts,
    then the grace; one that ran out while the daemon was down still gets the grace."""
    first = rigs()
    node_of(first, Monotonic())
    first.run(first.registry.create_bottle("short", tenancy=lease(60)))
    first.run(first.registry.create_bottle("long", tenancy=lease(600)))
    assert first.state()["long"]["tenancy"]["lease"]["seconds"] == 600
    first.close()

    second = rigs()
    second.clock.advance(300)  # wall time while the daemon was down: "short" ran out
    mono = Monotonic()
    node_of(second, mono, grace=30)
    second.recover()
    assert second.registry.has_bottle("short"), "never reaped at start"
    assert second.registry.get_bottle("long").tenancy == lease(600).started(0.0)
    advance(second, mono, 29)
    assert second.registry.has_bottle("short")
    advance(second, mono, 2)
    assert not second.registry.has_bottle("short")
    advance(second, mono, 300 - 31 + 29)  # long: 300 s were left, then 30 s of grace
    assert second.registry.has_bottle("long")
    advance(second, mono, 2)
    assert not second.registry.has_bottle("long")


def test_renew_is_recorded_and_checked(rigs: Rigs) -> None:
    """A renewal is written to the state file; a bottle without a lease or none at all is
    refused."""
    rig = rigs()
    mono = Monotonic()
    node = node_of(rig, mono)
    rig.run(rig.registry.create_bottle("b1", tenancy=lease(60)))
    rig.run(rig.registry.create_bottle("plain"))
    rig.clock.advance(10)
    node.renew_lease("b1", 120)
    assert rig.state()["b1"]["tenancy"]["lease"] == {"seconds": 120.0, "expires_at": 130.0}
    with pytest.raises(InvalidArgument):
        node.renew_lease("plain", 60)
    with pytest.raises(NotFound):
        node.renew_lease("nope", 60)
    with pytest.raises(InvalidArgument):
        node.renew_lease("b1", 0)


def test_a_reap_that_finds_the_bottle_busy_is_tried_again(rigs: Rigs, tmp: str) -> None:
    """The reap meets another operation on the bottle (BUSY): it is tried again until the
    bottle is gone, ``destroyed`` after one ``lease_expired``, while other leases run out."""
    rig = rigs()
    mono = Monotonic()
    node_of(rig, mono, grace=30)
    seen: list[BottleEvent] = []
    rig.registry.events.subscribe(seen.append)
    spec = parse_bottle_spec("busy", spec_doc(tmp))
    rig.run(rig.registry.create_bottle("busy", spec=spec, tenancy=lease(60)))
    rig.run(rig.registry.create_bottle("later", tenancy=lease(70)))
    gate = rig.smolvm.hold("exec", "bn-busy-agent")
    verifying = rig.start(rig.registry.verify_bottle("busy"))
    assert not verifying.called
    advance(rig, mono, 91)  # lease and grace ran out: the reap meets the verify (BUSY)
    assert kinds(seen, "busy")[-1:] == [LEASE_EXPIRED] and rig.registry.has_bottle("busy")
    advance(rig, mono, 20)  # "later" is reaped meanwhile; "busy" is still retried
    assert not rig.registry.has_bottle("later") and rig.registry.has_bottle("busy")
    gate.callback(None)
    rig.result(verifying)
    advance(rig, mono, 10)  # the retry (5 s) finds it free
    assert not rig.registry.has_bottle("busy")
    assert kinds(seen, "busy")[-2:] == [LEASE_EXPIRED, "destroyed"]
    assert kinds(seen, "busy").count(LEASE_EXPIRED) == 1  # expired once, however often retried


def test_a_renewal_after_the_lease_ran_out_is_refused(rigs: Rigs, tmp: str) -> None:
    """Once the reap has started a renewal is NOT_FOUND and changes nothing on record."""
    rig = rigs()
    mono = Monotonic()
    node = node_of(rig, mono, grace=30)
    spec = parse_bottle_spec("late", spec_doc(tmp))
    rig.run(rig.registry.create_bottle("late", spec=spec, tenancy=lease(60)))
    recorded = rig.state()["late"]["tenancy"]
    gate = rig.smolvm.hold("stop", "bn-late-agent")
    advance(rig, mono, 91)  # the reap's destroy waits on the held stop
    assert rig.registry.has_bottle("late")
    with pytest.raises(NotFound, match="being destroyed"):
        node.renew_lease("late", 600)
    assert rig.state()["late"]["tenancy"] == recorded
    timer = rig.registry.owner("late", VMBottle).lease
    assert timer.armed and timer.reaping  # its deadline passed: being reaped
    gate.callback(None)
    rig.settle()
    assert not rig.registry.has_bottle("late")


def test_a_vm_bottles_lease_counts_from_its_commit(rigs: Rigs, tmp: str) -> None:
    """A VM bottle's create answers and records a lease that expires ``seconds`` after the
    wall time it was committed; a stop ends its watch; a restart 10 s later does not reap it
    before its lease plus the grace."""
    first = rigs()
    node_of(first, Monotonic())
    first.clock.advance(100)
    spec = parse_bottle_spec("vm1", spec_doc(tmp))
    made = first.run(first.registry.create_bottle("vm1", spec=spec, tenancy=lease(600)))
    assert made.tenancy == lease(600).started(100.0)  # the answer: as committed
    assert first.state()["vm1"]["tenancy"]["lease"] == {"seconds": 600.0, "expires_at": 700.0}
    assert first.registry.get_bottle("vm1").tenancy == lease(600).started(100.0)
    assert first.watched() == frozenset({"vm1"})
    first.registry.stop()  # the daemon stops: its watches end, the VMs keep running
    assert first.watched() == frozenset()
    first.close()
    second = rigs(smolvm=first.smolvm)
    second.clock.advance(110)
    mono = Monotonic()
    node_of(second, mono, grace=30)
    second.recover()
    advance(second, mono, 590 + 29)
    assert second.registry.has_bottle("vm1")
    advance(second, mono, 2)
    assert not second.registry.has_bottle("vm1")


def test_a_renewal_during_recovery_is_answered_after_the_restore(rigs: Rigs, tmp: str) -> None:
    """A restarted daemon that has not restored a VM bottle yet makes a renewal wait for the
    restore; then the bottle is renewed and its new lease counts."""
    first = rigs()
    node_of(first, Monotonic())
    spec = parse_bottle_spec("vm1", spec_doc(tmp))
    first.run(first.registry.create_bottle("vm1", spec=spec, tenancy=lease(60)))
    first.close()
    second = rigs(smolvm=first.smolvm)
    mono = Monotonic()
    node = node_of(second, mono)
    gate = second.smolvm.hold("list", "")
    recovering = second.start(second.recover_later())
    assert second.registry.recovering and not second.registry.has_bottle("vm1")
    waiting = second.start(node.when_serving())
    assert not waiting.called
    gate.callback(None)
    second.result(recovering)
    second.result(waiting)
    node.renew_lease("vm1", 600)
    assert second.state()["vm1"]["tenancy"]["lease"]["seconds"] == 600
    advance(second, mono, 600 + 29)
    assert second.registry.has_bottle("vm1")
    advance(second, mono, 2)
    assert not second.registry.has_bottle("vm1")


def test_a_reap_that_finds_the_bottle_gone_is_not_retried() -> None:
    """A reap answered NOT_FOUND (the bottle went by another way): nothing left to reap, so
    no retry is scheduled and no 'reaping it failed' line is logged."""
    clock = Clock()
    reaps: list[str] = []
    said: list[LogEvent] = []

    def reap() -> Deferred[None]:
        reaps.append("reap")
        return fail(NotFound("bottle gone does not exist"))

    timer = LeasePolicy(clock, clock.seconds, grace=0).timer("gone", lambda: None, reap)
    globalLogPublisher.addObserver(said.append)
    try:
        timer.arm(1)
        clock.advance(1)
        assert reaps == ["reap"] and clock.getDelayedCalls() == []
        clock.advance(10 * RETRY)
    finally:
        globalLogPublisher.removeObserver(said.append)
    assert reaps == ["reap"]
    assert not [e for e in said if "reaping it failed" in (formatEvent(e) or "")]


def test_a_wall_clock_stepped_back_delays_a_reap_by_at_most_max_sleep() -> None:
    """The reactor's clock lags the monotonic one (a wall step back): the timer still looks
    every MAX_SLEEP of reactor time, so the reap comes at most MAX_SLEEP late."""
    clock, mono = Clock(), Monotonic()
    reaps: list[str] = []

    def reap() -> Deferred[None]:
        reaps.append("reap")
        return succeed(None)

    LeasePolicy(clock, mono, grace=0).timer("b", lambda: None, reap).arm(600)
    mono.now += 600  # the lease ran out by the monotonic clock; the reactor's stood still
    clock.advance(MAX_SLEEP)
    assert reaps == ["reap"]


def test_a_new_bottle_of_a_destroyed_leased_ones_name_is_not_reaped_by_its_lease(
    rigs: Rigs, tmp: str
) -> None:
    """A leased bottle destroyed by hand takes its lease with it: a new bottle of that name
    (no lease) outlives the old deadline, and no lease_expired is heard for either."""
    rig = rigs()
    mono = Monotonic()
    node_of(rig, mono, grace=30)
    seen: list[BottleEvent] = []
    rig.registry.events.subscribe(seen.append)
    rig.run(rig.registry.create_bottle("x", tenancy=lease(60)))
    rig.run(rig.registry.destroy_bottle("x"))
    rig.run(rig.registry.create_bottle("x"))
    advance(rig, mono, 200)
    assert rig.registry.has_bottle("x") and LEASE_EXPIRED not in kinds(seen, "x")
