"""Issue 13 item 3: one bottle cannot starve the others (budgets, fair share, idle timeout).

Unit tests of :mod:`bottlenet.forward.budget` with an injected clock, then real sockets
through the forward table (both engines): one bottle at its budget is refused with a reset,
counted and logged rate-limited, while another bottle's endpoint is still served.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from bottlenet.forward.budget import ConnectionBudget, IdleSweep
from bottlenet.forward.spec import ForwardSpec, TCPListen, TCPTarget
from bottlenet.forward.table import ForwardInfo, ForwardTable
from tests.forward.netutil import Collector, Echo
from tests.forward.test_loopback import _NO_SPLICE, ALIAS, LOOP, Base


def test_per_bottle_budget_counts_all_its_forwards() -> None:
    b = ConnectionBudget(per_bottle=3, total=100, bottles=lambda: 2)
    assert [b.admit("a") for _ in range(3)] == [None, None, None]
    assert b.admit("a") == "bottle"
    assert b.admit("b") is None  # another bottle is not affected
    b.release("a")
    assert b.admit("a") is None
    assert b.refused == {"forward": 0, "bottle": 1, "global": 0}


def test_global_budget_keeps_every_bottles_fair_share() -> None:
    b = ConnectionBudget(per_bottle=100, total=6, bottles=lambda: 3)  # share: 2 each
    assert [b.admit("a") for _ in range(2)] == [None, None]
    # Past its share, "a" may not take the room "b" and "c" still need for theirs.
    assert b.admit("a") == "global"
    assert [b.admit("b") for _ in range(2)] == [None, None]
    assert [b.admit("c") for _ in range(2)] == [None, None]
    assert b.admit("c") == "global"  # the whole budget is in use
    b.release("b")
    b.release("b")
    # "b" went quiet: its share is still kept for it (b holds nothing; owed 2, free 2).
    assert b.admit("a") == "global"
    assert b.admit("b") is None


def test_alone_a_bottle_may_use_the_whole_global_budget() -> None:
    b = ConnectionBudget(per_bottle=100, total=4, bottles=lambda: 1)
    assert [b.admit("a") for _ in range(4)] == [None] * 4
    assert b.admit("a") == "global"


def test_global_budget_from_the_fd_limit_keeps_a_reserve() -> None:
    from bottlenet.forward.budget import RESERVED_FDS, nofile_limit

    b = ConnectionBudget(listeners=lambda: 10)
    n = nofile_limit()
    assert b.total == max(1, (n - min(RESERVED_FDS, n // 4) - 10) // 2)
    assert 2 * b.total + 10 < n  # two fds per relay, and room left for the control socket


class _Session:
    def __init__(self) -> None:
        self.bytes_in = 0
        self.bytes_out = 0
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_idle_sweep_aborts_only_relays_without_progress_and_disarms() -> None:
    clock = Clock()
    told: list[Any] = []
    sweep = IdleSweep(clock, 80.0, told.append)
    assert not sweep.armed and clock.getDelayedCalls() == []
    quiet, busy = _Session(), _Session()
    sweep.started(quiet)
    sweep.started(busy)
    assert len(clock.getDelayedCalls()) == 1  # one timer for all relays
    for _ in range(9):
        busy.bytes_out += 1
        clock.advance(10.0)
    assert quiet.aborted and told == [quiet]
    assert not busy.aborted
    sweep.ended(quiet)
    sweep.ended(busy)
    assert not sweep.armed and clock.getDelayedCalls() == []  # idle daemon: no wakeups


def test_idle_timeout_zero_is_off() -> None:
    clock = Clock()
    sweep = IdleSweep(clock, 0.0)
    s = _Session()
    sweep.started(s)
    clock.advance(1e9)
    assert not s.aborted and clock.getDelayedCalls() == []


class BudgetTests(Base):
    per_bottle = 3

    def setUp(self) -> None:
        super().setUp()
        self.idle_clock = Clock()
        from twisted.internet import reactor

        self.table = ForwardTable(
            reactor,
            self.aliases,
            state_dir=self.state_dir,
            engine=self.engine,
            per_bottle_connections=self.per_bottle,
            idle_timeout=80.0,
            clock=None,
        )
        self.table.startService()
        self.addCleanup(self.table.stopService)

    async def add(self, bottle: str, alias: str, label: str, port: int) -> ForwardInfo:
        spec = ForwardSpec(
            bottle, label, TCPListen(ipaddress.IPv4Address(alias), 0), TCPTarget(LOOP, port)
        )
        return await self.table.add(spec)

    async def echo_client(self, info: ForwardInfo) -> Collector:
        assert isinstance(info.bound, TCPListen)
        c = Collector(b"x", fin=False)
        got: defer.Deferred[None] = defer.Deferred()
        c.on_data = lambda col: got.called or got.callback(None)
        from tests.forward.netutil import connect_tcp

        await connect_tcp(str(info.bound.alias), info.bound.port, c)
        await got
        return c

    async def test_bottle_at_its_budget_does_not_starve_another(self) -> None:
        target = self.target(Echo)
        a1 = await self.add("b1", ALIAS, "web", target)
        a2 = await self.add("b1", ALIAS, "git", target)
        other = await self.add("b2", "127.77.0.3", "web", target)
        held = [await self.echo_client(a1), await self.echo_client(a1)]
        held.append(await self.echo_client(a2))  # the budget spans the bottle's forwards
        with capturedLogs() as events:
            for _ in range(20):
                await self.assert_reset(a2)
            served = await self.echo_client(other)
        assert self.table.get("b1", "git").counters.refused == 20
        assert self.table.budget.refused["bottle"] == 20
        lines = [e for e in events if "refused a connection" in e.get("log_format", "")]
        assert 1 <= len(lines) <= 2, len(lines)  # rate-limited: not one line per refusal
        assert lines[0]["reason"] == "bottle"
        for c in [*held, served]:
            c.transport.loseConnection()  # type: ignore[union-attr]
            await c.done
        await self.until(lambda: self.table.budget.total_active == 0, "slots released")

    async def test_failed_relays_are_logged_rate_limited(self) -> None:
        """Issue 13 item 5: 30 failed relays (target down) give one line, not 30."""
        from tests.netio import refusing_socket

        dead = refusing_socket()
        self.addCleanup(dead.close)
        info = await self.add("b1", ALIAS, "dead", dead.getsockname()[1])
        with capturedLogs() as events:
            for _ in range(30):
                await self.assert_reset(info)
            await self.until(
                lambda: self.table.get("b1", "dead").counters.failed == 30, "30 failures"
            )
        lines = [e for e in events if "relay {bottle}/{label}" in e.get("log_format", "")]
        assert 1 <= len(lines) <= 2, len(lines)
        assert lines[0]["outcome"] == "connect-failed"


class IdleTimeoutTests(Base):
    async def test_idle_relay_is_closed_and_the_sweep_disarms(self) -> None:
        from twisted.internet import reactor

        clock = Clock()
        self.table = ForwardTable(
            reactor,
            self.aliases,
            state_dir=self.state_dir,
            engine=self.engine,
            idle_timeout=80.0,
            clock=clock,
        )
        self.table.startService()
        self.addCleanup(self.table.stopService)
        info = await self.forward(self.target(Echo))
        c = Collector(b"x", fin=False)
        got: defer.Deferred[None] = defer.Deferred()
        c.on_data = lambda col: got.called or got.callback(None)
        await self.client(info, c)
        await got
        self.check_engine()
        assert self.table.idle.armed
        for _ in range(9):
            clock.advance(10.0)
        await c.done
        assert c.reason is not None and not c.eof  # reset, not a clean close
        assert self.table.idle_aborted == 1
        await self.until(lambda: self.table.get("b1", "web").counters.active == 0, "ended")
        assert not self.table.idle.armed and clock.getDelayedCalls() == []


class SpliceBudgetTests(BudgetTests):
    engine = "splice"
    skip = _NO_SPLICE


class SpliceIdleTimeoutTests(IdleTimeoutTests):
    engine = "splice"
    skip = _NO_SPLICE


def test_the_reserve_follows_the_control_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exec session holds a control connection and smolvm's pipes: past 64 control
    connections the reserve grows by 4 fds each, and the derived budget shrinks by half that."""
    from bottlenet.forward import budget
    from bottlenet.forward.budget import RESERVED_FDS, reserved_fds

    assert reserved_fds(64) == RESERVED_FDS == 256
    assert reserved_fds(1) == RESERVED_FDS  # never below the base reserve
    assert reserved_fds(1000) == 4000
    monkeypatch.setattr(budget, "nofile_limit", lambda: 100_000)
    assert ConnectionBudget(reserved=reserved_fds(64)).total == (100_000 - 256) // 2
    assert ConnectionBudget(reserved=reserved_fds(1000)).total == (100_000 - 4000) // 2


@pytest.mark.skipif(_NO_SPLICE is not None, reason="splice() is Linux-only")
def test_t4_a_derived_splice_budget_counts_every_fd_a_stalled_relay_holds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """T4: a splice relay whose two directions stall holds 6 fds (2 sockets, 2 pipes): the
    budget derived from the fd limit must fit that many relays, at 6 fds each, with the
    engine's own pipes, inside the limit minus the reserve (it counted 2 per relay)."""
    from twisted.internet import reactor

    from bottlenet.forward import budget
    from bottlenet.forward.budget import RESERVED_FDS
    from tests.forward.test_loopback import registry_with

    monkeypatch.setattr(budget, "nofile_limit", lambda: 1200)
    table = ForwardTable(
        reactor, registry_with(("b1", ALIAS)), state_dir=str(tmp_path), engine="splice"
    )
    engines = table.engine_factory
    worst = table.budget.total * 6 + getattr(engines, "engine_fds", 0)
    assert worst <= 1200 - RESERVED_FDS
    portable = ForwardTable(
        reactor, registry_with(("b1", ALIAS)), state_dir=str(tmp_path), engine="portable"
    )
    assert portable.budget.total == (1200 - RESERVED_FDS) // 2  # its relays hold 2 fds


def test_the_reserve_never_takes_more_than_a_quarter_of_a_small_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large control cap under a small open-files limit (tests-3 F06): the reserve is
    capped at a quarter of the limit, so the relays keep the rest instead of falling to 1."""
    from bottlenet.forward import budget
    from bottlenet.forward.budget import reserved_fds

    monkeypatch.setattr(budget, "nofile_limit", lambda: 1024)
    assert reserved_fds(1000) == 4000 > 1024
    assert ConnectionBudget(reserved=reserved_fds(1000)).total == (1024 - 256) // 2
    assert ConnectionBudget(reserved=reserved_fds(1000), fds_per_relay=6).total == 768 // 6
