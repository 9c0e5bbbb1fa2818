"""A bottle actor's lifecycle as a declared machine (docs/architecture.md, "Declared states").

The actor's constructor, its methods (on Ray's threads) and its lease keeper (a thread of its
own) all act on one bottle; the machine says which of them may: the constructor ends in
*serving* or *refused*; one destroy (the trainer's, the owner-gone path's or the exit hook's)
moves *serving* to *destroying* and the others see it taken; a renewal that finds the bottle
gone (reaped by its node) makes it *lost*. Callers hold the actor's lock around each input.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from automat import TypeMachineBuilder


class ActorState(enum.StrEnum):
    """Where a bottle actor is, as :meth:`BottleActorMachine.state` tells it."""

    CREATING = "creating"
    SERVING = "serving"
    REFUSED = "refused"
    DESTROYING = "destroying"
    GONE = "gone"
    LOST = "lost"


class BottleActorMachine(Protocol):
    """The inputs (each transition is declared in :func:`_build`)."""

    def created(self) -> None:
        """The node's daemon made the bottle."""

    def refused(self) -> None:
        """The node's daemon refused it (draining, full, unreachable) or the create failed."""

    def begin_destroy(self) -> bool:
        """Someone wants the bottle destroyed: True for the one who should do it."""

    def destroyed(self) -> None:
        """The bottle is destroyed (or was already gone)."""

    def bottle_lost(self) -> None:
        """The node no longer has the bottle (its lease ran out)."""

    def state(self) -> ActorState:
        """Where the actor is now."""


@dataclass
class _Core:
    state: ActorState = ActorState.CREATING


def _to(state: ActorState) -> Callable[[BottleActorMachine, _Core], None]:
    def enter(inputs: BottleActorMachine, core: _Core) -> None:
        core.state = state

    return enter


def _build() -> Callable[[_Core], BottleActorMachine]:
    builder = TypeMachineBuilder(BottleActorMachine, _Core)
    creating = builder.state("creating")
    serving = builder.state("serving")
    refused = builder.state("refused")
    destroying = builder.state("destroying")
    ended = builder.state("ended")  # gone or lost: the core says which

    creating.upon(BottleActorMachine.created).to(serving)(_to(ActorState.SERVING))
    creating.upon(BottleActorMachine.refused).to(refused)(_to(ActorState.REFUSED))
    serving.upon(BottleActorMachine.bottle_lost).to(ended)(_to(ActorState.LOST))
    destroying.upon(BottleActorMachine.destroyed).to(ended)(_to(ActorState.GONE))
    destroying.upon(BottleActorMachine.bottle_lost).loop().returns(None)
    ended.upon(BottleActorMachine.bottle_lost).loop().returns(None)

    @serving.upon(BottleActorMachine.begin_destroy).to(destroying)
    def take(inputs: BottleActorMachine, core: _Core) -> bool:
        core.state = ActorState.DESTROYING
        return True

    for state in (refused, destroying, ended):
        state.upon(BottleActorMachine.begin_destroy).loop().returns(False)

    for state in (creating, serving, refused, destroying, ended):

        @state.upon(BottleActorMachine.state).loop()
        def read(inputs: BottleActorMachine, core: _Core) -> ActorState:
            return core.state

    return builder.build()


_factory = _build()


def new_machine() -> BottleActorMachine:
    """A machine in *creating*."""
    return _factory(_Core())
