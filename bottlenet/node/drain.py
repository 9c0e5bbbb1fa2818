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

from bottlenet.bottles.events import DRAINED, UNDRAINED, BottleEvent
from bottlenet.bottles.model import Source
from bottlenet.bottles.store import StateStore, write
from bottlenet.errors import Draining

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
    """The node's drain state, its record, its event and the callers waiting for empty: the
    table's admission (``bottles.policy.Admission``), asked before each create and told its
    count as bottles leave.

    ``record(doc)`` makes the node's record durable (raises ``Unavailable`` when it cannot be
    written); ``publish`` sends the node's DRAINED and UNDRAINED events.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        publish: Callable[[BottleEvent], None],
        record: Callable[[dict[str, object]], None],
        *,
        draining: bool = False,
    ) -> None:
        self._clock = clock
        self._publish = publish
        self._record = record
        self._machine = drain_machine(draining)
        self._waiters: list[Deferred[bool]] = []

    @property
    def draining(self) -> bool:
        return self._machine.draining()

    def admit(self, source: Source) -> None:
        """Called by the table before a create: DRAINING for the control plane's."""
        if source is Source.CONTROL and self._machine.draining():
            raise Draining("this node is draining: it takes no new bottles (try another node)")

    def held(self, count: int) -> None:
        """The table's count after a bottle left it: at 0 the waiters hear the node is empty."""
        if count != 0 or not self._waiters:
            return
        waiters, self._waiters = self._waiters, []
        self.log.info("node: drained: it holds no bottle")
        for d in waiters:
            d.callback(True)

    def drain(self) -> bool:
        """Refuse new bottles (durable before it answers); False when it already drained."""
        return self._switch(draining=True)

    def undrain(self) -> None:
        """Take new bottles again (durable before it answers)."""
        if not self._switch(draining=False):
            return
        self.log.info("node: undrained: new bottles are taken again")
        waiters, self._waiters = self._waiters, []
        for d in waiters:  # an undrain ends a drain's wait: the node will not empty now
            d.callback(False)

    def _switch(self, *, draining: bool) -> bool:
        """Drain or undrain: recorded, then announced; False when it already was so."""
        machine = self._machine
        forth, back = (
            (machine.drain, machine.undrain) if draining else (machine.undrain, machine.drain)
        )
        if not forth():
            return False
        try:
            self._record({DRAINING_KEY: draining})
        except BaseException:
            back()
            raise
        self._publish(BottleEvent(DRAINED if draining else UNDRAINED, "", self._clock.seconds()))
        return True

    def wait_empty(self, timeout: float) -> Deferred[bool]:
        """True once the table says it holds no bottle; False when ``timeout`` seconds pass
        first, or the node is undrained meanwhile (the caller checks it is not empty now)."""
        d: Deferred[bool] = Deferred()
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


def node_recorder(store: StateStore) -> Callable[[dict[str, object]], None]:
    """Writes the keys of ``doc`` into the node's record in ``store`` (the drain's and the
    pools' keys side by side): UNAVAILABLE when it cannot be made durable."""
    return lambda doc: write(store, lambda s: s.put_node({**s.node, **doc}))
