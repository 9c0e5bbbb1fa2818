"""Budget rules no test pinned (mutants B02 and B13 of tests-2.md): the global budget is exact
when the number of bottles grows, and the idle sweep disarms after aborting the last relay."""

from __future__ import annotations

from twisted.internet.task import Clock

from bottlenet.forward.budget import ConnectionBudget, IdleSweep


def test_the_global_budget_is_exact_when_a_second_bottle_arrives() -> None:
    """B02: one bottle took all 4 slots alone; a second bottle's first relay is "global"."""
    bottles = [1]
    budget = ConnectionBudget(total=4, bottles=lambda: bottles[0])
    assert [budget.admit("a") for _ in range(4)] == [None] * 4
    bottles[0] = 2
    assert budget.admit("b") == "global"


class Idle:
    bytes_in = bytes_out = 0
    aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_the_sweep_disarms_after_aborting_the_last_relay() -> None:
    """B13: no periodic wakeup once the sweep itself removed the last idle relay."""
    clock = Clock()
    sweep = IdleSweep(clock, 8.0)
    relay = Idle()
    sweep.started(relay)
    for _ in range(10):
        clock.advance(1.0)
    assert relay.aborted and not sweep.armed and clock.getDelayedCalls() == []
