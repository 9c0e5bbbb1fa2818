"""A bottle's lifecycle and the registry's start-up gate, as declared state machines.

The registry keeps one :class:`BottleMachine` per bottle (the shape of transit relay's
``server_state.py``: one machine per connection, the registry as the table). A bottle is
*creating*, then *ready*; its workload may end (*exited*) and its sidecar may fail
(*degraded*); an operation in flight makes it *busy*, a destroy's VM teardown *destroying*,
and a bottle that is removed is *gone*. While an operation is in flight the bottle still has
its kept state (ready, exited or degraded: the one the state file holds), so *busy* and
*destroying* are declared once per kept state, and an operation ends in the kept state the
bottle has by then. The machines only decide; the registry does the work (events,
listeners, the state file) after each input returns, so no output calls back into a machine.

:class:`RegistryGate` is the registry-wide gate: *serving*, or *restoring* while
:class:`~bottlenet.bottles.recovery.Recovery` restores the state file, when a change waits.
"""

from __future__ import annotations

import enum
from typing import Protocol

from automat import TypeMachineBuilder
from twisted.internet.defer import Deferred, succeed

from bottlenet.bottles.model import BottleState
from bottlenet.waiters import OneShot


class Lifecycle(enum.StrEnum):
    """Where a bottle is in its lifecycle, as :meth:`BottleRegistry.state_of` tells it."""

    CREATING = "creating"
    READY = "ready"
    BUSY = "busy"
    EXITED = "exited"
    DEGRADED = "degraded"
    DESTROYING = "destroying"
    GONE = "gone"


#: An operation holds the bottle: another one gets BUSY.
IN_FLIGHT = frozenset({Lifecycle.CREATING, Lifecycle.BUSY, Lifecycle.DESTROYING})


class BottleMachine(Protocol):
    """The inputs of one bottle's machine (each documented transition is declared below)."""

    def begin(self) -> bool:
        """An operation asks for the bottle: False while another one is in flight (BUSY)."""

    def created(self) -> None:
        """The create operation made the bottle (it still holds the bottle until it ends)."""

    def finish(self) -> None:
        """The operation ended: the bottle is idle in its kept state (gone if never made)."""

    def tearing_down(self) -> None:
        """The destroy operation starts deleting the bottle's VMs."""

    def torn_down(self) -> None:
        """The VMs are deleted; the destroy goes on (the record, then the bottle)."""

    def teardown_failed(self) -> bool:
        """The VM teardown failed: the bottle is degraded; True when it was not already."""

    def removed(self) -> None:
        """The bottle's record and the bottle are gone."""

    def degrade(self) -> bool:
        """Its sidecar or bridge failed: True when this makes it degraded (it was not)."""

    def workload_exited(self) -> bool:
        """Its workload ended: True when this makes a ready bottle exited."""

    def lifecycle(self) -> Lifecycle:
        """Where the bottle is now."""

    def kept_state(self) -> BottleState:
        """The state the state file keeps for it now (ready, exited or degraded)."""


class _BottleCore:
    """A bottle machine holds no data: the registry's table holds the bottle."""


KEPT = (BottleState.READY, BottleState.EXITED, BottleState.DEGRADED)

_bottle = TypeMachineBuilder(BottleMachine, _BottleCore)
_creating = _bottle.state("creating")
_gone = _bottle.state("gone")
_idle = {kept: _bottle.state(str(kept)) for kept in KEPT}
_busy = {kept: _bottle.state(f"busy ({kept})") for kept in KEPT}
_destroying = {kept: _bottle.state(f"destroying ({kept})") for kept in KEPT}


_creating.upon(BottleMachine.begin).loop().returns(False)
_creating.upon(BottleMachine.created).to(_busy[BottleState.READY]).returns(None)
_creating.upon(BottleMachine.finish).to(_gone).returns(None)
_creating.upon(BottleMachine.degrade).loop().returns(False)
_creating.upon(BottleMachine.workload_exited).loop().returns(False)
_creating.upon(BottleMachine.lifecycle).loop().returns(Lifecycle.CREATING)
_creating.upon(BottleMachine.kept_state).loop().returns(BottleState.READY)
_gone.upon(BottleMachine.finish).loop().returns(None)
_gone.upon(BottleMachine.lifecycle).loop().returns(Lifecycle.GONE)
for _kept in KEPT:
    _idle[_kept].upon(BottleMachine.begin).to(_busy[_kept]).returns(True)
    _idle[_kept].upon(BottleMachine.removed).to(_gone).returns(None)
    _idle[_kept].upon(BottleMachine.lifecycle).loop().returns(Lifecycle(_kept))
    _busy[_kept].upon(BottleMachine.begin).loop().returns(False)
    _busy[_kept].upon(BottleMachine.finish).to(_idle[_kept]).returns(None)
    _busy[_kept].upon(BottleMachine.tearing_down).to(_destroying[_kept]).returns(None)
    _busy[_kept].upon(BottleMachine.removed).to(_gone).returns(None)
    _busy[_kept].upon(BottleMachine.torn_down).loop().returns(None)  # after teardown_failed
    _busy[_kept].upon(BottleMachine.lifecycle).loop().returns(Lifecycle.BUSY)
    _destroying[_kept].upon(BottleMachine.begin).loop().returns(False)
    _destroying[_kept].upon(BottleMachine.torn_down).to(_busy[_kept]).returns(None)
    _destroying[_kept].upon(BottleMachine.teardown_failed).to(_busy[BottleState.DEGRADED]).returns(
        _kept is not BottleState.DEGRADED
    )
    _destroying[_kept].upon(BottleMachine.lifecycle).loop().returns(Lifecycle.DESTROYING)
    # The kept state changes the same way whether the bottle is idle, busy or destroying.
    for _states in (_idle, _busy, _destroying):
        _here = _states[_kept]
        _here.upon(BottleMachine.kept_state).loop().returns(_kept)
        if _kept is BottleState.DEGRADED:
            _here.upon(BottleMachine.degrade).loop().returns(False)
        else:
            _here.upon(BottleMachine.degrade).to(_states[BottleState.DEGRADED]).returns(True)
        if _kept is BottleState.READY:
            _here.upon(BottleMachine.workload_exited).to(_states[BottleState.EXITED]).returns(True)
        else:
            _here.upon(BottleMachine.workload_exited).loop().returns(False)

_bottle_machine = _bottle.build()


def creating() -> BottleMachine:
    """The machine of a bottle a create operation is making."""
    return _bottle_machine(_BottleCore())


def adopted(kept: BottleState) -> BottleMachine:
    """The machine of a bottle taken in as it is (restored, kept ``kept``), idle."""
    return _bottle_machine(_BottleCore(), _idle[kept])


# -- the registry's gate --------------------------------------------------------------------


class RegistryGate(Protocol):
    """The inputs of the registry's start-up gate."""

    def restore(self) -> None:
        """Recovery starts: changes wait until it is done."""

    def restored(self) -> OneShot[None] | None:
        """Recovery is done: the waiters to release (the caller fires them), if any."""

    def serving(self) -> bool:
        """Whether changes run now."""

    def when_serving(self) -> Deferred[None]:
        """Fires once changes run (at once while serving)."""


class _GateCore:
    """The waiters of the current restore (a new set each time restoring begins)."""

    def __init__(self) -> None:
        self.done: OneShot[None] = OneShot()


_gate = TypeMachineBuilder(RegistryGate, _GateCore)
_serving = _gate.state("serving")
_restoring = _gate.state("restoring")


@_serving.upon(RegistryGate.restore).to(_restoring)
def _begin_restore(gate: RegistryGate, core: _GateCore) -> None:
    core.done = OneShot()


@_restoring.upon(RegistryGate.restored).to(_serving)
def _end_restore(gate: RegistryGate, core: _GateCore) -> OneShot[None]:
    # Handed back, not fired here: a released change asks the gate again at once.
    return core.done


@_restoring.upon(RegistryGate.when_serving).loop()
def _wait(gate: RegistryGate, core: _GateCore) -> Deferred[None]:
    return core.done.when_fired()


@_serving.upon(RegistryGate.when_serving).loop()
def _now(gate: RegistryGate, core: _GateCore) -> Deferred[None]:
    return succeed(None)


_restoring.upon(RegistryGate.restore).loop().returns(None)
_serving.upon(RegistryGate.restored).loop().returns(None)
_serving.upon(RegistryGate.serving).loop().returns(True)
_restoring.upon(RegistryGate.serving).loop().returns(False)

_gate_machine = _gate.build()


def registry_gate() -> RegistryGate:
    """A gate that serves until a restore begins."""
    return _gate_machine(_GateCore())
