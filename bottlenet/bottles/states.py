"""A bottle's lifecycle as the table tells it, and the registry's start-up gate.

A VM bottle's owner keeps one machine (:mod:`bottlenet.bottles.vmbottle`, the shape of
transit relay's ``server_state.py``: one machine per party, the registry as the table). A
bottle is *creating*, then *ready*; its workload may end (*exited*) and its sidecar may fail
(*degraded*); a destroy's VM teardown makes it *destroying*, and a bottle that is removed is
*gone*. One operation at a time is the table's rule: while one holds a bottle kept as it is
(ready, exited or degraded: the state the state file holds) the table says *busy*.

:class:`RegistryGate` is the registry-wide gate: *serving*, or *restoring* while
:class:`~bottlenet.bottles.recovery.Recovery` restores the state file, when a change waits.
"""

from __future__ import annotations

import enum
from typing import Protocol

from automat import TypeMachineBuilder
from twisted.internet.defer import Deferred, succeed

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
    #: A warm pool's member: booted, gated and bridged, no workload, waiting to be taken.
    POOLED = "pooled"


#: The states a bottle is kept in (the state file holds one of them): BUSY while an
#: operation holds it.
KEPT = frozenset({Lifecycle.READY, Lifecycle.EXITED, Lifecycle.DEGRADED})


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
