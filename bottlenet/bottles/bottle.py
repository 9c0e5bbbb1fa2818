"""One owner per bottle: its value, its lifecycle machine, and the runtime handles it keeps.

The registry is the table (the names, the restoring -> serving gate, the cap, the store, the
event bus); what happens to one bottle happens here, on its owner (the shape of transit
relay's ``server_state.py``: one object per party owning its data, the table only a map).
Each owner's machine is a typed automat machine whose core carries the frozen
:class:`~bottlenet.bottles.model.Bottle` value and the handles (the workload waiter, the
revocation not yet durable); its transitions do the work of a degrade, a workload exit and a
failed teardown, so the machine's kept state and the value's cannot drift apart. Effects
that must not re-enter the machine are returned (a degrade hands back the removal of its
listeners) or run after the input. What an owner needs of the table (emit, the resync
timer, forgetting the bottle) is handed in, never imported: the table sits above it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from attrs import define, evolve, frozen
from automat import TypeMachineBuilder
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from bottlenet.bottles import attach, workload
from bottlenet.bottles.attach import ExecRequest
from bottlenet.bottles.bridge import BridgeKeeper, BridgeState, BridgeStatus
from bottlenet.bottles.creation import create_vm
from bottlenet.bottles.egresslayer import (
    LayerKeeper,
    TransparentCount,
    layer_status,
    proxy_endpoint,
)
from bottlenet.bottles.events import (
    BRIDGE_RESTARTED,
    CREATED,
    DEGRADED,
    DESTROYED,
    LEASE_EXPIRED,
    READY,
    WORKLOAD_EXITED,
    BottleEvent,
    EventBus,
)
from bottlenet.bottles.host import VMHost, runs_bridge
from bottlenet.bottles.model import Bottle, BottleState, BottleVMs, Forward, Source
from bottlenet.bottles.policy import Policies
from bottlenet.bottles.probe import ProbeVerdict
from bottlenet.bottles.sessions import Sessions
from bottlenet.bottles.spec import BottleSpec
from bottlenet.bottles.states import IN_FLIGHT, KEPT, Lifecycle
from bottlenet.bottles.store import StateStore, write
from bottlenet.bottles.tenancy import Tenancy, check_lease_seconds
from bottlenet.bottles.vmloss import lost_reason
from bottlenet.bottles.volumes import Requester
from bottlenet.bottles.watch import Watch
from bottlenet.errors import (
    BottlenetError,
    Busy,
    Degraded,
    InvalidArgument,
    IsolationFailed,
    NotFound,
    SmolvmUnavailable,
    Unavailable,
    safe_repr,
)
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import ForwardSpec, TargetSpec, TCPListen
from bottlenet.forward.table import ForwardInfo, ForwardTable
from vmctl.smolvm import GUEST_ROOT

log = Logger(namespace="bottlenet.bottles.bottle")


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


def emit(
    core: _BottleCore,
    kind: str,
    state: str | None = None,
    detail: str | None = None,
    exit_code: int | None = None,
) -> None:
    """One event of the bottle, stamped with the clock's time and its creator, to the wire."""
    hands = core.hands
    if hands is None:
        return
    event = BottleEvent(
        kind, core.name, hands.clock.seconds(), state, detail, exit_code, core.creator
    )
    hands.events.emit(event)


@frozen
class CreateRequest:
    """What a create asks for, parsed and checked (``check_create``): a forward-only bottle's
    ``alias`` (None: the lowest free) and ``source``, a VM bottle's ``spec`` and who asks for
    it (``requester``: its volumes are checked for it; None: the daemon itself); either's
    ``tenancy``, its lease counted from the commit."""

    alias: ipaddress.IPv4Address | None = None
    spec: BottleSpec | None = None
    source: Source = Source.CONTROL
    tenancy: Tenancy | None = None
    requester: Requester | None = None


@frozen
class _Unsynced:
    """A revocation done in memory (listeners closed) whose record is not yet on disk."""

    what: str  # for the bottle's detail and the answer: "removal of forward 'db'", "destroy"
    detail: str | None  # the bottle's own detail, which the record on disk keeps
    remove: bool  # the bottle is being destroyed: its record goes, then the bottle


# -- the machine ------------------------------------------------------------------------


class BottleMachine(Protocol):
    """The inputs of one bottle's machine (each documented transition is declared below)."""

    def begin(self) -> bool:
        """An operation asks for the bottle: False while another one is in flight (BUSY)."""

    def created(self) -> None:
        """The create operation made the bottle (it still holds the bottle until it ends)."""

    def finish(self) -> None:
        """The operation ended: the bottle is idle in its kept state (gone if never made)."""

    def tearing_down(self) -> None:
        """The destroy operation starts deleting the bottle's VMs."""

    def torn_down(self) -> None:
        """The VMs are deleted; the destroy goes on (the record, then the bottle)."""

    def teardown_failed(self, detail: str = "") -> bool:
        """The VM teardown failed: the bottle is degraded (recorded, and DEGRADED emitted
        when it was not already); True when it was not."""

    def removed(self) -> None:
        """The bottle's record and the bottle are gone."""

    def degrade(self, why: str = "") -> Deferred[None] | None:
        """Its sidecar or bridge failed: the waiter stops, the watches end, the value turns
        degraded and DEGRADED is emitted; the removal of its listeners (then its record) is
        handed back. None when it was degraded already (or is still being created)."""

    def workload_exited(self, code: int = 0) -> bool:
        """Its workload ended: a ready bottle turns exited (recorded, WORKLOAD_EXITED); True
        when it did."""

    def lifecycle(self) -> Lifecycle:
        """Where the bottle is now."""

    def kept_state(self) -> BottleState:
        """The state the state file keeps for it now (ready, exited or degraded)."""


@define
class _BottleCore:
    """A bottle's data as its machine carries it: the value and its runtime handles.

    ``hands`` is None for a machine that only decides (a test of its table)."""

    name: str
    hands: Hands | None = None
    #: The scoped peer that created it (``tenancy.creator``): on each of its events.
    creator: str | None = None
    value: Bottle | None = None
    waiter: workload.WorkloadWaiter | None = None
    #: The sidecar VM process's pid watch (a VM bottle's, while it is watched).
    watch: Watch | None = None
    #: bottlenet's in-guest bridge (a VM bottle's that runs one, from its create or restore).
    bridge: BridgeKeeper | None = None
    #: The transparent egress layer (a VM bottle's whose spec names one).
    layer: LayerKeeper | None = None
    pending: _Unsynced | None = None


def stop_waiter(core: _BottleCore) -> None:
    """End the bottle's workload waiter (the workload keeps running)."""
    waiter, core.waiter = core.waiter, None
    if waiter is not None:
        waiter.cancel()


def unwatch(core: _BottleCore) -> None:
    """End the sidecar's pid watch and the bottle's bridge session."""
    watch, core.watch = core.watch, None
    if watch is not None:
        watch.cancel()
    for keeper in (core.bridge, core.layer):
        if keeper is not None:
            keeper.stop()
    core.bridge = core.layer = None


def persist(core: _BottleCore, bottle: Bottle) -> None:
    """Write the bottle's record (UNAVAILABLE when it cannot be written). A pending revocation
    is written with it (then it is durable); a bottle being destroyed is never written."""
    hands, pending = core.hands, core.pending
    if hands is None or hands.store is None or not bottle.persisted:
        return
    if pending is not None and pending.remove:
        return  # being destroyed: its record must go (resync), never be written again
    if pending is not None:  # the "not yet durable" note is never written
        bottle = evolve(bottle, detail=pending.detail)
    record = bottle.to_state()
    write(hands.store, lambda store: store.put(bottle.name, record))
    if pending is not None:
        core.pending = None
        if core.value is not None:
            core.value = evolve(core.value, detail=pending.detail)


def persist_quietly(core: _BottleCore, bottle: Bottle) -> None:
    try:
        persist(core, bottle)
    except Unavailable:
        pass


def _degrade(machine: BottleMachine, core: _BottleCore, why: str = "") -> Deferred[None] | None:
    hands, bottle = core.hands, core.value
    if hands is None or bottle is None:
        return succeed(None)
    degraded = core.value = evolve(bottle, state=BottleState.DEGRADED, detail=why)
    stop_waiter(core)
    log.warn("bottle {bottle} is degraded: {why}", bottle=core.name, why=why)
    emit(core, DEGRADED, BottleState.DEGRADED, why)
    unwatch(core)
    removing = hands.table.remove_bottle(core.name)
    return removing.addCallback(lambda _: persist_quietly(core, degraded))


def _exited(machine: BottleMachine, core: _BottleCore, code: int = 0) -> bool:
    hands, bottle = core.hands, core.value
    if hands is None or bottle is None or bottle.vms is None:
        return True
    detail = f"workload exited with code {code}"
    vms = evolve(bottle.vms, workload=workload.WorkloadState.EXITED, workload_exit_code=code)
    exited = core.value = evolve(bottle, state=BottleState.EXITED, detail=detail, vms=vms)
    log.info("bottle {bottle}: {detail}", bottle=core.name, detail=detail)
    persist_quietly(core, exited)
    emit(core, WORKLOAD_EXITED, BottleState.EXITED, detail, code)
    return True


def _teardown_failed(core: _BottleCore, detail: str, newly: bool) -> bool:
    if core.value is not None:
        degraded = core.value = evolve(core.value, state=BottleState.DEGRADED, detail=detail)
        persist_quietly(core, degraded)
        if newly:
            emit(core, DEGRADED, BottleState.DEGRADED, detail)
    return newly


def _teardown_failed_newly(machine: BottleMachine, core: _BottleCore, detail: str = "") -> bool:
    return _teardown_failed(core, detail, True)


def _teardown_failed_again(machine: BottleMachine, core: _BottleCore, detail: str = "") -> bool:
    return _teardown_failed(core, detail, False)


_bottle = TypeMachineBuilder(BottleMachine, _BottleCore)
_creating = _bottle.state("creating")
_gone = _bottle.state("gone")
_idle = {kept: _bottle.state(str(kept)) for kept in KEPT}
_busy = {kept: _bottle.state(f"busy ({kept})") for kept in KEPT}
_destroying = {kept: _bottle.state(f"destroying ({kept})") for kept in KEPT}

_creating.upon(BottleMachine.begin).loop().returns(False)
_creating.upon(BottleMachine.created).to(_busy[BottleState.READY]).returns(None)
_creating.upon(BottleMachine.finish).to(_gone).returns(None)
_creating.upon(BottleMachine.degrade).loop().returns(None)
_creating.upon(BottleMachine.workload_exited).loop().returns(False)
_creating.upon(BottleMachine.lifecycle).loop().returns(Lifecycle.CREATING)
_creating.upon(BottleMachine.kept_state).loop().returns(BottleState.READY)
_gone.upon(BottleMachine.finish).loop().returns(None)
_gone.upon(BottleMachine.degrade).loop().returns(None)
_gone.upon(BottleMachine.workload_exited).loop().returns(False)
_gone.upon(BottleMachine.lifecycle).loop().returns(Lifecycle.GONE)
for _kept in KEPT:
    _idle[_kept].upon(BottleMachine.begin).to(_busy[_kept]).returns(True)
    _idle[_kept].upon(BottleMachine.removed).to(_gone).returns(None)
    _idle[_kept].upon(BottleMachine.lifecycle).loop().returns(Lifecycle(_kept))
    _busy[_kept].upon(BottleMachine.begin).loop().returns(False)
    _busy[_kept].upon(BottleMachine.finish).to(_idle[_kept]).returns(None)
    _busy[_kept].upon(BottleMachine.tearing_down).to(_destroying[_kept]).returns(None)
    _busy[_kept].upon(BottleMachine.removed).to(_gone).returns(None)
    _busy[_kept].upon(BottleMachine.torn_down).loop().returns(None)  # after teardown_failed
    _busy[_kept].upon(BottleMachine.lifecycle).loop().returns(Lifecycle.BUSY)
    _destroying[_kept].upon(BottleMachine.begin).loop().returns(False)
    _destroying[_kept].upon(BottleMachine.torn_down).to(_busy[_kept]).returns(None)
    _destroying[_kept].upon(BottleMachine.teardown_failed).to(_busy[BottleState.DEGRADED])(
        _teardown_failed_again if _kept is BottleState.DEGRADED else _teardown_failed_newly
    )
    _destroying[_kept].upon(BottleMachine.lifecycle).loop().returns(Lifecycle.DESTROYING)
    # The kept state changes the same way whether the bottle is idle, busy or destroying.
    for _states in (_idle, _busy, _destroying):
        _here = _states[_kept]
        _here.upon(BottleMachine.kept_state).loop().returns(_kept)
        if _kept is BottleState.DEGRADED:
            _here.upon(BottleMachine.degrade).loop().returns(None)
        else:
            _here.upon(BottleMachine.degrade).to(_states[BottleState.DEGRADED])(_degrade)
        if _kept is BottleState.READY:
            _here.upon(BottleMachine.workload_exited).to(_states[BottleState.EXITED])(_exited)
        else:
            _here.upon(BottleMachine.workload_exited).loop().returns(False)

_bottle_machine = _bottle.build()


def creating(core: _BottleCore | None = None) -> BottleMachine:
    """The machine of a bottle a create operation is making."""
    return _bottle_machine(core or _BottleCore(""))


def adopted(kept: BottleState, core: _BottleCore | None = None) -> BottleMachine:
    """The machine of a bottle taken in as it is (restored, kept ``kept``), idle."""
    return _bottle_machine(core or _BottleCore(""), _idle[kept])


# -- the owners -------------------------------------------------------------------------


class BottleOwner:
    """One bottle, either kind: its machine (with the value in its core) and the durable
    revocation every kind shares."""

    #: What an operation for this kind says of a bottle of the other kind.
    other_kind = "is of another kind"

    def __init__(
        self,
        name: str,
        hands: Hands,
        kept: BottleState | None = None,
        *,
        creator: str | None = None,
    ) -> None:
        self.name = name
        self.hands = hands
        self.core = _BottleCore(name, hands, creator)
        self.machine = creating(self.core) if kept is None else adopted(kept, self.core)
        #: Its lease, counted by the node's lease policy (never armed without one).
        self.lease = hands.policies.leases.timer(name, self._lease_ran_out, self._reap)

    @property
    def value(self) -> Bottle | None:
        """The bottle as it is now (None until its create commits it)."""
        return self.core.value

    def require(self) -> Bottle:
        value = self.core.value
        assert value is not None, "an operation on a bottle not yet made"
        return value

    # -- its lease ------------------------------------------------------------------------

    def count_lease(self, now: float) -> None:
        """Count the lease the bottle was made or restored with: what is left of it at
        ``now`` (wall time), then the grace."""
        tenancy = self.require().tenancy
        if tenancy is not None and tenancy.lease is not None:
            self.lease.arm(max(tenancy.lease.expires_at - now, 0.0))

    def renew(self, seconds: float) -> Tenancy:
        """Extend its lease to ``seconds`` from now: counted at once; then written
        (UNAVAILABLE when the state file cannot be: the new deadline holds in memory)."""
        check_lease_seconds(seconds)
        tenancy = self.require().tenancy
        if tenancy is None or tenancy.lease is None or not self.lease.armed:
            raise InvalidArgument(f"bottle {self.name} has no lease to renew")
        if self.lease.reaping:
            raise NotFound(f"bottle {self.name}: its lease expired; it is being destroyed")
        self.lease.arm(seconds)
        renewed = tenancy.renewed(seconds, self.hands.clock.seconds())
        bottle = self.core.value = evolve(self.require(), tenancy=renewed)
        self.persist(bottle)
        return renewed

    def _lease_ran_out(self) -> None:
        tenancy = self.require().tenancy
        assert tenancy is not None and tenancy.lease is not None
        grace = self.hands.policies.leases.grace
        detail = (
            f"lease of {tenancy.lease.seconds:g}s ran out and {grace:g}s of grace passed "
            "without a renewal"
        )
        log.warn(
            "bottle {bottle}: {detail} (owner {owner}): destroying it",
            bottle=self.name,
            detail=detail,
            owner="-" if tenancy.owner is None else safe_repr(tenancy.owner, 128),
        )
        emit(self.core, LEASE_EXPIRED, None, detail)

    def _reap(self) -> Deferred[None]:
        return self.hands.reap(self.name)

    def stop(self) -> None:
        """The daemon stops: its lease is no longer counted (it is on disk)."""
        self.lease.cancel()

    def commit(self, bottle: Bottle) -> None:
        """The create's last step: the value, recorded (nothing kept when it cannot be)."""
        self.core.value = bottle
        try:
            self.persist(bottle)
        except Unavailable:
            self.core.value = None
            raise

    @property
    def pending(self) -> _Unsynced | None:
        return self.core.pending

    def persist(self, bottle: Bottle | None = None) -> None:
        """Write its record (the value unless ``bottle``); UNAVAILABLE when it cannot be."""
        persist(self.core, bottle or self.require())

    def persist_quietly(self, bottle: Bottle | None = None) -> None:
        persist_quietly(self.core, bottle or self.require())

    # -- revocations that must be durable -------------------------------------------------

    def revoke(self, what: str, *, remove: bool = False) -> None:
        """Make a revocation durable. It already happened (listeners closed) and stands
        whatever the disk says; when its record cannot be written the bottle stays revoked,
        says so in its detail (``bottle status``/``ls``), and the write is retried every
        RESYNC_INTERVAL and before any other operation on the bottle, until it is durable
        (a destroyed bottle stays listed until then). The caller gets UNAVAILABLE."""
        bottle = self.require()
        earlier = self.core.pending
        before = bottle.detail if earlier is None else earlier.detail
        self.core.pending = _Unsynced(what, before, remove)
        try:
            self.sync()
        except Unavailable as e:
            note = f"{what} is not yet durable ({e.message}); retried"
            self.core.value = evolve(self.require(), detail=note)
            self.hands.arm_resync(self.name)
            raise Unavailable(
                f"bottle {self.name}: {what} is done (its listeners are closed) but not yet "
                f"durable: {e.message}; the daemon retries until it is"
            ) from None

    def sync(self) -> None:
        """Write the pending revocation (UNAVAILABLE when it still cannot be)."""
        pending = self.core.pending
        assert pending is not None
        bottle = self.require()
        if not pending.remove:
            self.persist(bottle)  # clears the pending entry and the note
            return
        store = self.hands.store
        if store is not None and bottle.persisted:
            write(store, lambda s: s.remove(self.name))
        self.core.pending = None
        self.gone()
        log.info("bottle {bottle} destroyed", bottle=self.name)
        self.lease.cancel()
        emit(self.core, DESTROYED)

    def sync_pending(self) -> None:
        """Before another operation: its earlier revocation must be durable."""
        pending = self.core.pending
        if pending is None:
            return
        try:
            self.sync()
        except Unavailable as e:
            raise Unavailable(
                f"bottle {self.name}: an earlier {pending.what} is not yet durable: {e.message}"
            ) from None

    async def create(self, asked: CreateRequest, listed: Callable[[BottleOwner], None]) -> Bottle:
        """Make the bottle ``asked`` for and record it; ``listed`` it once it is committed."""
        raise NotImplementedError

    async def restore(self, bottle: Bottle) -> Bottle:
        """Recovery: take the recorded ``bottle`` back, as it is kept; the value it holds."""
        raise NotImplementedError

    async def destroy(self) -> None:
        """Release what the bottle holds, then remove its record and the value."""
        raise NotImplementedError

    def gone(self) -> None:
        """Its record is gone: the machine ends, the table forgets it."""
        self.machine.removed()
        self.hands.forget(self.name)


class ForwardBottle(BottleOwner):
    """A forward-only bottle: an alias drawn from the pool, and its forwards."""

    #: What a forward operation says of a bottle of the other kind.
    other_kind = "has VMs: its forwards are managed by the daemon"

    def forward_spec(
        self,
        alias: ipaddress.IPv4Address,
        fwd: Forward,
        max_connections: int | None = None,
    ) -> ForwardSpec:
        return ForwardSpec(
            bottle=self.name,
            label=fwd.label,
            listen=TCPListen(alias, fwd.port),
            target=fwd.target,
            max_connections=max_connections or self.hands.max_connections,
        )

    def forward(
        self, label: str, target: TargetSpec, port: int, max_connections: int | None
    ) -> tuple[ForwardSpec, Forward]:
        """A new forward on the bottle's alias, and its spec."""
        alias = self.hands.aliases.alias_of(self.name)
        if alias is None:
            raise InvalidArgument(f"bottle {self.name} has no alias")
        fwd = Forward(label, target, port)
        return self.forward_spec(alias, fwd, max_connections), fwd

    async def create(self, asked: CreateRequest, listed: Callable[[BottleOwner], None]) -> Bottle:
        """Claim the alias (the one asked for, else the lowest free), record the bottle and
        ``listed`` it: CREATED and READY at once. (A ``spec`` here is one of mode ``none``.)"""
        hands, alias, tenancy = self.hands, asked.alias, asked.tenancy
        addr = hands.aliases.claim(self.name, None if alias is None else str(alias))
        now = hands.clock.seconds()
        bottle = Bottle(
            name=self.name,
            alias=str(addr),
            created_at=now,
            source=asked.source,
            tenancy=None if tenancy is None else tenancy.started(now),
        )
        try:
            self.commit(bottle)
        except Unavailable:
            hands.aliases.release(self.name)
            raise
        log.info("bottle {bottle} created on {alias}", bottle=self.name, alias=str(addr))
        listed(self)
        self.machine.created()
        emit(self.core, CREATED, bottle.state)
        emit(self.core, READY, bottle.state)
        self.count_lease(now)
        return bottle

    async def restore(self, bottle: Bottle) -> Bottle:
        """Recovery: claim the recorded alias and re-bind every recorded forward on its port.
        A forward that cannot be re-bound is logged and left out; the bottle is kept."""
        addr = self.hands.aliases.claim(bottle.name, bottle.alias)
        restored: list[Forward] = []
        for fwd in bottle.forwards:
            try:
                info = await self.hands.table.add(self.forward_spec(addr, fwd))
            except BottlenetError as e:
                log.error(
                    "forward of {bottle} not restored: {err}", bottle=bottle.name, err=e.message
                )
                continue
            restored.append(kept_forward(fwd, info))
        kept = evolve(bottle, alias=str(addr), forwards=tuple(restored))
        self.core.value = kept
        return kept

    async def add_forward(self, spec: ForwardSpec, fwd: Forward) -> ForwardInfo:
        """Bind the forward, then record it (unbound again when it cannot be recorded)."""
        table = self.hands.table
        info = await table.add(spec)
        current = self.require()
        updated = evolve(current, forwards=(*current.forwards, kept_forward(fwd, info)))
        self.core.value = updated
        try:
            self.persist(updated)
        except Unavailable:
            self.core.value = current
            await table.remove(self.name, fwd.label)
            raise
        return info

    async def remove_forward(self, label: str, *, resuming: bool) -> None:
        """Close the forward (now, whatever the disk says), then make that durable."""
        current = self.require()
        if resuming and all(f.label != label for f in current.forwards):
            return  # its earlier removal became durable just now
        await self.hands.table.remove(self.name, label)
        current = self.require()
        forwards = tuple(f for f in current.forwards if f.label != label)
        self.core.value = evolve(current, forwards=forwards)
        self.revoke(f"removal of forward {label!r}")

    async def destroy(self) -> None:
        await self.hands.table.remove_bottle(self.name)
        self.revoke("destroy", remove=True)

    def gone(self) -> None:
        super().gone()
        self.hands.aliases.release(self.name)


class VMBottle(BottleOwner):
    """A bottle with VMs: its sidecar watch and bridge keeper, its workload waiter."""

    #: What a VM operation says of a bottle of the other kind.
    other_kind = "is forward-only: it has no VMs"

    def __init__(
        self,
        name: str,
        hands: Hands,
        kept: BottleState | None = None,
        *,
        creator: str | None = None,
    ) -> None:
        super().__init__(name, hands, kept, creator=creator)
        #: The launcher sessions (Exec, Logs) it holds now, capped.
        self.sessions = Sessions(name)

    async def create(self, asked: CreateRequest, listed: Callable[[BottleOwner], None]) -> Bottle:
        """Run the ``spec``'s create steps (CREATED first, DESTROYED naming the error if one
        fails); the last one records the bottle (with its ``tenancy``, its lease counted from
        then) and ``listed`` it. Then it is watched, and READY. (No ``alias``: ``check_create``
        refused one; ``source`` is always the control plane's.)"""
        hands, spec, tenancy = self.hands, asked.spec, asked.tenancy
        assert spec is not None
        emit(self.core, CREATED, BottleState.CREATING)
        try:
            if hands.host is None:
                raise SmolvmUnavailable(
                    "this daemon runs without smolvm: VM bottles are unavailable"
                )

            def commit(
                bottle: Bottle, bridge: BridgeKeeper | None, layer: LayerKeeper | None
            ) -> None:
                if tenancy is not None:
                    bottle = evolve(bottle, tenancy=tenancy.started(hands.clock.seconds()))
                self.commit(bottle)
                self.core.bridge, self.core.layer = bridge, layer
                listed(self)

            created = await create_vm(hands.host, spec, commit, asked.requester)
        except BaseException as e:
            code = getattr(e, "code", "INTERNAL")
            emit(self.core, DESTROYED, None, f"create failed: {code}")
            hands.policies.tracker.create_failed(code)
            raise
        self.machine.created()  # an Exec was BUSY ("being created") until now
        self.watch()
        bottle = self.core.value or created  # as committed (with its tenancy)
        emit(self.core, READY, bottle.state)
        hands.policies.tracker.vm_started()
        self.count_lease(hands.clock.seconds())
        return bottle

    async def restore(self, bottle: Bottle) -> Bottle:
        """Recovery: the bottle as it was kept (its endpoints re-bound by ``rebind``, or
        kept degraded); the table watches it once it is listed."""
        self.core.value = bottle
        return bottle

    def _host(self) -> VMHost:
        host = self.hands.host
        assert host is not None, "a VM bottle's operation in a daemon without smolvm"
        return host

    async def verify(self) -> tuple[Bottle, ProbeVerdict]:
        """The gate again; its verdict is recorded on the bottle. ISOLATION_FAILED names
        the leak."""
        verdict = await self._host().verify(self.require())
        current = self.core.value
        if current is not None and current.vms is not None:
            current = self.core.value = evolve(
                current, vms=evolve(current.vms, probe=verdict.result)
            )
            persist_quietly(self.core, current)
        if not verdict.passed:
            raise IsolationFailed(f"bottle {self.name}: {verdict.describe()}")
        return self.require(), verdict

    async def set_policy(self, hosts: tuple[str, ...]) -> tuple[str, ...]:
        """Push a new allow-list; the record changes only after the sidecar reloaded it."""
        updated = await self._host().set_policy(self.require(), hosts)
        # Its kept state is the machine's (it may have degraded while the push ran).
        updated = self.core.value = evolve(updated, state=self.machine.kept_state())
        self.persist(updated)
        log.info("bottle {bottle}: egress policy set ({n} hosts)", bottle=self.name, n=len(hosts))
        return hosts

    def bridge_status(self) -> str | None:
        """bottlenet's in-guest bridge, described for ``bottle status``."""
        vm = self.require().vms
        if self.hands.host is None or vm is None:
            return None
        if not runs_bridge(vm.spec, vm.endpoints):
            status = BridgeStatus(BridgeState.OFF)  # the image bridges its own ports
        elif self.core.bridge is None:
            status = BridgeStatus(BridgeState.STOPPED)
        else:
            status = self.core.bridge.status()
        ports = [str(e.guest_port) for e in vm.endpoints if e.guest_path is not None]
        text = status.describe(ports)
        service = vm.spec.agent.transparent_egress if vm.spec.agent else None
        if service is not None:
            text += "; transparent egress " + layer_status(self.core.layer, service).describe()
        return text

    def transparent_counts(self) -> list[TransparentCount]:
        """Its transparent connects per target (none without a layer)."""
        layer = self.core.layer
        return [] if layer is None else layer.counters.rows(self.name)

    def exec_target(self) -> Bottle:
        """The bottle a command may run in: BUSY (being destroyed) or DEGRADED."""
        if self.machine.lifecycle() is Lifecycle.DESTROYING:
            raise Busy(f"bottle {self.name} is being destroyed")
        bottle = self.require()
        if self.machine.kept_state() is BottleState.DEGRADED:
            raise Degraded(f"bottle {self.name} is degraded: {bottle.detail or 'no detail'}")
        return bottle

    def watch(self) -> None:
        """Turn the bottle degraded when its sidecar's VM process exits (the pid watch is
        held in its machine's core), keep its bridge running, and turn it ``exited`` when its
        workload ends."""
        host, bottle = self.hands.host, self.core.value
        if host is None or bottle is None or bottle.vms is None:
            return
        if self.machine.kept_state() is BottleState.DEGRADED:
            return  # nothing left to watch: its endpoints are gone
        vm = bottle.vms
        if self.core.watch is not None:
            self.core.watch.cancel()
        self.core.watch = host.watcher.watch(vm.sidecar_pid, self.sidecar_exited)
        if runs_bridge(vm.spec, vm.endpoints):
            self.core.bridge = host.bridges.keep(
                self.core.bridge,
                self.name,
                vm.agent_vm,
                vm.endpoints,
                on_restarted=lambda detail: emit(self.core, BRIDGE_RESTARTED, None, detail),
                on_failed=self.degrade_later,
                kit=vm.kit,
            )
        self.keep_layer(host, vm)
        self.wait_for_workload()

    def keep_layer(self, host: VMHost, vm: BottleVMs) -> None:
        """Keep the transparent egress layer running (its spec's), as the bridge is kept."""
        service = vm.spec.agent.transparent_egress if vm.spec.agent else None
        if service is None:
            return
        self.core.layer = host.layers.keep_layer(
            self.core.layer,
            self.name,
            vm.agent_vm,
            proxy_endpoint(vm.endpoints, service),
            on_restarted=lambda detail: emit(self.core, BRIDGE_RESTARTED, None, detail),
            on_failed=self.degrade_later,
        )

    @property
    def watched(self) -> bool:
        """Its sidecar's VM process is watched now."""
        return self.core.watch is not None

    def wait_for_workload(self) -> None:
        """Wait for the bottle's running workload to end (nothing if one already waits)."""
        host, bottle = self.hands.host, self.core.value
        vm = None if bottle is None else bottle.vms
        if host is None or vm is None or vm.workload != workload.WorkloadState.RUNNING:
            return
        if self.core.waiter is not None:
            return

        def lost() -> None:
            if self.core.waiter is waiter:
                self.core.waiter = None
                if not waiter.cancelled:
                    Deferred.fromCoroutine(self._after_loss(host.smolvm, vm.agent_vm))

        waiter = workload.WorkloadWaiter(self.workload_ended, lost)
        self.core.waiter = waiter
        request = ExecRequest(tuple(workload.waiter_argv(vm.agent_vm, vm.kit)), user=GUEST_ROOT)

        def failed(f: Failure) -> None:
            lost()
            log.warn(
                "bottle {bottle}: cannot watch its workload: {err}",
                bottle=self.name,
                err=getattr(f.value, "message", type(f.value).__name__),
            )

        assert bottle is not None
        d = Deferred.fromCoroutine(attach.spawn_exec(host, bottle, request, waiter))
        d.addErrback(failed)

    async def _after_loss(self, smolvm: Any, agent_vm: str) -> None:
        """The waiter ended without a code: said so, and the VM's loss made the bottle's
        (a real VM takes its sessions with it: ``bottles/vmloss.py``)."""
        gone = await lost_reason(smolvm, agent_vm)
        log.warn(
            "bottle {bottle}: its workload waiter ended without an exit code ({why})",
            bottle=self.name,
            why=gone or "the agent VM runs; the workload's end will not be noticed",
        )
        if gone is not None:
            self.degrade_later(gone)

    def workload_ended(self, code: int) -> None:
        self.core.waiter = None
        bottle = self.core.value
        if bottle is None or bottle.vms is None:
            return
        if bottle.vms.workload != workload.WorkloadState.RUNNING:
            return
        self.machine.workload_exited(code)

    def stop_watching(self) -> None:
        """The daemon stops: its watches and its workload waiter end (the VMs keep running)."""
        stop_waiter(self.core)
        unwatch(self.core)

    def sidecar_exited(self) -> None:
        self.degrade_later("sidecar VM process exited")

    def degrade_later(self, why: str) -> None:
        """From a watch's callback: nobody awaits the result, so a failure is logged here."""

        def failed(f: Failure) -> None:
            log.failure("bottle {bottle}: degrading it failed", f, bottle=self.name)

        Deferred.fromCoroutine(self.degrade(why)).addErrback(failed)

    async def degrade(self, why: str) -> None:
        """Reset live relays, refuse new connections (listeners removed), record and log."""
        bottle = self.core.value
        if bottle is None or bottle.vms is None:
            return
        removing = self.machine.degrade(why)
        if removing is not None:
            await removing

    async def destroy(self) -> None:
        """Tear the VMs down (a failure leaves it degraded), then the record and the value."""
        host = self.hands.host
        assert host is not None
        bottle = self.require()
        self.stop_watching()
        self.machine.tearing_down()
        try:
            await host.teardown(bottle)
        except Exception as e:
            self.machine.teardown_failed(
                f"teardown incomplete: {getattr(e, 'code', type(e).__name__)}"
            )
            raise
        finally:
            self.machine.torn_down()  # (after a failure: already busy, degraded)
        self.revoke("destroy", remove=True)


def kept_forward(fwd: Forward, info: ForwardInfo) -> Forward:
    """The forward as it is kept: with the port it really bound (port 0 resolved)."""
    bound = info.bound
    return evolve(fwd, port=bound.port) if isinstance(bound, TCPListen) else fwd


class Resync:
    """The revocations not yet durable, by name, written again every ``interval`` (and
    before the bottle's next operation, by its owner) until they are."""

    def __init__(
        self, clock: IReactorTime, owners: Mapping[str, BottleOwner], interval: float
    ) -> None:
        self._clock = clock
        self._owners = owners
        self._interval = interval
        self._names: dict[str, None] = {}
        self._call: IDelayedCall | None = None

    def arm(self, name: str) -> None:
        """``name``'s revocation could not be written: retry it in ``interval``."""
        self._names[name] = None
        if self._call is None or not self._call.active():
            self._call = self._clock.callLater(self._interval, self.resync)

    def _pending(self) -> list[BottleOwner]:
        """The owners whose revocation is still not durable (names done since dropped)."""
        owners = [self._owners.get(n) for n in self._names]
        pending = [o for o in owners if o is not None and o.pending is not None]
        self._names = dict.fromkeys(o.name for o in pending)
        return pending

    def resync(self) -> None:
        """Write every pending revocation again (the timer)."""
        for owner in self._pending():
            if owner.machine.lifecycle() in IN_FLIGHT:
                continue  # its operation syncs it first
            try:
                owner.sync()
            except Unavailable:
                pass
        if self._pending():
            self._call = self._clock.callLater(self._interval, self.resync)

    def stop(self) -> None:
        """The daemon stops: one last write of what is pending, and no more timer."""
        call, self._call = self._call, None
        if call is not None and call.active():
            call.cancel()
        for owner in self._pending():
            try:
                owner.sync()
            except Unavailable:
                log.error(
                    "bottle {bottle}: {what} is still not durable at stop",
                    bottle=owner.name,
                    what=None if owner.pending is None else owner.pending.what,
                )
