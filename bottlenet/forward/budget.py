"""Connection budgets and the idle timeout: one bottle cannot starve the others or the daemon.

Three limits apply to every accepted connection, checked once per accept (never per byte):

- the forward's own cap (``max_connections``);
- the bottle's budget: all its forwards together hold at most ``per_bottle`` relays;
- the global budget: at most ``total`` relays in the daemon, derived from the open-files limit
  minus a reserve that keeps room for the control socket, metrics, smolvm's pipes and the
  listeners. Within it every bottle with forwards has a fair share (``total // bottles``): a
  bottle past its share gets a connection only while enough room is left for every other
  bottle to reach its own share.

Each refusal is a reset, counted per reason (metrics) and logged rate-limited by the forward.

The idle timeout aborts a relay that moved no byte in either direction for ``idle_timeout``
seconds (slowloris, or a peer that stopped reading). It is a coarse sweep over live relays
that runs only while relays exist, so an idle daemon has no periodic wakeup.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime

#: Default budget of one bottle (all its forwards together).
DEFAULT_PER_BOTTLE = 4096
#: File descriptors kept out of the relay budget: the control socket and its connections,
#: metrics, smolvm's pipes, log files, the reactor's own.
RESERVED_FDS = 256
#: What one control connection may hold at most: an exec session is its socket plus smolvm's
#: three pipes (or a pty). The reserve grows with the control cap past RESERVED_FDS.
FDS_PER_CONTROL_CONNECTION = 4
#: Default idle timeout (seconds without a byte either way); 0 turns it off.
DEFAULT_IDLE_TIMEOUT = 900.0
#: The sweep runs this many times per timeout (a relay goes at most 1/N late).
SWEEPS_PER_TIMEOUT = 8

REFUSED_FORWARD = "forward"  # the forward's max_connections
REFUSED_BOTTLE = "bottle"  # the bottle's budget
REFUSED_GLOBAL = "global"  # the global budget (or the bottle's fair share of it)
REFUSAL_REASONS = (REFUSED_FORWARD, REFUSED_BOTTLE, REFUSED_GLOBAL)


def reserved_fds(control_connections: int) -> int:
    """The reserve for a daemon whose control listeners hold ``control_connections`` in all."""
    return max(RESERVED_FDS, FDS_PER_CONTROL_CONNECTION * control_connections)


def nofile_limit() -> int:
    """The soft RLIMIT_NOFILE now (the daemon raises it to the hard limit at start)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class ConnectionBudget:
    """Counts live relays per bottle and decides whether one more may be accepted.

    ``total=None`` derives the global budget from the open-files limit each time it is asked
    (minus the reserve, ``listeners()`` (one fd per listening forward) and the engine's own
    fds), divided by the fds one relay may hold (``fds_per_relay``: 6 for splice, whose
    stalled directions keep a pipe each), so raising the limit at start is taken into account.
    """

    def __init__(
        self,
        *,
        per_bottle: int = DEFAULT_PER_BOTTLE,
        total: int | None = None,
        listeners: Callable[[], int] = lambda: 0,
        bottles: Callable[[], int] = lambda: 1,
        reserved: int = RESERVED_FDS,
        fds_per_relay: int = 2,
        engine_fds: int = 0,
    ) -> None:
        self.per_bottle = per_bottle
        #: File descriptors kept out of a budget derived from the open-files limit.
        self.reserved = reserved
        self.configured_total = total
        #: What one relay may hold at most (2 sockets; the splice engine's pipes add up to 4)
        #: and what the relay engine holds itself: a derived budget counts both.
        self.fds_per_relay = fds_per_relay
        self.engine_fds = engine_fds
        self._listeners = listeners
        self._bottles = bottles
        self.active: dict[str, int] = {}
        self.total_active = 0
        self.refused: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)

    @property
    def total(self) -> int:
        if self.configured_total is not None:
            return self.configured_total
        nofile = nofile_limit()
        reserve = min(self.reserved, nofile // 4)
        free = nofile - reserve - self._listeners() - self.engine_fds
        return max(1, free // self.fds_per_relay)

    def admit(self, bottle: str) -> str | None:
        """Take one slot for ``bottle``; None if granted, else the refusal reason."""
        mine = self.active.get(bottle, 0)
        if mine >= self.per_bottle:
            return self._refuse(REFUSED_BOTTLE)
        total = self.total
        if self.total_active >= total:
            return self._refuse(REFUSED_GLOBAL)
        bottles = max(1, self._bottles())
        share = total // bottles
        if mine >= share:
            # Past its fair share: only from room no other bottle still needs for its own.
            others = {b: n for b, n in self.active.items() if b != bottle}
            owed = sum(max(0, share - n) for n in others.values())
            owed += share * max(0, bottles - 1 - len(others))  # others with no relay yet
            if total - self.total_active - 1 < owed:
                return self._refuse(REFUSED_GLOBAL)
        self.active[bottle] = mine + 1
        self.total_active += 1
        return None

    def refuse_forward(self) -> str:
        """Count a refusal by the forward's own cap (checked by the forward first)."""
        return self._refuse(REFUSED_FORWARD)

    def release(self, bottle: str) -> None:
        n = self.active.get(bottle, 0) - 1
        if n > 0:
            self.active[bottle] = n
        else:
            self.active.pop(bottle, None)
        self.total_active -= 1

    def _refuse(self, reason: str) -> str:
        self.refused[reason] += 1
        return reason


class _Progress:
    __slots__ = ("moved", "since")

    def __init__(self, moved: int, since: float) -> None:
        self.moved = moved
        self.since = since


class IdleSweep:
    """Aborts relays that made no progress for ``timeout`` seconds; armed only while any exist.

    Sessions are objects with ``bytes_in``, ``bytes_out`` and ``abort()``, reported through
    :meth:`started` and :meth:`ended`; ``on_idle(session)`` is told before one is aborted.
    """

    def __init__(
        self,
        clock: IReactorTime,
        timeout: float,
        on_idle: Callable[[Any], None] = lambda s: None,
    ) -> None:
        self._clock = clock
        self.timeout = timeout
        self._on_idle = on_idle
        self._seen: dict[Any, _Progress] = {}
        self._call: IDelayedCall | None = None

    @property
    def armed(self) -> bool:
        return self._call is not None

    def started(self, session: Any) -> None:
        """A new relay: arm the sweep if it is not running."""
        if self.timeout <= 0:
            return
        self._seen[session] = _Progress(0, self._clock.seconds())
        if self._call is None:
            self._call = self._clock.callLater(self.timeout / SWEEPS_PER_TIMEOUT, self._sweep)

    def ended(self, session: Any) -> None:
        self._seen.pop(session, None)
        if not self._seen and self._call is not None:
            if self._call.active():
                self._call.cancel()
            self._call = None

    def stop(self) -> None:
        self._seen.clear()
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def _sweep(self) -> None:
        self._call = None
        now = self._clock.seconds()
        idle = []
        for session, seen in self._seen.items():
            moved = session.bytes_in + session.bytes_out
            if moved != seen.moved:
                seen.moved, seen.since = moved, now
            elif now - seen.since >= self.timeout:
                idle.append(session)
        for session in idle:
            self._seen.pop(session, None)
            self._on_idle(session)
            session.abort()
        if self._seen:
            self._call = self._clock.callLater(self.timeout / SWEEPS_PER_TIMEOUT, self._sweep)


__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_PER_BOTTLE",
    "REFUSAL_REASONS",
    "ConnectionBudget",
    "IdleSweep",
]
