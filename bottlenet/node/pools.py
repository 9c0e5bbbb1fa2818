"""Warm pools: bottles of one spec kept booted, gated and bridged, for creates to take.

RL rollouts and evaluations create thousands of identical bottles; each plain create waits
for a VM boot. A warm pool (``bottlenetctl pool ensure --spec FILE --size N``) keeps N
bottles of one spec made ahead: their VMs booted, the launch gate passed, the bridge up, no
workload and nothing of the agent's run. A create whose spec has the same hash takes a ready
one (the table does: ``BottleRegistry.create_bottle``; its name, owner, lease and labels
assigned, its endpoints already bound, its workload started) and the pool fills again in the
background. This is the node's policy that tells the table what to make; the members are
bottles of the table (their machine's *pooled* state), counted by it:

- against ``--max-bottles`` like any bottle (a fill waits for room, never takes the last
  place a create was refused for: it is tried again as a bottle leaves);
- kept across a restart: the pools are the node's record in the state store, the members
  bottle records of their own (restored *pooled* by recovery);
- not filled while the node drains: a drain destroys the members waiting (the node empties;
  an undrain fills again);
- replaced when one degrades (its sidecar, bridge or agent VM failed): a new one is made at
  once, the degraded one destroyed;
- a fill that fails is counted (``failed``) and tried again after a back-off (1 s, doubling
  to 60 s), its error kept for ``pool ls``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from attrs import define, field, frozen
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from bottlenet.bottles.pooled import spec_hash
from bottlenet.bottles.spec import BottleSpec, check_local_images, parse_bottle_spec
from bottlenet.bottles.states import Lifecycle
from bottlenet.errors import (
    BottlenetError,
    Busy,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    safe_repr,
)

if TYPE_CHECKING:
    from bottlenet.bottles.registry import BottleRegistry

#: The node record's key of the pools (a list of ``{"spec": DOC, "size": N}``).
POOLS_KEY = "pools"
#: At most this many pools (specs) per node.
MAX_POOLS = 32
#: A failed fill is tried again after this many seconds, doubling up to RETRY_MAX.
RETRY_FIRST = 1.0
RETRY_MAX = 60.0
#: The name a pool's spec is read for (a member gets a home name of its own).
_SPEC_NAME = "pool"


@frozen
class PoolReport:
    """One pool as ``pool ls`` and ``NodeInfo`` tell it."""

    spec_hash: str
    size: int
    ready: int
    filling: int
    failed: int
    #: The last fill's error (None: the last one succeeded, or none failed).
    detail: str | None = None


@define
class _Pool:
    """One pool: its spec, its size, and its fills' failures."""

    doc: dict[str, Any]
    spec: BottleSpec
    size: int
    failed: int = 0
    in_a_row: int = 0
    detail: str | None = None
    retry: IDelayedCall | None = field(default=None, eq=False)


def check_pool_spec(doc: object) -> BottleSpec:
    """A pool's spec: a VM bottle's, with no volumes (they are resolved and checked for
    whoever creates a bottle, when it does) and its local images there."""
    spec = parse_bottle_spec(_SPEC_NAME, doc)
    if spec.agent is None:
        raise InvalidArgument("a pool keeps VM bottles: its spec needs a sidecar and an agent")
    if spec.agent.volumes:
        raise InvalidArgument(
            "agent.volumes: a pool's spec has none (a volume is resolved and checked for "
            "whoever creates the bottle, as it does)"
        )
    check_local_images(spec)
    return spec


class PoolKeeper:
    """The node's warm pools (``bottles.policy.Pools``: what the table tells it of the
    members); ``registry`` is set once the table exists (it takes the node's policies)."""

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        draining: Callable[[], bool],
        record: Callable[[dict[str, object]], None],
        node: Mapping[str, Any] | None = None,
    ) -> None:
        self._clock = clock
        self._draining = draining
        self._record = record
        self.registry: BottleRegistry | None = None
        self._pools: dict[str, _Pool] = {}
        #: Pools to look at on the next turn (the table's outputs come inside its work).
        self._soon: dict[str, None] = {}
        self._call: IDelayedCall | None = None
        self._started = False
        for kept in (node or {}).get(POOLS_KEY) or ():
            self._load(kept)

    def _load(self, kept: object) -> None:
        """One pool of the node's record (a bad one is logged and left out)."""
        try:
            if not isinstance(kept, dict) or not isinstance(kept.get("size"), int):
                raise InvalidArgument("not a pool record")
            spec = check_pool_spec(kept.get("spec"))
        except InvalidArgument as e:
            self.log.error("a kept warm pool is dropped: {err}", err=e.message)
            return
        doc = dict(spec.doc)
        self._pools[spec_hash(doc)] = _Pool(doc, spec, max(0, kept["size"]))

    # -- what the table tells (bottles.policy.Pools) -----------------------------------------

    def member_degraded(self, pool: str, home: str) -> None:
        self.log.warn("warm bottle {home} degraded: replacing it", home=home)
        self._later(pool)

    def taken(self, pool: str) -> None:
        self._later(pool)

    def room(self) -> None:
        for pool in self._pools:
            self._later(pool)

    def _later(self, pool: str) -> None:
        """Look at ``pool`` on the next turn: never inside the table's own work (a machine's
        transition, a create's answer)."""
        self._soon[pool] = None
        if self._call is None:
            self._call = self._clock.callLater(0, self._look)

    def _look(self) -> None:
        self._call = None
        soon, self._soon = self._soon, {}
        for pool in soon:
            self.top_up(pool)

    # -- the operator's controls -------------------------------------------------------------

    def start(self) -> None:
        """The daemon's recovery is done: fill every pool (members kept are counted)."""
        self._started = True
        for pool in list(self._pools):
            self.top_up(pool)

    def stop(self) -> None:
        """The daemon stops: no more fills or retries (a fill in flight ends as a create)."""
        self._started = False
        for pool in self._pools.values():
            if pool.retry is not None and pool.retry.active():
                pool.retry.cancel()
            pool.retry = None
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def ensure(self, doc: object, size: int) -> PoolReport:
        """Keep ``size`` bottles of the spec ``doc`` ready (durable before it answers): a new
        pool, or a pool's new size (members beyond it destroyed)."""
        spec = check_pool_spec(doc)
        registry = self._table()
        if not 0 <= size <= registry.max_bottles:
            raise InvalidArgument(f"size: 0 to --max-bottles ({registry.max_bottles})")
        key = spec_hash(spec.doc)
        if key not in self._pools and len(self._pools) >= MAX_POOLS:
            raise ResourceExhausted(f"this node keeps at most {MAX_POOLS} pools")
        was = self._pools.get(key)
        self._pools[key] = pool = was or _Pool(dict(spec.doc), spec, size)
        pool.size, before = size, (None if was is None else was.size)
        try:
            self._save()
        except BaseException:
            if was is None:
                del self._pools[key]
            else:
                was.size = before if before is not None else size
            raise
        self.log.info("warm pool {pool}: size {size}", pool=key, size=size)
        self.top_up(key)
        return self.report(key)

    def remove(self, key: str) -> int:
        """Forget the pool ``key`` (durable before it answers); its waiting members are
        destroyed (a fill in flight, once it is made). How many were waiting."""
        pool = self._pools.pop(key, None)
        if pool is None:
            raise NotFound(f"no warm pool {safe_repr(key, 40)}")
        try:
            self._save()
        except BaseException:
            self._pools[key] = pool
            raise
        if pool.retry is not None and pool.retry.active():
            pool.retry.cancel()
        self.log.info("warm pool {pool} removed", pool=key)
        return self._trim(key, 0)

    def drained(self) -> None:
        """The node drains: no fill from now on, the waiting members go."""
        for key in list(self._pools):
            self.top_up(key)

    def undrained(self) -> None:
        """The node takes new bottles again: the pools fill."""
        self.room()

    def reports(self) -> list[PoolReport]:
        return [self.report(key) for key in sorted(self._pools)]

    def report(self, key: str) -> PoolReport:
        pool = self._pools[key]
        phases = [phase for _, phase in self._table().members(key)]
        return PoolReport(
            spec_hash=key,
            size=pool.size,
            ready=phases.count(Lifecycle.POOLED),
            filling=phases.count(Lifecycle.CREATING),
            failed=pool.failed,
            detail=pool.detail,
        )

    # -- filling -------------------------------------------------------------------------------

    def top_up(self, key: str) -> None:
        """Bring the pool ``key`` to its size: fill what is missing (while there is room and
        the node does not drain), destroy what is beyond it and what degraded."""
        pool = self._pools.get(key)
        if pool is None:
            self._trim(key, 0)
            return
        if not self._started:
            return
        registry = self._table()
        size = 0 if self._draining() else pool.size
        live = self._trim(key, size, count=True)
        if pool.retry is not None:
            return  # a failed fill is tried again when its back-off ends
        for _ in range(size - live):
            if registry.held() >= registry.max_bottles:
                return  # tried again as a bottle leaves (``room``)
            self._fill(key, pool)

    def _trim(self, key: str, size: int, *, count: bool = False) -> int:
        """Destroy ``key``'s degraded members and its waiting ones beyond ``size``; the
        members left being made or waiting (``count``), else how many were destroyed."""
        members = self._table().members(key)
        live = sum(1 for _, p in members if p in (Lifecycle.POOLED, Lifecycle.CREATING))
        beyond = live - size
        gone = 0
        for home, phase in members:
            if phase is Lifecycle.DEGRADED or (phase is Lifecycle.POOLED and beyond > 0):
                if phase is Lifecycle.POOLED:
                    beyond -= 1
                    live -= 1
                gone += 1
                self._destroy(home)
        return live if count else gone

    def _fill(self, key: str, pool: _Pool) -> None:
        d = Deferred.fromCoroutine(self._table().fill(pool.spec, key))

        def filled(_: object) -> None:
            pool.in_a_row, pool.detail = 0, None
            self._later(key)  # (beyond its size now, or removed meanwhile: trimmed)

        def failed(f: Failure) -> None:
            error = f.value
            if isinstance(error, ResourceExhausted):
                return  # no room: tried again as a bottle leaves
            pool.failed += 1
            pool.in_a_row += 1
            pool.detail = (
                f"{error.code}: {error.message}"
                if isinstance(error, BottlenetError)
                else type(error).__name__
            )
            delay = min(RETRY_MAX, RETRY_FIRST * 2 ** (pool.in_a_row - 1))
            self.log.warn(
                "warm pool {pool}: a fill failed ({detail}); trying again in {delay:g}s",
                pool=key,
                detail=pool.detail,
                delay=delay,
            )
            if pool.retry is None and self._started:
                pool.retry = self._clock.callLater(delay, self._retry, key, pool)

        d.addCallbacks(filled, failed)

    def _retry(self, key: str, pool: _Pool) -> None:
        pool.retry = None
        self.top_up(key)

    def _destroy(self, home: str) -> None:
        def failed(f: Failure) -> None:
            if not f.check(NotFound, Busy):  # gone already, or being taken or destroyed
                self.log.failure("warm bottle {home}: destroying it failed", f, home=home)

        Deferred.fromCoroutine(self._table().destroy_member(home)).addErrback(failed)

    # -- the record ----------------------------------------------------------------------------

    def _save(self) -> None:
        pools = [{"spec": p.doc, "size": p.size} for _, p in sorted(self._pools.items())]
        self._record({POOLS_KEY: pools})

    def _table(self) -> BottleRegistry:
        assert self.registry is not None, "the pools are used before the table exists"
        return self.registry
