"""The lease policy: a bottle whose owner stopped renewing is destroyed by the daemon itself.

A fleet's owner (a Ray actor, docs/fleet.md) can vanish without a word; its bottle must not
run forever. A leased bottle is reaped once the lease and a grace (``--lease-grace``) ran out
without a ``RenewLease``: ``lease_expired``, a log line, the ordinary destroy (again every
:data:`RETRY` while another operation holds it). Each owner holds its own :class:`LeaseTimer`
(armed when made or restored and at each renewal), counting on the monotonic clock: a wall
jump forward never reaps early; the reactor (wall time) wakes it at most :data:`MAX_SLEEP`
apart, and a jump back while it sleeps delays a reap by the jump: late, never early. Across
a restart only wall time exists: a restored bottle counts what is left of its recorded
expiry, then the grace again, so its owner can still renew it.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from bottlenet.errors import BottlenetError, Busy, NotFound

#: Seconds of grace after a lease runs out, unless ``--lease-grace`` says otherwise.
DEFAULT_GRACE = 30.0
#: A timer's longest sleep (seconds): it looks at the monotonic clock at least this often
#: (unless the wall clock is stepped back while it sleeps: then the step later).
MAX_SLEEP = 60.0
#: A reap that found the bottle busy (or failed) is tried again this much later (seconds).
RETRY = 5.0
Reap = Callable[[], Deferred[None]]


class LeasePolicy:
    """The clocks and grace every bottle's lease counts with; ``leased``: timers armed now."""

    log = Logger()

    def __init__(
        self, clock: IReactorTime, monotonic: Callable[[], float], grace: float = DEFAULT_GRACE
    ) -> None:
        self.clock, self.monotonic, self.grace, self.leased = clock, monotonic, grace, 0

    def timer(self, name: str, expired: Callable[[], None], reap: Reap) -> LeaseTimer:
        return LeaseTimer(self, name, expired, reap)


class LeaseTimer:
    """One bottle's lease: its monotonic deadline, the one wakeup or retry pending."""

    def __init__(self, policy: LeasePolicy, name: str, expired: Callable[[], None], reap: Reap):
        self._policy, self._name, self._expired, self._reap = policy, name, expired, reap
        self._deadline: float | None = None
        self._call: IDelayedCall | None = None
        self.reaping = False

    @property
    def armed(self) -> bool:
        return self._deadline is not None

    def arm(self, remaining: float) -> None:
        if self._deadline is None:
            self._policy.leased += 1
        self._deadline = self._policy.monotonic() + remaining + self._policy.grace
        self._sleep(self._deadline - self._policy.monotonic())

    def cancel(self) -> None:
        if self._deadline is not None:
            self._policy.leased -= 1
        self._deadline = None
        self._sleep(None)

    def _sleep(self, seconds: float | None) -> None:
        """The one pending wakeup: in ``seconds`` (at most MAX_SLEEP), or none."""
        if self._call is not None and self._call.active():
            self._call.cancel()
        delay = None if seconds is None else min(max(seconds, 0.0), MAX_SLEEP)
        self._call = None if delay is None else self._policy.clock.callLater(delay, self._wake)

    def _wake(self) -> None:
        self._call = None
        if self._deadline is None or self.reaping:
            return
        left = self._deadline - self._policy.monotonic()
        if left > 0:
            self._sleep(left)
            return
        self.reaping = True
        self._expired()
        self._try()

    def _try(self) -> None:
        self._call = None
        self._reap().addErrback(self._failed)

    def _failed(self, f: Failure) -> None:
        if f.check(NotFound) or self._deadline is None:
            return  # gone (or cancelled meanwhile): nothing left to reap
        if isinstance(f.value, BottlenetError) and not f.check(Busy):
            self._policy.log.warn(
                "bottle {bottle}: reaping it failed ({code}); retried",
                bottle=self._name,
                code=f.value.code,
            )
        elif not f.check(Busy):  # BUSY: another operation holds it; try again shortly
            self._policy.log.failure(
                "bottle {bottle}: reaping it failed; retried", f, bottle=self._name
            )
        self._call = self._policy.clock.callLater(RETRY, self._try)
