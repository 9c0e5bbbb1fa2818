"""One VM bottle's owner driven directly: its machine's transitions do the work (unit seam).

Procmon's test style (``twisted.runner.test.test_procmon``): the owner is made through a rig's
table on a clock with the in-memory smolvm (``memsmolvm``, a test double of vmctl's typed
API) and real listeners on loopback; no daemon. Each test gives an input and checks every
effect the transition owes: the value, the listeners, the watches, the record, the event.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ProcessDone
from twisted.internet.interfaces import IProcessProtocol
from twisted.python.failure import Failure

from bottlenet.bottles.bottle import VMBottle
from bottlenet.bottles.events import (
    CREATED,
    DEGRADED,
    READY,
    WORKLOAD_EXITED,
    BottleEvent,
)
from bottlenet.bottles.model import BottleState
from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.bottles.states import Lifecycle
from bottlenet.errors import SmolvmFailed
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import MemorySmolvm, Rig
from vmctl.errors import SmolvmFailed as VmSmolvmFailed

Event = tuple[str, str, Any, Any, Any]


class Attached:
    """The in-memory smolvm's attached execs (a workload waiter), ended by the test."""

    def __init__(self) -> None:
        self.protocols: list[IProcessProtocol] = []

    def spawn_exec(self, name: str, argv: list[str], protocol: Any, **kw: Any) -> Deferred[Any]:
        self.protocols.append(protocol)
        protocol.makeConnection(_Transport())
        return succeed(protocol)


class _Transport:
    signals: list[str]

    def __init__(self) -> None:
        self.signals = []

    def signalProcess(self, sig: str) -> None:
        self.signals.append(sig)


class Owned:
    """A VM bottle made through a rig's table, with the events it emits."""

    owner: VMBottle

    def __init__(self, rig: Rig, attached: Attached) -> None:
        self.rig = rig
        self.attached = attached
        self.events: list[Event] = []
        rig.use(smolvm=_WithAttach(rig.smolvm, attached))
        rig.events.subscribe(self.heard)

    def heard(self, e: BottleEvent) -> None:
        self.events.append((e.kind, e.bottle, e.state, e.detail, e.exit_code))

    def create(self, tmp: str, **kw: Any) -> None:
        doc = spec_doc(tmp, mode="socket", listen="tcp", **kw)
        self.rig.run(self.rig.registry.create_bottle("b1", spec=parse_bottle_spec("b1", doc)))
        self.owner = self.rig.registry.owner("b1", VMBottle)
        # committed and listed, then it runs and is READY
        assert [b.name for b in self.rig.registry.list_bottles()] == ["b1"]
        assert [e[0] for e in self.events] == [CREATED, READY] and self.owner.watched
        self.events.clear()


class _WithAttach:
    """The rig's smolvm with ``spawn_exec`` (the in-memory double has none)."""

    def __init__(self, smolvm: MemorySmolvm, attached: Attached) -> None:
        self._smolvm = smolvm
        self.spawn_exec = attached.spawn_exec

    def __getattr__(self, name: str) -> Any:
        return getattr(self._smolvm, name)


@pytest.fixture
def owned(rigs: Callable[..., Rig]) -> Owned:
    return Owned(rigs(), Attached())


def end_workload(protocol: IProcessProtocol, code: int) -> None:
    protocol.childDataReceived(1, f"{code}\n".encode())
    protocol.processEnded(Failure(ProcessDone(0)))


def test_degrade_does_its_work_once(owned: Owned, tmp: str) -> None:
    """A sidecar's exit: waiter, watch and listeners go, the record and DEGRADED follow."""
    owned.create(tmp, workload=("/agent", "run"))
    owner, rig = owned.owner, owned.rig
    [waiter] = owned.attached.protocols
    assert rig.table.list("b1") and owner.watched
    owner.sidecar_exited()
    rig.settle()
    assert owner.require().state is BottleState.DEGRADED
    assert owner.phase() is Lifecycle.DEGRADED
    assert rig.table.list("b1") == [] and not owner.watched
    assert waiter.transport.signals == ["TERM"]  # type: ignore[attr-defined]
    assert rig.state()["b1"]["state"] == "degraded"
    assert owned.events == [
        (DEGRADED, "b1", BottleState.DEGRADED, "sidecar VM process exited", None)
    ]
    owner.degrade_later("bridge failed: again")
    rig.settle()
    assert len(owned.events) == 1 and owner.require().detail == "sidecar VM process exited"


def test_workload_exit_is_recorded_and_emitted(owned: Owned, tmp: str) -> None:
    """The waiter's exit code turns a ready bottle exited, once; its record keeps the code."""
    owned.create(tmp, workload=("/agent", "run"))
    owner, rig = owned.owner, owned.rig
    [waiter] = owned.attached.protocols
    end_workload(waiter, 7)
    vm = owner.require().require_vms()
    assert (owner.require().state, vm.workload_exit_code) == (BottleState.EXITED, 7)
    assert rig.state()["b1"]["workload_exit_code"] == 7
    assert owned.events == [
        (WORKLOAD_EXITED, "b1", BottleState.EXITED, "workload exited with code 7", 7)
    ]
    owner.workload_ended(9)  # a second word from a waiter is not news
    assert len(owned.events) == 1


def test_a_failed_teardown_degrades_once(owned: Owned, tmp: str) -> None:
    """A teardown that fails leaves the bottle degraded (recorded, one DEGRADED event)."""
    owned.create(tmp)
    rig = owned.rig
    rig.smolvm.fail_on("delete", "bn-b1-agent", VmSmolvmFailed("delete failed"))
    for attempt in range(2):
        with pytest.raises(SmolvmFailed):
            rig.run(rig.registry.destroy_bottle("b1"))
        assert rig.registry.state_of("b1") is Lifecycle.DEGRADED, attempt
    assert rig.state()["b1"]["detail"] == "teardown incomplete: SMOLVM_FAILED"
    assert [e[0] for e in owned.events] == [DEGRADED]


def test_a_removed_bottle_ignores_late_callbacks(owned: Owned, tmp: str) -> None:
    """After its destroy, a late sidecar exit or workload exit changes nothing."""
    owned.create(tmp, workload=("/agent", "run"))
    owner, rig = owned.owner, owned.rig
    [waiter] = owned.attached.protocols
    rig.run(rig.registry.destroy_bottle("b1"))
    assert rig.registry.state_of("b1") is None and owner.phase() is Lifecycle.GONE
    assert "b1" not in rig.state() and rig.smolvm.machines == {}
    owner.sidecar_exited()
    end_workload(waiter, 3)
    rig.settle()
    assert [e[0] for e in owned.events] == ["destroyed"]
    assert not os.path.exists(os.path.join(rig.state_dir, "bottles", "b1"))


def test_a_bottle_restored_degraded_runs_nothing_again(
    owned: Owned, rigs: Callable[..., Rig], tmp: str
) -> None:
    """A degraded bottle a restart keeps (its teardown failed) is adopted idle: no workload
    waiter is started in its agent VM again, nothing of it is watched."""
    owned.create(tmp, workload=("/agent", "run"))
    owned.owner.sidecar_exited()
    owned.rig.settle()
    assert owned.rig.state()["b1"]["state"] == "degraded"
    owned.rig.close()
    again = Owned(rigs(smolvm=owned.rig.smolvm), Attached())
    again.rig.smolvm.fail_on("stop", "bn-b1-agent", VmSmolvmFailed("injected"))
    again.rig.smolvm.fail_on("delete", "bn-b1-agent", VmSmolvmFailed("injected"))
    again.rig.recover()
    assert again.rig.registry.state_of("b1") is Lifecycle.DEGRADED
    assert again.attached.protocols == [] and "b1" not in again.rig.watched()
