"""A bottle's data and the outputs every owner shares: what the table hands each owner, the
core its machine carries, and the writes and events its transitions make.

An owner's core (:class:`BottleCore`) is its data: the frozen
:class:`~bottlenet.bottles.model.Bottle` value (while its create runs, the bottle as asked,
state ``creating``), its lease timer and the revocation not yet durable. Each event carries
the bottle's scoped creator (its value's ``tenancy.creator``); a record is written only
through :func:`persist`, which keeps a revocation not yet durable on disk as it was. What an
owner needs of the table (the resync timer, forgetting the bottle, the destroy a lease's reap
asks, the node's policies) is handed in (:class:`Hands`), never imported: the table sits
above it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

from attrs import define, evolve, frozen
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from bottlenet.bottles.events import (
    DESTROYED,
    BottleEvent,
    EventBus,
)
from bottlenet.bottles.host import VMHost
from bottlenet.bottles.model import Bottle, BottleState, Source
from bottlenet.bottles.policy import LeaseTimer, Policies
from bottlenet.bottles.spec import BottleSpec
from bottlenet.bottles.store import StateStore, write
from bottlenet.bottles.tenancy import Tenancy
from bottlenet.bottles.volumes import Requester
from bottlenet.errors import (
    Unavailable,
)
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.table import ForwardTable

log = Logger(namespace="bottlenet.bottles.bottle")  # (one namespace for the owners)


@frozen
class Hands:
    """What every owner is handed by the table (the same for all of them)."""

    clock: IReactorTime
    table: ForwardTable
    aliases: AliasRegistry
    host: VMHost | None
    store: StateStore | None
    events: EventBus
    max_connections: int
    #: A revocation of this name could not be written: the table retries it later.
    arm_resync: Callable[[str], None]
    #: The bottle's record and value are gone: the table forgets the name.
    forget: Callable[[str], None]
    #: The table's destroy of a name (a lease's reap).
    reap: Callable[[str], Deferred[None]]
    #: The node's policies: the bottles' outputs tell them (``bottles.policy``).
    policies: Policies


@frozen
class CreateRequest:
    """What a create asks for, parsed and checked (``check_create``): a forward-only bottle's
    ``alias`` (None: the lowest free) and ``source``, a VM bottle's ``spec`` and who asks for
    it (``requester``: its volumes are checked for it; None: the daemon itself); either's
    ``tenancy``, its lease counted from the commit; a warm pool's fill, its ``pool``."""

    alias: ipaddress.IPv4Address | None = None
    spec: BottleSpec | None = None
    source: Source = Source.CONTROL
    tenancy: Tenancy | None = None
    requester: Requester | None = None
    #: A warm pool's fill: the spec hash of the pool its member waits in.
    pool: str | None = None

    def asked(self, name: str, now: float) -> Bottle:
        """The bottle as asked, until its create commits it (never recorded)."""
        return Bottle(
            name=name,
            alias=None,
            created_at=now,
            source=self.source,
            state=BottleState.CREATING,
            tenancy=self.tenancy,
            pool=self.pool,
        )


@frozen
class _Unsynced:
    """A revocation done in memory (listeners closed) whose record is not yet on disk."""

    what: str  # for the bottle's detail and the answer: "removal of forward 'db'", "destroy"
    detail: str | None  # the bottle's own detail, which the record on disk keeps
    remove: bool  # the bottle is being destroyed: its record goes, then the bottle


@define
class BottleCore:
    """An owner's data, which its machine (a VM bottle's) carries: the value, its lease and
    the revocation not yet durable."""

    name: str
    hands: Hands
    value: Bottle
    lease: LeaseTimer
    pending: _Unsynced | None = None


def emit(
    core: BottleCore,
    kind: str,
    state: str | None = None,
    detail: str | None = None,
    exit_code: int | None = None,
) -> None:
    """One event of the bottle, stamped with the clock's time and its creator, to the wire
    (none of a warm pool's member: it is no bottle of anyone's until a create takes it)."""
    if core.value.pool is not None:
        return
    tenancy = core.value.tenancy
    creator = None if tenancy is None else tenancy.creator
    at = core.hands.clock.seconds()
    core.hands.events.emit(BottleEvent(kind, core.name, at, state, detail, exit_code, creator))


def persist(core: BottleCore, bottle: Bottle) -> None:
    """Write the bottle's record (UNAVAILABLE when it cannot be written). A pending revocation
    is written with it (then it is durable); a bottle being destroyed is never written."""
    store, pending = core.hands.store, core.pending
    if store is None or not bottle.persisted:
        return
    if pending is not None and pending.remove:
        return  # being destroyed: its record must go (resync), never be written again
    if pending is not None:  # the "not yet durable" note is never written
        bottle = evolve(bottle, detail=pending.detail)
    record = bottle.to_state()
    write(store, lambda s: s.put(bottle.name, record))
    if pending is not None:
        core.pending = None
        core.value = evolve(core.value, detail=pending.detail)


def persist_quietly(core: BottleCore, bottle: Bottle) -> None:
    try:
        persist(core, bottle)
    except Unavailable:
        pass


def commit(core: BottleCore, bottle: Bottle) -> None:
    """A create's last step: the value, recorded (the bottle as asked again when it cannot
    be); the bottle's lease counts from now on."""
    asked, core.value = core.value, bottle
    try:
        persist(core, bottle)
    except Unavailable:
        core.value = asked
        raise
    count_lease(core)


def count_lease(core: BottleCore) -> None:
    """Count the bottle's lease, made or restored: what is left of it now (wall time), then
    the grace."""
    tenancy = core.value.tenancy
    if tenancy is not None and tenancy.lease is not None:
        core.lease.arm(max(tenancy.lease.expires_at - core.hands.clock.seconds(), 0.0))


def ended(core: BottleCore) -> None:
    """The bottle and its record are gone: the table forgets it, its lease stops, DESTROYED."""
    core.hands.forget(core.name)
    core.lease.cancel()
    log.info("bottle {bottle} destroyed", bottle=core.name)
    emit(core, DESTROYED)
