"""Whether this node takes new bottles: the drain gate (issue 28's node contract).

A placer spreading bottles over many hosts needs to stop new bottles landing on one before
its maintenance, without touching the bottles it holds: that is ``Drain``. While the node
drains, every create from the control plane is refused with ``DRAINING`` (the placer's cue
to try another node); the bottles it holds keep running and can be used and destroyed.
``Drain`` may wait until the node holds no bottle. The state is the node's record in the
state store, so a restarted daemon still drains. Bottles of the config file are the
operator's own, made again at every start: the gate never refuses them.

The gate is a declared machine (*open* or *draining*); :class:`DrainGate` around it does the
work: the record, the event, the waiters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from automat import TypeMachineBuilder
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from bottlenet.bottles.events import DESTROYED, DRAINED, UNDRAINED, BottleEvent, EventBus
from bottlenet.bottles.model import Source
from bottlenet.bottles.store import StateStore
from bottlenet.errors import Draining, Unavailable

#: The node record's key in the state store.
DRAINING_KEY = "draining"


class DrainMachine(Protocol):
    """The inputs of the node's drain state."""

    def drain(self) -> bool:
        """Refuse new bottles from now on: True when the node was open."""

    def undrain(self) -> bool:
        """Take new bottles again: True when the node was draining."""

    def draining(self) -> bool:
        """Whether new bottles are refused now."""


class _Core:
    pass


_builder = TypeMachineBuilder(DrainMachine, _Core)
_open = _builder.state("open")
_draining = _builder.state("draining")
_open.upon(DrainMachine.drain).to(_draining).returns(True)
_draining.upon(DrainMachine.drain).loop().returns(False)
_draining.upon(DrainMachine.undrain).to(_open).returns(True)
_open.upon(DrainMachine.undrain).loop().returns(False)
_open.upon(DrainMachine.draining).loop().returns(False)
_draining.upon(DrainMachine.draining).loop().returns(True)
_machine = _builder.build()


def drain_machine(draining: bool) -> DrainMachine:
    """A drain state that starts open, or draining (as the state store recorded it)."""
    machine = _machine(_Core())
    if draining:
        machine.drain()
    return machine


class DrainGate:
    """The node's drain state, its record, its events and the callers waiting for empty.

    ``held()`` counts the bottles the node holds (creates in flight too); ``record(doc)``
    makes the node's record durable (raises ``Unavailable`` when it cannot be written).
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        events: EventBus,
        held: Callable[[], int],
        record: Callable[[dict[str, object]], None],
        *,
        draining: bool = False,
    ) -> None:
        self._clock = clock
        self._events = events
        self._held = held
        self._record = record
        self._machine = drain_machine(draining)
        self._waiters: list[Deferred[bool]] = []
        events.subscribe(self._bottle_event)

    @property
    def draining(self) -> bool:
        return self._machine.draining()

    def admit(self, source: Source) -> None:
        """Called by the registry before a create: DRAINING for the control plane's."""
        if source is Source.CONTROL and self._machine.draining():
            raise Draining("this node is draining: it takes no new bottles (try another node)")

    def drain(self) -> None:
        """Refuse new bottles (durable before it answers); a second drain changes nothing."""
        if not self._machine.drain():
            return
        try:
            self._record({DRAINING_KEY: True})
        except BaseException:
            self._machine.undrain()
            raise
        self.log.info("node: draining: new bottles are refused ({n} held)", n=self._held())
        self._events.emit(BottleEvent(DRAINED, "", self._clock.seconds()))

    def undrain(self) -> None:
        """Take new bottles again (durable before it answers)."""
        if not self._machine.undrain():
            return
        try:
            self._record({DRAINING_KEY: False})
        except BaseException:
            self._machine.drain()
            raise
        self.log.info("node: undrained: new bottles are taken again")
        self._events.emit(BottleEvent(UNDRAINED, "", self._clock.seconds()))
        waiters, self._waiters = self._waiters, []
        for d in waiters:  # an undrain ends a drain's wait: the node will not empty now
            d.callback(False)

    def when_empty(self, timeout: float) -> Deferred[bool]:
        """True once the node holds no bottle; False when ``timeout`` seconds pass first, or
        the node is undrained meanwhile."""
        d: Deferred[bool] = Deferred()
        if self._held() == 0:
            d.callback(True)
            return d
        self._waiters.append(d)
        call: IDelayedCall = self._clock.callLater(timeout, self._timed_out, d)

        def settled(result: bool) -> bool:
            if call.active():
                call.cancel()
            return result

        d.addCallback(settled)
        return d

    def _timed_out(self, d: Deferred[bool]) -> None:
        if d in self._waiters:
            self._waiters.remove(d)
            d.callback(False)

    def _bottle_event(self, event: BottleEvent) -> None:
        if event.kind == DESTROYED and self._waiters:
            # Looked at on the next turn: a failed create says DESTROYED while it still
            # holds its name (until its operation ends).
            self._clock.callLater(0, self._check_empty)

    def _check_empty(self) -> None:
        if not self._waiters or self._held() != 0:
            return
        waiters, self._waiters = self._waiters, []
        self.log.info("node: drained: it holds no bottle")
        for d in waiters:
            d.callback(True)


def node_recorder(store: StateStore) -> Callable[[dict[str, object]], None]:
    """Writes the node's record into ``store``: UNAVAILABLE when it cannot be made durable."""

    def record(doc: dict[str, object]) -> None:
        try:
            store.put_node(doc)
        except OSError as e:
            DrainGate.log.error("cannot write the state file: {err}", err=e.strerror)
            raise Unavailable(f"cannot write the state file: {e.strerror}") from None

    return record
