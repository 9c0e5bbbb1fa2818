"""The one waiter helper: early and late callers see the same outcome, each on its own Deferred."""

from __future__ import annotations

import pytest
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.python.failure import Failure

from bottlenet.waiters import OneShot, both, together


def _result(d):  # type: ignore[no-untyped-def]
    out: list[object] = []
    d.addBoth(out.append)
    assert out, "the Deferred has not fired"
    return out[0]


def test_early_and_late_waiters_get_the_result() -> None:
    """A waiter that asked before the outcome and one that asks after both get it."""
    shot: OneShot[int] = OneShot()
    early = shot.when_fired()
    before = (early.called, shot.fired)
    shot.fire(7)
    assert before == (False, False)
    assert shot.fired
    assert _result(early) == 7
    assert _result(shot.when_fired()) == 7


def test_a_failure_reaches_every_waiter() -> None:
    """A failed outcome errbacks every waiter, early or late."""
    shot: OneShot[int] = OneShot()
    early = shot.when_fired()
    shot.fire(Failure(ValueError("no")))
    for d in (early, shot.when_fired()):
        out = _result(d)
        assert isinstance(out, Failure) and out.check(ValueError)


def test_one_callers_callbacks_do_not_change_what_the_next_sees() -> None:
    """Each caller's Deferred is its own: a callback that changes the value touches only it."""
    shot: OneShot[int] = OneShot()
    first = shot.when_fired()
    first.addCallback(lambda n: n + 1)
    second = shot.when_fired()
    shot.fire(1)
    assert _result(first) == 2
    assert _result(second) == 1


def test_firing_twice_is_refused() -> None:
    """The outcome is settled once; a second fire is a programming error, not a silent change."""
    shot: OneShot[None] = OneShot()
    shot.fire(None)
    with pytest.raises(RuntimeError):
        shot.fire(None)


def test_together_runs_every_step_at_once_and_keeps_their_order() -> None:
    """Both steps are under way before either ends; the results come in the steps' order."""
    first: Deferred[str] = Deferred()
    second: Deferred[int] = Deferred()
    done = ensureDeferred(both(first, second))
    second.callback(2)
    assert not done.called
    first.callback("one")
    assert _result(done) == ("one", 2)


def test_together_waits_for_every_step_then_raises_the_first_failure() -> None:
    """A step that fails does not end the wait while another still runs; the first failure
    in time is raised and told at once, the later one only consumed."""
    steps: list[Deferred[None]] = [Deferred(), Deferred(), Deferred()]
    told: list[BaseException] = []
    done = ensureDeferred(together(steps, told.append))
    steps[1].errback(KeyError("first"))
    assert [type(e) for e in told] == [KeyError]
    steps[0].errback(ValueError("second"))
    assert not done.called, "returned while a step still ran"
    steps[2].callback(None)
    out = _result(done)
    assert isinstance(out, Failure) and out.check(KeyError)
    assert len(told) == 1


def test_together_cancelled_cancels_every_step_and_waits_for_each() -> None:
    """Cancelled from outside: each step is cancelled, and the CancelledError comes only
    once every step has ended (one that cleans up after its cancel is waited for)."""
    cleanup: Deferred[None] = Deferred()
    cancelled: list[str] = []

    async def slow_to_end() -> None:
        try:
            await Deferred(lambda _: cancelled.append("slow"))
        except CancelledError:
            await cleanup  # its own undo, after the cancel
            raise

    plain: Deferred[None] = Deferred(lambda _: cancelled.append("plain"))
    done = ensureDeferred(together([slow_to_end(), plain]))
    outcome: list[object] = []
    done.addBoth(outcome.append)
    done.cancel()
    assert sorted(cancelled) == ["plain", "slow"]
    assert outcome == [], "ended while a step was still cleaning up"
    cleanup.callback(None)
    assert len(outcome) == 1
    assert isinstance(outcome[0], Failure) and outcome[0].check(CancelledError)
