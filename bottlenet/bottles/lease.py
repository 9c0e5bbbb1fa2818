"""The lease keeper: a bottle whose owner stopped renewing is destroyed by the daemon itself.

Why: a fleet's owner (a trainer's Ray actor, docs/fleet.md) can vanish without a word (a
crash, a lost node, a partition); its bottle must not run forever. A bottle created with a
lease (``CreateBottle``'s ``lease_seconds``) is reaped once the lease ran out and a grace
(``--lease-grace``) has passed too without a ``RenewLease``: a ``lease_expired`` event, a log
line, then the ordinary destroy (its ``destroyed`` event). A bottle without a lease is never
touched.

Time: while the daemon runs, deadlines are counted on the injected monotonic clock
(``time.monotonic`` in the daemon), so a wall-clock jump forward never reaps a live lease
early; the reactor's timer (wall time in Twisted) only wakes the keeper, which looks at the
monotonic clock and sleeps again if it woke early, and it sleeps at most
:data:`MAX_SLEEP` at a time. A jump backward delays the keeper's pending wake by the jump
(Twisted's timers are wall time): a reap comes late by that much, never early. Across a restart
only wall time exists: each lease's expiry is recorded as wall time, and a restarted daemon
counts what is left of it, then the grace again, from its start (a bottle whose lease ran out
while the daemon was down still gets the grace, so its owner can renew it).
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from bottlenet.bottles.events import DESTROYED, LEASE_EXPIRED, READY, BottleEvent
from bottlenet.bottles.registry import BottleRegistry
from bottlenet.bottles.tenancy import Tenancy, check_lease_seconds
from bottlenet.errors import BottlenetError, Busy, InvalidArgument, NotFound, safe_repr

#: Seconds of grace after a lease runs out, unless ``--lease-grace`` says otherwise.
DEFAULT_GRACE = 30.0
#: The keeper's longest sleep (seconds): it looks at the monotonic clock at least this often
#: (unless the wall clock is stepped back while it sleeps: then the step later).
MAX_SLEEP = 60.0
#: A reap that found the bottle busy (or failed) is tried again this much later (seconds).
RETRY = 5.0


class LeaseKeeper:
    """Counts every leased bottle's deadline and reaps the ones that pass it."""

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        monotonic: Callable[[], float],
        registry: BottleRegistry,
        *,
        grace: float = DEFAULT_GRACE,
    ) -> None:
        self._clock = clock
        self._monotonic = monotonic
        self._registry = registry
        self.grace = grace
        #: bottle -> the monotonic time it is reaped at (its lease + grace ran out).
        self._deadlines: dict[str, float] = {}
        #: Bottles whose reap has started (their lease_expired event is out).
        self._reaping: set[str] = set()
        self._timer: IDelayedCall | None = None
        self._retries: dict[str, IDelayedCall] = {}
        registry.events.subscribe(self._bottle_event)

    @property
    def leased(self) -> int:
        return len(self._deadlines)

    def restore(self) -> None:
        """After recovery: count each restored bottle's lease on from what is left of it
        (wall time), plus the grace again."""
        now = self._clock.seconds()
        for bottle in self._registry.list_bottles():
            lease = None if bottle.tenancy is None else bottle.tenancy.lease
            if lease is not None:
                self._arm(bottle.name, max(lease.expires_at - now, 0.0))

    def renew(self, name: str, seconds: float) -> Tenancy:
        """Extend ``name``'s lease to ``seconds`` from now: counted at once (also for a
        bottle whose restored lease the keeper has not counted yet); then written
        (UNAVAILABLE when the state file cannot be: the new deadline holds in memory)."""
        check_lease_seconds(seconds)
        bottle = self._registry.get_bottle(name)
        tenancy = bottle.tenancy
        if tenancy is None or tenancy.lease is None:
            raise InvalidArgument(f"bottle {name} has no lease to renew")
        if name in self._reaping:
            raise NotFound(f"bottle {name}: its lease expired; it is being destroyed")
        self._arm(name, seconds)
        renewed = tenancy.renewed(seconds, self._clock.seconds())
        self._registry.set_tenancy(name, renewed)
        return renewed

    def deadline_in(self, name: str) -> float | None:
        """Seconds until ``name`` is reaped (None: it has no lease)."""
        deadline = self._deadlines.get(name)
        return None if deadline is None else deadline - self._monotonic()

    def stop(self) -> None:
        """The daemon stops: no more wakeups (the leases are on disk)."""
        for call in [self._timer, *self._retries.values()]:
            if call is not None and call.active():
                call.cancel()
        self._timer = None
        self._retries.clear()

    # -- counting ----------------------------------------------------------------------

    def _bottle_event(self, event: BottleEvent) -> None:
        if event.kind == DESTROYED:
            self._deadlines.pop(event.bottle, None)
            self._reaping.discard(event.bottle)
        elif event.kind == READY and self._registry.has_bottle(event.bottle):
            tenancy = self._registry.get_bottle(event.bottle).tenancy
            if tenancy is not None and tenancy.lease is not None:
                self._arm(event.bottle, tenancy.lease.seconds)

    def _arm(self, name: str, remaining: float) -> None:
        self._deadlines[name] = self._monotonic() + remaining + self.grace
        self._wake_by(self._deadlines[name])

    def _wake_by(self, deadline: float) -> None:
        """The timer fires by ``deadline`` (monotonic) at the latest, and within MAX_SLEEP."""
        delay = min(max(deadline - self._monotonic(), 0.0), MAX_SLEEP)
        timer = self._timer
        if timer is not None and timer.active():
            if timer.getTime() <= self._clock.seconds() + delay:
                return
            timer.cancel()
        self._timer = self._clock.callLater(delay, self._wake)

    def _wake(self) -> None:
        self._timer = None
        now = self._monotonic()
        for name, deadline in list(self._deadlines.items()):
            if deadline <= now and name not in self._reaping:
                self._expire(name)
        waiting = [d for n, d in self._deadlines.items() if n not in self._reaping]
        if waiting:
            self._wake_by(min(waiting))

    # -- reaping -----------------------------------------------------------------------

    def _expire(self, name: str) -> None:
        bottle = self._registry.get_bottle(name) if self._registry.has_bottle(name) else None
        tenancy = None if bottle is None else bottle.tenancy
        if tenancy is None or tenancy.lease is None:
            self._deadlines.pop(name, None)
            return
        self._reaping.add(name)
        detail = (
            f"lease of {tenancy.lease.seconds:g}s ran out and {self.grace:g}s of grace passed "
            "without a renewal"
        )
        self.log.warn(
            "bottle {bottle}: {detail} (owner {owner}): destroying it",
            bottle=name,
            detail=detail,
            owner="-" if tenancy.owner is None else safe_repr(tenancy.owner, 128),
        )
        self._registry.emit(LEASE_EXPIRED, name, None, detail)
        self._reap(name)

    def _reap(self, name: str) -> None:
        def failed(f: Failure) -> None:
            if f.check(NotFound):
                self._deadlines.pop(name, None)
                self._reaping.discard(name)
                return
            if isinstance(f.value, BottlenetError) and not f.check(Busy):
                self.log.warn(
                    "bottle {bottle}: reaping it failed ({code}); retried",
                    bottle=name,
                    code=f.value.code,
                )
            elif not f.check(Busy):  # BUSY: another operation holds it; try again shortly
                self.log.failure("bottle {bottle}: reaping it failed; retried", f, bottle=name)
            self._retries[name] = self._clock.callLater(RETRY, self._retry, name)

        Deferred.fromCoroutine(self._registry.destroy_bottle(name)).addErrback(failed)

    def _retry(self, name: str) -> None:
        self._retries.pop(name, None)
        if name in self._reaping and self._registry.has_bottle(name):
            self._reap(name)
