"""Waiting on outcomes: one outcome for many waiters, and many steps waited on at once.

:class:`OneShot` is the shape of magic-wormhole's ``OneShotObserver``, typed: several objects
settle once (a port listening or failing, a relay ending, a registry finishing its restore)
and hand that outcome to whoever asks, before or after. Each caller gets a Deferred of its
own, so one caller's callbacks never change what the next one sees.

:func:`together` and :func:`both` run steps at once and wait for every one of them to end
(a VM bottle's two boots, its two stops: issue 38); unlike ``gatherResults`` they never
return while a step still runs, so whatever a step makes is recorded before anyone undoes.
Ground floor: Twisted's ``Deferred`` and ``Failure`` only, nothing of the rooms.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Generic, TypeVar, cast

from twisted.internet.defer import CancelledError, Deferred, DeferredList, ensureDeferred
from twisted.python.failure import Failure

T = TypeVar("T")
A = TypeVar("A")
B = TypeVar("B")


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


async def together(
    steps: Sequence[Coroutine[Any, Any, T] | Deferred[T]],
    on_failure: Callable[[BaseException], object] | None = None,
) -> list[T]:
    """Run ``steps`` at once and wait until every one has ended; then raise the failure that
    came first (``on_failure`` hears it as it comes, e.g. to tell the other steps to stop at
    their next point), else return the results in order. No step is cancelled because
    another failed. Cancelled from outside, every step is cancelled and still waited for
    before the CancelledError goes on."""
    failures: list[Failure] = []

    def noted(failure: Failure) -> Failure:
        if not failures and on_failure is not None:
            on_failure(failure.value)
        failures.append(failure)
        return failure

    running: list[Deferred[T]] = [ensureDeferred(step) for step in steps]
    for d in running:
        d.addErrback(noted)
    try:
        results = await DeferredList(running, consumeErrors=True)
    except CancelledError:
        await DeferredList(running, consumeErrors=True)  # each was cancelled: let it end
        raise
    if failures:
        failures[0].raiseException()
    return [result for _, result in results]


async def both(
    first: Coroutine[Any, Any, A] | Deferred[A],
    second: Coroutine[Any, Any, B] | Deferred[B],
    on_failure: Callable[[BaseException], object] | None = None,
) -> tuple[A, B]:
    """:func:`together` for two steps of different types."""
    steps: list[Coroutine[Any, Any, Any] | Deferred[Any]] = [first, second]
    done = await together(steps, on_failure)
    return cast(A, done[0]), cast(B, done[1])
