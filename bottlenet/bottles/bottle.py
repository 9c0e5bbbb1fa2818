"""One owner per bottle: its value, what it holds, and the revocation not yet durable.

The registry is the table (the names, one operation at a time per bottle, the restoring ->
serving gate, the cap, the store, the event bus); what happens to one bottle happens on its
owner (the shape of transit relay's ``server_state.py``: one object per party owning its
data, the table only a map). Both kinds share the core (:mod:`bottlenet.bottles.core`: the
value, the lease, the revocation not yet durable). A forward-only bottle is made in one step
and lives until it is removed (:class:`ForwardBottle`); a VM bottle's life is its machine,
whose states carry their data (:mod:`bottlenet.bottles.vmmachine`), and its
:class:`VMBottle` runs the create's steps, the verify and the policy push around it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping

from attrs import evolve
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IProcessProtocol, IReactorTime
from twisted.python.failure import Failure

from bottlenet.bottles import workload
from bottlenet.bottles.agentenv import stamp_env
from bottlenet.bottles.core import (
    BottleCore,
    CreateRequest,
    Hands,
    _Unsynced,
    commit,
    emit,
    ended,
    log,
    persist,
    persist_quietly,
)
from bottlenet.bottles.creation import Creation
from bottlenet.bottles.egresslayer import TransparentCount
from bottlenet.bottles.events import BRIDGE_RESTARTED, CREATED, LEASE_EXPIRED, READY
from bottlenet.bottles.host import VMHost
from bottlenet.bottles.model import Bottle, BottleState, Forward
from bottlenet.bottles.policy import LeaseTimer
from bottlenet.bottles.probe import ProbeVerdict
from bottlenet.bottles.sessions import CountedSession
from bottlenet.bottles.states import Lifecycle
from bottlenet.bottles.store import write
from bottlenet.bottles.tenancy import Tenancy, check_lease_seconds
from bottlenet.bottles.vmerrors import map_vmctl
from bottlenet.bottles.vmmachine import LIVE, Running, Teardown, describe_bridge, vm_machine
from bottlenet.bottles.workload import WorkloadState
from bottlenet.errors import (
    BottlenetError,
    Busy,
    Degraded,
    InvalidArgument,
    IsolationFailed,
    NotFound,
    Unavailable,
    safe_repr,
)
from bottlenet.forward.spec import ForwardSpec, TargetSpec, TCPListen
from bottlenet.forward.table import ForwardInfo
from vmctl.errors import VmctlError

__all__ = ["BottleOwner", "CreateRequest", "ForwardBottle", "Hands", "Resync", "VMBottle"]


# -- the owners -------------------------------------------------------------------------


class BottleOwner:
    """One bottle, either kind: its core, its lease, and the durable revocation every kind
    shares."""

    #: What an operation for this kind says of a bottle of the other kind.
    other_kind = "is of another kind"

    def __init__(self, name: str, hands: Hands, value: Bottle) -> None:
        """A bottle being created (``value`` as asked: :meth:`CreateRequest.asked`), or
        restored as it was kept."""
        self.name = name
        self.hands = hands
        #: Its lease, counted by the node's lease policy (never armed without one).
        lease = hands.policies.leases.timer(name, self._lease_ran_out, self._reap)
        self.core = BottleCore(name, hands, value, lease)

    @property
    def made(self) -> bool:
        """Its create committed it (or it was restored)."""
        return self.core.value.state is not BottleState.CREATING

    @property
    def listed(self) -> bool:
        """It exists for every reader: made, and not a warm pool's member waiting."""
        return self.made and self.core.value.pool is None

    def require(self) -> Bottle:
        """The bottle as it is now (its create committed it)."""
        assert self.made, "an operation on a bottle not yet made"
        return self.core.value

    def update(self, bottle: Bottle) -> Bottle:
        """The value changed by an operation (not yet recorded)."""
        self.core.value = bottle
        return bottle

    def phase(self) -> Lifecycle:
        """Where the bottle is (the table says BUSY while an operation holds it)."""
        raise NotImplementedError

    @property
    def pending(self) -> _Unsynced | None:
        return self.core.pending

    @property
    def lease(self) -> LeaseTimer:
        """Its lease, counted by the node's lease policy (never armed without one)."""
        return self.core.lease

    def persist(self, bottle: Bottle | None = None) -> None:
        """Write its record (the value unless ``bottle``); UNAVAILABLE when it cannot be."""
        persist(self.core, bottle or self.require())

    def stop(self) -> None:
        """The daemon stops: its lease is no longer counted (it is on disk)."""
        self.core.lease.cancel()

    # -- its lease ------------------------------------------------------------------------

    def renew(self, seconds: float) -> Tenancy:
        """Extend its lease to ``seconds`` from now: counted at once; then written
        (UNAVAILABLE when the state file cannot be: the new deadline holds in memory)."""
        check_lease_seconds(seconds)
        tenancy, lease = self.require().tenancy, self.core.lease
        if tenancy is None or tenancy.lease is None or not lease.armed:
            raise InvalidArgument(f"bottle {self.name} has no lease to renew")
        if lease.reaping:
            raise NotFound(f"bottle {self.name}: its lease expired; it is being destroyed")
        lease.arm(seconds)
        renewed = tenancy.renewed(seconds, self.hands.clock.seconds())
        self.persist(self.update(evolve(self.require(), tenancy=renewed)))
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
            self.update(evolve(self.require(), detail=note))
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

    async def create(self, asked: CreateRequest) -> Bottle:
        """Make the bottle ``asked`` for and record it."""
        raise NotImplementedError

    async def restore(self) -> Bottle:
        """Recovery: take the recorded bottle back, as it is kept; the value it holds."""
        raise NotImplementedError

    async def destroy(self) -> None:
        """Release what the bottle holds, then remove its record and the value."""
        raise NotImplementedError

    def gone(self) -> None:
        """Its record is gone: the table forgets it."""
        ended(self.core)


class ForwardBottle(BottleOwner):
    """A forward-only bottle: an alias drawn from the pool, and its forwards. Its create is
    one step (no machine): until it commits the bottle is being created, then it is ready
    until it is removed."""

    #: What a forward operation says of a bottle of the other kind.
    other_kind = "has VMs: its forwards are managed by the daemon"

    def phase(self) -> Lifecycle:
        return Lifecycle.READY if self.made else Lifecycle.CREATING

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

    async def create(self, asked: CreateRequest) -> Bottle:
        """Claim the alias (the one asked for, else the lowest free) and record the bottle:
        CREATED and READY at once. (A ``spec`` here is one of mode ``none``.)"""
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
            commit(self.core, bottle)
        except Unavailable:
            hands.aliases.release(self.name)
            raise
        log.info("bottle {bottle} created on {alias}", bottle=self.name, alias=str(addr))
        emit(self.core, CREATED, bottle.state)
        emit(self.core, READY, bottle.state)
        return bottle

    async def restore(self) -> Bottle:
        """Recovery: claim the recorded alias and re-bind every recorded forward on its port.
        A forward that cannot be re-bound is logged and left out; the bottle is kept."""
        bottle = self.require()
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
        return self.update(evolve(bottle, alias=str(addr), forwards=tuple(restored)))

    async def add_forward(self, spec: ForwardSpec, fwd: Forward) -> ForwardInfo:
        """Bind the forward, then record it (unbound again when it cannot be recorded)."""
        table = self.hands.table
        info = await table.add(spec)
        current = self.require()
        updated = self.update(
            evolve(current, forwards=(*current.forwards, kept_forward(fwd, info)))
        )
        try:
            self.persist(updated)
        except Unavailable:
            self.update(current)
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
        self.update(
            evolve(current, forwards=tuple(f for f in current.forwards if f.label != label))
        )
        self.revoke(f"removal of forward {label!r}")

    async def destroy(self) -> None:
        await self.hands.table.remove_bottle(self.name)
        self.revoke("destroy", remove=True)

    def gone(self) -> None:
        super().gone()
        self.hands.aliases.release(self.name)


class VMBottle(BottleOwner):
    """A bottle with VMs: its machine, whose states carry what runs."""

    #: What a VM operation says of a bottle of the other kind.
    other_kind = "is forward-only: it has no VMs"

    def __init__(self, name: str, hands: Hands, value: Bottle) -> None:
        """A bottle being created (``value`` as asked), or restored as it was kept."""
        super().__init__(name, hands, value)
        running = None
        if value.state in (BottleState.READY, BottleState.EXITED):  # restored: it runs again
            running = Running(self, self.host, value.require_vms())
        self.machine = vm_machine(self.core, running)
        if running is not None:
            running.start()

    @property
    def host(self) -> VMHost:
        host = self.hands.host
        assert host is not None, "a VM bottle's operation in a daemon without smolvm"
        return host

    def phase(self) -> Lifecycle:
        return self.machine.phase()

    async def create(self, asked: CreateRequest) -> Bottle:
        """Run the ``spec``'s create steps (CREATED first, DESTROYED naming the error if one
        fails); the last one records the bottle (with its ``tenancy``, its lease counted from
        then); then it runs, READY. (No ``alias``: ``check_create`` refused one.)"""
        assert asked.spec is not None
        creation = Creation(self.host, asked.spec, asked.requester)
        self.machine.begin(creation)
        try:
            with creation:  # (the volumes it resolves stay open until it is committed)
                bottle = evolve(await creation.run(), pool=asked.pool)
                if asked.tenancy is not None:
                    now = self.hands.clock.seconds()
                    bottle = evolve(bottle, tenancy=asked.tenancy.started(now))
                try:
                    self.machine.committed(bottle)
                except BaseException as e:
                    error = await creation.undone(e)
                    if error is e:
                        raise
                    raise error from None
        except BaseException as e:
            self.machine.create_failed(getattr(e, "code", "INTERNAL"))
            raise
        running = Running(self, self.host, bottle.require_vms(), creation.bridge, creation.layer)
        if asked.pool is None:
            self.machine.created(running)  # an Exec was BUSY ("being created") until now
        else:
            self.machine.pooled(running)  # a warm pool's member: no workload, not listed
        running.start()
        return self.require()

    async def take(self, name: str, asked: CreateRequest) -> Bottle:
        """A create takes this warm pool's member as ``name``: the workload of ``asked``'s
        spec started (with the env stamped for its name), the bottle recorded under its name
        (its home's record then goes), its endpoints renamed in the forward table (they
        listen on), READY. A failure raises with the member as it was (its owner destroys
        it: its workload may have started)."""
        member, spec = self.require(), asked.spec
        assert spec is not None and spec.agent is not None and member.pool is not None
        vm, home = member.require_vms(), member.name
        env = stamp_env(spec, vm.mode, vm.endpoints)
        if spec.agent.workload:
            try:
                await workload.start(
                    self.host.smolvm, vm.agent_vm, spec.agent.workload, spec.agent.user, env, vm.kit
                )
            except VmctlError as e:
                raise map_vmctl(e, name) from None
        now = self.hands.clock.seconds()
        state = WorkloadState.RUNNING if spec.agent.workload else None
        taken = evolve(
            member,
            name=name,
            created_at=now,
            pool=None,
            tenancy=None if asked.tenancy is None else asked.tenancy.started(now),
            vms=evolve(vm, spec=spec, env=env, home=home, workload=state),
        )
        store = self.hands.store
        if store is not None:  # the new record first: a crash between keeps the taken one
            write(store, lambda s: s.replace(home, name, taken.to_state()))
        self.hands.table.rename_bottle(home, name)
        self.name = name
        self.core.lease = self.hands.policies.leases.timer(name, self._lease_ran_out, self._reap)
        self.machine.take(self.machine.running(), taken)
        return taken

    async def restore(self) -> Bottle:
        """Recovery: the bottle as it was kept (its endpoints re-bound by ``rebind``, or
        kept degraded); it runs again from its making."""
        return self.require()

    async def verify(self) -> tuple[Bottle, ProbeVerdict]:
        """The gate again; its verdict is recorded on the bottle. ISOLATION_FAILED names
        the leak."""
        verdict = await self.host.verify(self.require())
        current = self.require()
        vm = evolve(current.require_vms(), probe=verdict.result)
        persist_quietly(self.core, self.update(evolve(current, vms=vm)))
        if not verdict.passed:
            raise IsolationFailed(f"bottle {self.name}: {verdict.describe()}")
        return self.require(), verdict

    async def set_policy(self, hosts: tuple[str, ...]) -> tuple[str, ...]:
        """Push a new allow-list; the record changes only after the sidecar reloaded it (the
        bottle as it is then: it may have degraded while the push ran)."""
        await self.host.set_policy(self.require(), hosts)
        current = self.require()
        vm = evolve(current.require_vms(), policy=hosts)
        self.persist(self.update(evolve(current, vms=vm)))
        log.info("bottle {bottle}: egress policy set ({n} hosts)", bottle=self.name, n=len(hosts))
        return hosts

    def bridge_status(self) -> str | None:
        """bottlenet's in-guest bridge, described for ``bottle status``."""
        if self.hands.host is None:
            return None
        if self.phase() in LIVE:
            return self.machine.running().bridge_status()
        return describe_bridge(self.require().require_vms(), None, None)

    def transparent_counts(self) -> list[TransparentCount]:
        """Its transparent connects per target (none without a layer, or when it does not
        run)."""
        layer = self.machine.running().layer if self.phase() in LIVE else None
        return [] if layer is None else layer.counters.rows(self.name)

    def transparent_outcomes(self) -> list[tuple[str, str, int]]:
        """(bottle, outcome, connects) of its layer's connects (the metrics)."""
        layer = self.machine.running().layer if self.phase() in LIVE else None
        outcomes = {} if layer is None else layer.counters.outcomes
        return [(self.name, outcome.value, n) for outcome, n in outcomes.items()]

    def exec_target(self) -> Bottle:
        """The bottle a command may run in: BUSY (being destroyed) or DEGRADED."""
        phase = self.phase()
        if phase is Lifecycle.DESTROYING:
            raise Busy(f"bottle {self.name} is being destroyed")
        bottle = self.require()
        if phase is Lifecycle.DEGRADED:
            raise Degraded(f"bottle {self.name} is degraded: {bottle.detail or 'no detail'}")
        return bottle

    def session(self, inner: IProcessProtocol) -> CountedSession:
        """``inner`` as one of its launcher sessions (after :meth:`exec_target`)."""
        return self.machine.take_session(inner)

    @property
    def watched(self) -> bool:
        """Its sidecar's VM process is watched now (it runs, and the daemon has not stopped)."""
        return self.phase() in LIVE and not self.machine.running().stopped

    def stop(self) -> None:
        """The daemon stops: its lease is not counted, nothing of it is watched."""
        super().stop()
        self.stop_watching()

    def stop_watching(self) -> None:
        """Its watches and its workload waiter end (the VMs and the workload keep running)."""
        if self.phase() in LIVE:
            self.machine.stop()

    # -- what its Running hears ------------------------------------------------------------

    def bridge_restarted(self, detail: str) -> None:
        emit(self.core, BRIDGE_RESTARTED, None, detail)

    def workload_ended(self, code: int) -> None:
        if self.phase() in (Lifecycle.READY, Lifecycle.EXITED):
            self.machine.workload_exited(code)

    def sidecar_exited(self) -> None:
        self.degrade_later("sidecar VM process exited")

    def degrade_later(self, why: str) -> None:
        """From a watch's callback: nobody awaits the result, so a failure is logged here."""

        def failed(f: Failure) -> None:
            log.failure("bottle {bottle}: degrading it failed", f, bottle=self.name)

        Deferred.fromCoroutine(self.degrade(why)).addErrback(failed)

    async def degrade(self, why: str) -> None:
        """Reset live relays, refuse new connections (listeners removed), record and log;
        nothing when it does not run (degraded already, being destroyed, gone)."""
        if self.phase() in LIVE:
            await self.machine.degrade(why)

    async def destroy(self) -> None:
        """Tear the VMs down (a failure leaves it degraded), then the record and the value."""
        try:
            await self.machine.destroy(Teardown(self.host, self.require()))
        except Exception as e:
            self.machine.teardown_failed(
                f"teardown incomplete: {getattr(e, 'code', type(e).__name__)}"
            )
            raise
        self.revoke("destroy", remove=True)

    def gone(self) -> None:
        self.machine.removed()


def kept_forward(fwd: Forward, info: ForwardInfo) -> Forward:
    """The forward as it is kept: with the port it really bound (port 0 resolved)."""
    bound = info.bound
    return evolve(fwd, port=bound.port) if isinstance(bound, TCPListen) else fwd


class Resync:
    """The revocations not yet durable, by name, written again every ``interval`` (and
    before the bottle's next operation, by its owner) until they are. ``busy(name)``: an
    operation holds the bottle (it syncs it first)."""

    def __init__(
        self,
        clock: IReactorTime,
        owners: Mapping[str, BottleOwner],
        interval: float,
        busy: Callable[[str], bool],
    ) -> None:
        self._clock = clock
        self._owners = owners
        self._interval = interval
        self._busy = busy
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
            if self._busy(owner.name):
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
