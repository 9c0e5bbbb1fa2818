"""A VM bottle's two sides run at once (issue 38): the agent boots while the sidecar boots and
gets ready, the gate runs once both are done, a failed side stops the other and both are
undone at once, and a teardown stops both VMs at once.

On the unit seam (``tests/bottles/memsmolvm.py``, a TEST DOUBLE of vmctl's smolvm API): a
held call (``MemorySmolvm.hold``) stands for a boot or a stop that takes a while.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet.defer import Deferred

from bottlenet.bottles.spec import BottleSpec, parse_bottle_spec
from bottlenet.errors import BottlenetError
from bottlenet.forward.spec import sidecar_socket_path
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import PROBE_ARGV, Rig, leak
from tests.bottles.test_rollback import assert_nothing_left
from vmctl.errors import KvmUnavailable

SIDECAR, AGENT = "bn-rb-sidecar", "bn-rb-agent"


def spec(tmp: str, **kw: Any) -> BottleSpec:
    return parse_bottle_spec("rb", spec_doc(tmp, **kw))


def outcome(d: Deferred[Any]) -> list[Any]:
    """What ``d`` fired with (empty: not yet)."""
    out: list[Any] = []
    d.addBoth(out.append)
    return out


def test_the_agent_boots_while_the_sidecar_boots(rigs: Callable[..., Rig], tmp: str) -> None:
    """The agent's create and start are asked while the sidecar's start has not returned;
    the gate waits for the sidecar."""
    rig = rigs()
    booting = rig.smolvm.hold("start", SIDECAR)
    created = rig.start(rig.registry.create_bottle("rb", spec=spec(tmp)))
    assert ("start", AGENT) in rig.smolvm.calls
    assert not created.called
    assert rig.smolvm.execs == [], "an exec ran before the sidecar was up"
    booting.callback(None)
    assert rig.result(created).state == "ready"
    gate = [n for n, argv in rig.smolvm.execs if argv == list(PROBE_ARGV)]
    assert gate == [AGENT]


def test_the_sidecar_gets_ready_while_the_agent_boots(rigs: Callable[..., Rig], tmp: str) -> None:
    """While the agent boots, the sidecar's services are tried, the endpoints bound and the
    egress policy pushed; nothing runs in the agent until its start returns."""
    rig = rigs()
    booting = rig.smolvm.hold("start", AGENT)
    created = rig.start(rig.registry.create_bottle("rb", spec=spec(tmp, listen="tcp")))
    assert rig.probed, "the sidecar's services were not tried"
    assert [info.spec.label for info in rig.table.list()] == ["egress", "git"]
    assert {name for name, _ in rig.smolvm.execs} == {SIDECAR}  # the egress policy
    assert not created.called
    booting.callback(None)
    assert rig.result(created).state == "ready"


def test_a_failed_side_stops_the_other_and_both_are_undone(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """The sidecar's start fails while the agent boots: the create waits for the agent's
    start to return (nothing it made goes unrecorded), goes no further on that side, undoes
    both and says the sidecar's error."""
    rig = rigs()
    sidecar = rig.smolvm.hold("start", SIDECAR)
    agent = rig.smolvm.hold("start", AGENT)
    rig.smolvm.fail_on("start", SIDECAR, KvmUnavailable("injected: no KVM"))
    created = rig.start(rig.registry.create_bottle("rb", spec=spec(tmp)))
    assert ("start", AGENT) in rig.smolvm.calls
    sidecar.callback(None)
    rig.settle()
    assert not created.called, "undone while the agent's start was still in flight"
    agent.callback(None)
    with pytest.raises(BottlenetError) as info:
        rig.result(created)
    assert info.value.message == "injected: no KVM; bottle torn down"
    assert rig.smolvm.execs == []
    assert ("delete", AGENT) in rig.smolvm.calls and ("delete", SIDECAR) in rig.smolvm.calls
    assert_nothing_left(rig)


def test_a_failed_agent_side_ends_the_sidecars_readiness_wait(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """The agent's start fails while the sidecar's services do not answer yet: the wait for
    them ends at its next try, not at its timeout, and everything is undone."""
    rig = rigs()
    rig.silent.add(sidecar_socket_path(rig.state_dir, "rb", "egress"))
    rig.smolvm.fail_on("start", AGENT, KvmUnavailable("injected: no KVM"))
    created = rig.start(rig.registry.create_bottle("rb", spec=spec(tmp)))
    rig.clock.advance(5)  # a few tries' back-off, far under the 60 s the wait would take
    with pytest.raises(BottlenetError) as info:
        rig.result(created)
    assert info.value.code == "KVM_UNAVAILABLE"
    assert_nothing_left(rig)


def test_a_rollback_stops_both_machines_at_once(rigs: Callable[..., Rig], tmp: str) -> None:
    """The gate fails; both machines' stops are asked before either returns."""
    rig = rigs()
    stopping = [rig.smolvm.hold("stop", name) for name in (AGENT, SIDECAR)]
    rig.smolvm.on_exec = leak
    created = rig.start(rig.registry.create_bottle("rb", spec=spec(tmp)))
    assert ("stop", SIDECAR) in rig.smolvm.calls and ("stop", AGENT) in rig.smolvm.calls
    assert not created.called
    for held in stopping:
        held.callback(None)
    with pytest.raises(BottlenetError) as info:
        rig.result(created)
    assert info.value.code == "ISOLATION_FAILED"
    assert_nothing_left(rig)


def test_a_teardown_stops_both_machines_at_once(rigs: Callable[..., Rig], tmp: str) -> None:
    """``bottle rm``: both machines' stops are asked before either returns; the destroy
    ends once both are deleted, leaving nothing."""
    rig = rigs()
    rig.run(rig.registry.create_bottle("rb", spec=spec(tmp)))
    stopping = [rig.smolvm.hold("stop", name) for name in (AGENT, SIDECAR)]
    destroyed = rig.start(rig.registry.destroy_bottle("rb"))
    assert ("stop", SIDECAR) in rig.smolvm.calls and ("stop", AGENT) in rig.smolvm.calls
    assert not destroyed.called
    stopping[1].callback(None)
    assert ("delete", SIDECAR) in rig.smolvm.calls
    assert not destroyed.called
    stopping[0].callback(None)
    rig.result(destroyed)
    assert_nothing_left(rig)
