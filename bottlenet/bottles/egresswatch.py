"""The sidecar's egress-floor denials as ``egress_denied`` events (issue 35 item 6).

smolvm records each outbound connect or sendto its egress policy refused (the sidecar's
``--block-private`` floor: the host's loopback, the LAN, cloud metadata) in the VM process's
log, and ``machine egress-events --json`` lists them (1.32.2 and 1.37.3 have it). Every
``interval`` seconds this service asks for each VM bottle's sidecar and publishes the denials
it has not published yet as ``egress_denied`` events naming the bottle, their ``detail`` the
operation and destination (``connect 10.0.0.1:443``): never a byte of traffic.

Bounded: one call at a time, at most :data:`PER_POLL` denials asked per sidecar and published
per poll (more are summed up in one event), the last ones seen kept per bottle to tell new from
old. A CLI without the subcommand is asked once. smolvm reads the VMM's log: a denial shows up
here only after a real boot (docs/smolvm.md says which self-test line checks what).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from bottlenet.bottles.events import EGRESS_DENIED, BottleEvent
from bottlenet.bottles.model import Bottle, BottleState
from vmctl.errors import VmctlError
from vmctl.smolvm import EgressDenial, Smolvm

#: Seconds between two polls of every sidecar.
INTERVAL = 15.0
#: Denials asked per sidecar and published per poll; more are one summing event.
PER_POLL = 20

Emit = Callable[[BottleEvent], None]


def new_denials(
    seen: Sequence[EgressDenial], now: Sequence[EgressDenial]
) -> tuple[EgressDenial, ...]:
    """The denials of ``now`` after the last of ``seen`` (both oldest first, ``now`` the newest
    window smolvm gave). With no overlap every one is new (the window moved past ``seen``)."""
    if not seen:
        return tuple(now)
    last = seen[-1]
    for i in range(len(now) - 1, -1, -1):
        if now[i] == last:
            return tuple(now[i + 1 :])
    return tuple(now)


class EgressWatch(Service):
    """Polls each VM bottle's sidecar for egress denials and publishes the new ones."""

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        smolvm: Smolvm,
        bottles: Callable[[], Sequence[Bottle]],
        emit: Emit,
        interval: float = INTERVAL,
    ) -> None:
        self.clock = clock
        self.smolvm = smolvm
        self.bottles = bottles
        self.emit = emit
        self.interval = interval
        #: Per bottle, the newest denials already published (at most PER_POLL).
        self.seen: dict[str, tuple[EgressDenial, ...]] = {}
        self._next: IDelayedCall | None = None
        self._polling: Deferred[None] | None = None
        self._unsupported = False

    def startService(self) -> None:
        super().startService()
        self._schedule()

    def stopService(self) -> None:
        super().stopService()
        if self._next is not None and self._next.active():
            self._next.cancel()
        self._next = None
        if self._polling is not None:
            self._polling.cancel()

    def _schedule(self) -> None:
        if self.running and not self._unsupported:
            self._next = self.clock.callLater(self.interval, self._tick)

    def _tick(self) -> None:
        self._next = None
        self._polling = Deferred.fromCoroutine(self.poll())
        self._polling.addErrback(self._failed)
        self._polling.addBoth(lambda _: self._schedule())

    def _failed(self, failure: Failure) -> None:
        if failure.check(CancelledError) and not self.running:
            return  # the stop cancelled the poll in flight: nothing failed
        self.log.failure("egress watch failed", failure)

    async def poll(self) -> None:
        """One round over every kept VM bottle's sidecar."""
        names = set()
        for bottle in list(self.bottles()):
            vm = bottle.vms
            if vm is None or bottle.state is BottleState.DEGRADED:
                continue
            names.add(bottle.name)
            try:
                found = await self.smolvm.egress_events(vm.sidecar_vm, PER_POLL)
            except VmctlError as e:
                self.log.debug("egress events of {b}: {code}", b=bottle.name, code=e.code)
                continue
            if found is None:
                self._unsupported = True
                self.log.info("smolvm has no machine egress-events: no egress_denied events")
                return
            self._publish(bottle.name, found)
        for gone in set(self.seen) - names:
            del self.seen[gone]

    def _publish(self, name: str, found: tuple[EgressDenial, ...]) -> None:
        fresh = new_denials(self.seen.get(name, ()), found)
        if not fresh:
            return
        self.seen[name] = found[-PER_POLL:]
        details = [f"{d.operation} {d.dest}" for d in fresh]
        if len(fresh) >= PER_POLL:
            details.append(f"at least {PER_POLL} denials since the last look")
        for detail in details:
            self.emit(BottleEvent(EGRESS_DENIED, name, self.clock.seconds(), None, detail))
