"""The one waiter helper: early and late callers see the same outcome, each on its own Deferred."""

from __future__ import annotations

import pytest
from twisted.python.failure import Failure

from bottlenet.waiters import OneShot


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
