"""One outcome, any number of waiters: the shape of magic-wormhole's ``OneShotObserver``, typed.

Several objects settle once (a port listening or failing, a relay ending, a registry
finishing its restore) and hand that outcome to whoever asks, before or after. Each caller
gets a Deferred of its own, so one caller's callbacks never change what the next one sees.
Ground floor: Twisted's ``Deferred`` and ``Failure`` only, nothing of the rooms.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

T = TypeVar("T")


class OneShot(Generic[T]):
    """Fires once, with a result or a failure; every waiter, early or late, sees that outcome."""

    def __init__(self) -> None:
        self._waiters: list[Deferred[T]] = []
        self._outcome: tuple[T | Failure] | None = None

    @property
    def fired(self) -> bool:
        """Whether the outcome is known."""
        return self._outcome is not None

    def when_fired(self) -> Deferred[T]:
        """A Deferred of the caller's own that fires (or fails) with the outcome."""
        d: Deferred[T] = Deferred()
        if self._outcome is None:
            self._waiters.append(d)
        else:
            _settle(d, self._outcome[0])
        return d

    def fire(self, outcome: T | Failure) -> None:
        """Settle every waiter; a second call is a programming error."""
        if self._outcome is not None:
            raise RuntimeError("OneShot fired twice")
        self._outcome = (outcome,)
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            _settle(d, outcome)


def _settle(d: Deferred[T], outcome: T | Failure) -> None:
    if isinstance(outcome, Failure):
        d.errback(outcome)
    else:
        d.callback(outcome)
