"""A bottle's lifecycle states and the registry's start-up gate, a declared state machine.

Each bottle's owner keeps one machine (:mod:`bottlenet.bottles.bottle`, the shape of transit
relay's ``server_state.py``: one machine per connection, the registry as the table). A bottle is
*creating*, then *ready*; its workload may end (*exited*) and its sidecar may fail
(*degraded*); an operation in flight makes it *busy*, a destroy's VM teardown *destroying*,
and a bottle that is removed is *gone*. While an operation is in flight the bottle still has
its kept state (ready, exited or degraded: the one the state file holds), so *busy* and
*destroying* are declared once per kept state, and an operation ends in the kept state the
bottle has by then. The transitions do the work (a degrade, a workload exit, a failed
teardown); this module names the states they share with the table.

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


#: The states a bottle is kept in (the state file holds one of them).
KEPT = (BottleState.READY, BottleState.EXITED, BottleState.DEGRADED)


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
