"""The bottles the daemon knows, and the operations the control plane and the config run.

A bottle is one :class:`~bottlenet.bottles.model.Bottle` value: forward-only (a name, an alias
drawn from the pool, and its forwards) or with VMs (sidecar VM + agent VM, see
:mod:`bottlenet.bottles.lifecycle`). The registry keeps them in one table and adds what the
lower layers do not know: bottle names (unique across both kinds), one operation at a time per
bottle (BUSY), a limit on the number of bottles, and persistence: every change to a
control-created bottle is written to the state file (one bottle's record at a time), so a
restarted daemon can restore it. Each bottle's lifecycle is a declared machine, one per bottle
(:mod:`bottlenet.bottles.states`), kept beside the bottles; the registry feeds it inputs and
acts on its answers. Arguments arrive validated and typed (the control responder and the
config reader parse them once); the registry re-checks only what its own table decides.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from attrs import evolve, frozen
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IProcessProtocol, IProcessTransport, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from bottlenet.bottles import attach, states, workload
from bottlenet.bottles.attach import ExecRequest
from bottlenet.bottles.creation import create_vm
from bottlenet.bottles.events import (
    BRIDGE_RESTARTED,
    CREATED,
    DEGRADED,
    DESTROYED,
    READY,
    WORKLOAD_EXITED,
    BottleEvent,
    EventBus,
)
from bottlenet.bottles.leftovers import find_leftovers
from bottlenet.bottles.lifecycle import VMLifecycle
from bottlenet.bottles.model import Bottle, BottleState, Forward, Source
from bottlenet.bottles.probe import ProbeVerdict
from bottlenet.bottles.sessions import CountedSession, SessionSlots
from bottlenet.bottles.spec import BottleSpec, check_create
from bottlenet.bottles.states import BottleMachine, Lifecycle
from bottlenet.bottles.store import State, StateStore
from bottlenet.bottles.tenancy import Tenancy
from bottlenet.bottles.workloadwatch import WorkloadWatches
from bottlenet.errors import (
    AlreadyExists,
    BottlenetError,
    Busy,
    Degraded,
    InvalidArgument,
    IsolationFailed,
    NotFound,
    ResourceExhausted,
    SmolvmUnavailable,
    Unavailable,
)
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import DEFAULT_MAX_CONNECTIONS, ForwardSpec, TargetSpec, TCPListen
from bottlenet.forward.table import ForwardInfo, ForwardTable
from bottlenet.views import LazyView

T = TypeVar("T")

DEFAULT_MAX_BOTTLES = 256
#: A revocation that could not be made durable is written again this often until it is.
RESYNC_INTERVAL = 5.0


@frozen
class _Unsynced:
    """A revocation done in memory (listeners closed) whose record is not yet on disk."""

    what: str  # for the bottle's detail and the answer: "removal of forward 'db'", "destroy"
    detail: str | None  # the bottle's own detail, which the record on disk keeps
    remove: bool  # the bottle is being destroyed: its record goes, then the bottle


class BottleRegistry:
    """Forward-only and VM bottles: create, destroy, forwards, egress policy, verify."""

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        table: ForwardTable,
        aliases: AliasRegistry,
        *,
        state_dir: str,
        max_bottles: int = DEFAULT_MAX_BOTTLES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        store: StateStore | None = None,
        instance_id: str = "",
        vms: VMLifecycle | None = None,
    ) -> None:
        self._clock = clock
        self._table = table
        self._aliases = aliases
        self._state_dir = state_dir
        #: The daemon's own directories, which no agent volume may overlap (tap adds more).
        self.protected_dirs: tuple[str, ...] = (state_dir,)
        self._max_bottles = max_bottles
        self._max_connections = max_connections
        self._store = store
        self.instance_id = instance_id
        self.vms = vms
        self._names: list[str] | None = None  # sorted(self._bottles), until a name changes
        self._bottles: _BottleDict = _BottleDict(self._names_changed)
        #: One lifecycle machine per bottle, and per name a create is making.
        self._machines: dict[str, BottleMachine] = {}
        #: The names whose create is in flight (their machine is creating): a count kept as
        #: creates begin and end, so the bottle cap costs no scan of the machines.
        self._creating: set[str] = set()
        self._gate = states.registry_gate()
        #: Every bottle event (created, ready, degraded, destroyed) as it happens.
        self.events = EventBus()
        self._workloads = WorkloadWatches(self._workload_exited, self._degrade_later)
        #: Launcher sessions (Exec, Logs) per bottle, capped below the guest agent's limit.
        self.sessions = SessionSlots()
        self._unsynced: dict[str, _Unsynced] = {}
        self._resync_call: Any = None
        #: Asked before each create (``bottles.drain``: DRAINING while the node drains).
        self.admission: Callable[[Source], None] | None = None

    def emit(
        self,
        kind: str,
        name: str,
        state: str | None = None,
        detail: str | None = None,
        exit_code: int | None = None,
    ) -> None:
        self.events.emit(BottleEvent(kind, name, self._clock.seconds(), state, detail, exit_code))

    def _names_changed(self) -> None:
        self._names = None

    @property
    def recovering(self) -> bool:
        """True while the daemon restores its state; changes wait until it is done."""
        return not self._gate.serving()

    def begin_restore(self) -> None:
        """Recovery starts: every change waits until :meth:`end_restore`."""
        self._gate.restore()

    def end_restore(self) -> None:
        """Recovery is done (or failed): the waiting changes run."""
        waiting = self._gate.restored()
        if waiting is not None:
            waiting.fire(None)

    @property
    def aliases(self) -> AliasRegistry:
        """The alias pool's claims (forward-only bottles hold one each)."""
        return self._aliases

    def state_of(self, name: str) -> Lifecycle | None:
        """Where the bottle ``name`` is in its lifecycle (None: the registry has no such name)."""
        machine = self._machines.get(name)
        return None if machine is None else machine.lifecycle()

    # -- bookkeeping --------------------------------------------------------------------

    async def _locked(
        self, name: str, op: Callable[[], Awaitable[T]], *, create: bool = False
    ) -> T:
        """One operation at a time per bottle: a second one gets BUSY instead of racing.
        ``create`` makes a new name's machine; any other operation needs the bottle."""
        while not self._gate.serving():
            await self._gate.when_serving()
        machine = self._machines.get(name)
        if machine is None:
            if not create:
                self._require(name)  # NOT_FOUND: no machine, no bottle
            machine = self._machines[name] = states.creating()
            self._creating.add(name)
        elif not machine.begin():
            raise Busy(f"bottle {name} has another operation in progress")
        try:
            self._sync_pending(name)
            return await op()
        finally:
            if create:
                self._creating.discard(name)
            machine.finish()
            if machine.lifecycle() is Lifecycle.GONE and self._machines.get(name) is machine:
                del self._machines[name]

    def _require(self, name: str) -> Bottle:
        try:
            return self._bottles[name]
        except KeyError:
            raise NotFound(f"bottle {name} does not exist") from None

    def _require_vms(self, name: str) -> tuple[Bottle, VMLifecycle]:
        bottle = self._require(name)
        if bottle.vms is None:
            raise InvalidArgument(f"bottle {name} is forward-only: it has no VMs")
        assert self.vms is not None
        return bottle, self.vms

    def _require_forward_only(self, name: str) -> Bottle:
        bottle = self._require(name)
        if bottle.has_vms:
            raise InvalidArgument(f"bottle {name} has VMs: its forwards are managed by the daemon")
        return bottle

    def state_records(self) -> dict[str, dict[str, object]]:
        """What the state file holds: every control-created bottle, by name."""
        return {n: b.to_state() for n, b in sorted(self._bottles.items()) if b.persisted}

    def save(self) -> None:
        """Write the whole state file (atomic); an I/O failure is UNAVAILABLE to the caller."""
        if self._store is None:
            return
        self._write(lambda store: store.save(State(self.instance_id, self.state_records())))

    def _persist(self, bottle: Bottle) -> None:
        """Write one control-created bottle's record (UNAVAILABLE when it cannot be written)."""
        if self._store is None or not bottle.persisted:
            return
        pending = self._unsynced.get(bottle.name)
        if pending is not None and pending.remove:
            return  # being destroyed: its record must go (resync), never be written again
        if pending is not None:  # the "not yet durable" note is never written
            bottle = evolve(bottle, detail=pending.detail)
        record = bottle.to_state()
        self._write(lambda store: store.put(bottle.name, record))
        if pending is not None and not pending.remove:
            # This write holds the earlier revocation too: it is durable now.
            del self._unsynced[bottle.name]
            current = self._bottles.get(bottle.name)
            if current is not None:
                self._bottles[bottle.name] = evolve(current, detail=pending.detail)

    # -- revocations that must be durable ------------------------------------------------

    def _revoke(self, name: str, what: str, *, remove: bool = False) -> None:
        """Make a revocation durable. It already happened (listeners closed) and stands
        whatever the disk says; when its record cannot be written the bottle stays revoked,
        says so in its detail (``bottle status``/``ls``), and the write is retried every
        RESYNC_INTERVAL and before any other operation on the bottle, until it is durable
        (a destroyed bottle stays listed until then). The caller gets UNAVAILABLE."""
        bottle = self._bottles[name]
        earlier = self._unsynced.get(name)
        before = bottle.detail if earlier is None else earlier.detail
        self._unsynced[name] = _Unsynced(what, before, remove)
        try:
            self._sync(name)
        except Unavailable as e:
            note = f"{what} is not yet durable ({e.message}); retried"
            self._bottles[name] = evolve(self._bottles[name], detail=note)
            self._arm_resync()
            raise Unavailable(
                f"bottle {name}: {what} is done (its listeners are closed) but not yet "
                f"durable: {e.message}; the daemon retries until it is"
            ) from None

    def _sync(self, name: str) -> None:
        """Write the pending revocation of ``name`` (UNAVAILABLE when it still cannot be)."""
        pending = self._unsynced[name]
        bottle = self._bottles[name]
        if not pending.remove:
            self._persist(bottle)  # clears the pending entry and the note
            return
        if self._store is not None and bottle.persisted:
            self._write(lambda store: store.remove(name))
        del self._unsynced[name]
        del self._bottles[name]
        self._machines.pop(name).removed()
        if bottle.vms is None:
            self._aliases.release(name)
        self.log.info("bottle {bottle} destroyed", bottle=name)
        self.emit(DESTROYED, name)

    def _sync_pending(self, name: str) -> None:
        """Before another operation on ``name``: its earlier revocation must be durable."""
        if name not in self._unsynced:
            return
        try:
            self._sync(name)
        except Unavailable as e:
            raise Unavailable(
                f"bottle {name}: an earlier {self._unsynced[name].what} is not yet durable: "
                f"{e.message}"
            ) from None

    def _arm_resync(self) -> None:
        if self._resync_call is None or not self._resync_call.active():
            self._resync_call = self._clock.callLater(RESYNC_INTERVAL, self.resync)

    def resync(self) -> None:
        """Write every pending revocation again (the timer, and the daemon's stop)."""
        for name in list(self._unsynced):
            if self._machines[name].lifecycle() in states.IN_FLIGHT:
                continue  # its operation syncs it first
            try:
                self._sync(name)
            except Unavailable:
                pass
        if self._unsynced:
            self._arm_resync()

    def stop_resync(self) -> None:
        """The daemon stops: one last write of what is pending, and no more timer."""
        call, self._resync_call = self._resync_call, None
        if call is not None and call.active():
            call.cancel()
        for name in list(self._unsynced):
            try:
                self._sync(name)
            except Unavailable:
                self.log.error(
                    "bottle {bottle}: {what} is still not durable at stop",
                    bottle=name,
                    what=self._unsynced[name].what,
                )

    def _write(self, change: Callable[[StateStore], None]) -> None:
        assert self._store is not None
        try:
            change(self._store)
        except OSError as e:
            self.log.error("cannot write the state file: {err}", err=e.strerror)
            raise Unavailable(f"cannot write the state file: {e.strerror}") from None

    def _persist_quietly(self, bottle: Bottle) -> None:
        try:
            self._persist(bottle)
        except Unavailable:
            pass

    # -- bottles ------------------------------------------------------------------------

    async def create_bottle(
        self,
        name: str,
        alias: ipaddress.IPv4Address | None = None,
        *,
        spec: BottleSpec | None = None,
        source: Source = Source.CONTROL,
        tenancy: Tenancy | None = None,
    ) -> Bottle:
        """Create a bottle: forward-only (no ``spec``, or mode ``none``) or with VMs.
        ``tenancy`` (owner, scoped creator, lease) is recorded with it, its lease counted
        from the commit."""
        if spec is not None:
            check_create(name, alias, spec, self.protected_dirs)

        async def create() -> Bottle:
            if self.admission is not None:
                self.admission(source)
            if name in self._bottles:
                raise AlreadyExists(f"bottle {name} already exists")
            if len(self._bottles) + self._others_creating(name) >= self._max_bottles:
                raise ResourceExhausted(
                    f"the daemon holds its maximum of {self._max_bottles} bottles"
                )
            if spec is not None and spec.has_vms:
                self.emit(CREATED, name, BottleState.CREATING)
                try:
                    created = await self._create_vm(name, spec, tenancy)
                except BaseException as e:
                    code = getattr(e, "code", "INTERNAL")
                    self.emit(DESTROYED, name, None, f"create failed: {code}")
                    raise
                self.emit(READY, name, created.state)
                return created
            addr = self._aliases.claim(name, None if alias is None else str(alias))
            now = self._clock.seconds()
            bottle = Bottle(
                name=name,
                alias=str(addr),
                created_at=now,
                source=source,
                tenancy=None if tenancy is None else tenancy.started(now),
            )
            self._bottles[name] = bottle
            try:
                self._persist(bottle)
            except Unavailable:
                del self._bottles[name]
                self._aliases.release(name)
                raise
            self._created(name)
            self.log.info("bottle {bottle} created on {alias}", bottle=name, alias=str(addr))
            self.emit(CREATED, name, bottle.state)
            self.emit(READY, name, bottle.state)
            return bottle

        return await self._locked(name, create, create=True)

    @property
    def max_bottles(self) -> int:
        return self._max_bottles

    def held(self) -> int:
        """The bottles the node holds, creates in flight included (``bottles.drain``)."""
        return len(self._bottles) + self._others_creating("")

    def _others_creating(self, name: str) -> int:
        """Creates in flight for other names: they count against the limit (a committed
        one is counted with the bottles too, until its create returns)."""
        return len(self._creating) - (name in self._creating)

    def _created(self, name: str) -> None:
        """The create of ``name`` made its bottle: no longer a create in flight."""
        self._machines[name].created()
        self._creating.discard(name)

    async def _create_vm(self, name: str, spec: BottleSpec, tenancy: Tenancy | None) -> Bottle:
        if self.vms is None:
            raise SmolvmUnavailable("this daemon runs without smolvm: VM bottles are unavailable")

        def commit(bottle: Bottle) -> None:
            if tenancy is not None:
                bottle = evolve(bottle, tenancy=tenancy.started(self._clock.seconds()))
            self._bottles[name] = bottle
            try:
                self._persist(bottle)
            except Unavailable:
                del self._bottles[name]
                raise

        bottle = await create_vm(self.vms, spec, commit)
        bottle = self._bottles.get(name, bottle)  # as committed (with its tenancy)
        # The last step committed it; an Exec was BUSY ("being created") until now.
        self._created(name)
        self.watch(bottle)
        return bottle

    async def destroy_bottle(self, name: str) -> None:
        """Stop the bottle's listeners, abort its relays, delete its VMs, release its alias."""

        resuming = name in self._unsynced

        async def destroy() -> None:
            if resuming and name not in self._bottles:
                return  # an earlier destroy of it became durable just now (_locked)
            bottle = self._require(name)  # (inside the lock: a bottle being created is BUSY)
            if bottle.vms is not None:
                assert self.vms is not None
                machine = self._machines[name]
                self._stop_waiting(name)
                machine.tearing_down()
                try:
                    await self.vms.teardown(bottle)
                except Exception as e:
                    detail = f"teardown incomplete: {getattr(e, 'code', type(e).__name__)}"
                    degraded = evolve(bottle, state=BottleState.DEGRADED, detail=detail)
                    newly = machine.teardown_failed()
                    self._bottles[name] = degraded
                    self._persist_quietly(degraded)
                    if newly:
                        self.emit(DEGRADED, name, BottleState.DEGRADED, detail)
                    raise
                finally:
                    machine.torn_down()  # (after a failure: already busy, degraded)
            else:
                await self._table.remove_bottle(name)
            # The record goes first, then the bottle and its alias (_sync).
            self._revoke(name, "destroy", remove=True)

        await self._locked(name, destroy)

    def list_bottles(self) -> Sequence[Bottle]:
        """Every bottle by name. The sorted names are kept until a bottle comes or goes, so a
        page of a listing costs the page, not a sort of every bottle."""
        names = self._names
        if names is None:
            names = self._names = sorted(self._bottles)
        return LazyView(names, self._bottles.__getitem__)

    def get_bottle(self, name: str) -> Bottle:
        return self._require(name)

    def has_bottle(self, name: str) -> bool:
        return name in self._bottles

    def set_tenancy(self, name: str, tenancy: Tenancy) -> None:
        """Record a bottle's new tenancy (a renewed lease): in memory at once, then on disk
        (UNAVAILABLE when it cannot be written; the bottle keeps it in memory)."""
        bottle = evolve(self._require(name), tenancy=tenancy)
        self._bottles[name] = bottle
        self._persist(bottle)

    async def leftovers(self, name: str) -> list[str]:
        """What the bottle ``name``, if it no longer exists, left on the host (selftest)."""
        if name in self._bottles:
            return [f"bottle {name} still exists"]
        vms = self.vms
        return await find_leftovers(
            name,
            reactor=self._clock if vms is None else vms.reactor,
            smolvm=None if vms is None else vms.smolvm,
            state_dir=self._state_dir,
            per_vm_uids=vms is not None and vms.access.per_vm,
        )

    # -- VM bottles ---------------------------------------------------------------------

    async def verify_bottle(self, name: str) -> tuple[Bottle, ProbeVerdict]:
        """Run the isolation probe in the agent VM again; ISOLATION_FAILED names the leak."""
        bottle, vms = self._require_vms(name)

        async def verify() -> tuple[Bottle, ProbeVerdict]:
            verdict = await vms.verify(bottle)
            current = self._bottles.get(name)
            if current is not None and current.vms is not None:
                current = evolve(current, vms=evolve(current.vms, probe=verdict.result))
                self._bottles[name] = current
                self._persist_quietly(current)
            if not verdict.passed:
                raise IsolationFailed(f"bottle {name}: {verdict.describe()}")
            return self._require(name), verdict

        return await self._locked(name, verify)

    async def set_egress_policy(self, name: str, hosts: tuple[str, ...]) -> tuple[str, ...]:
        """Push a new (validated) allow-list; the record changes only after the sidecar
        reloaded it."""
        self._require_vms(name)

        async def push() -> tuple[str, ...]:
            current, vms = self._require_vms(name)
            updated = await vms.set_policy(current, hosts)
            # Its kept state is the machine's (it may have degraded while the push ran).
            updated = evolve(updated, state=self._machines[name].kept_state())
            self._bottles[name] = updated
            self._persist(updated)
            self.log.info(
                "bottle {bottle}: egress policy set ({n} hosts)", bottle=name, n=len(hosts)
            )
            return hosts

        return await self._locked(name, push)

    def exec_target(self, name: str) -> Bottle:
        """The VM bottle a command may run in: NOT_FOUND, INVALID_ARGUMENT (forward-only),
        BUSY (being created or destroyed) or DEGRADED otherwise."""
        now = self.state_of(name)
        if now is Lifecycle.CREATING:
            raise Busy(f"bottle {name} is being created")
        if now is Lifecycle.DESTROYING:
            raise Busy(f"bottle {name} is being destroyed")
        bottle, _ = self._require_vms(name)
        if self._machines[name].kept_state() is BottleState.DEGRADED:
            raise Degraded(f"bottle {name} is degraded: {bottle.detail or 'no detail'}")
        return bottle

    async def spawn_exec(
        self,
        name: str,
        request: ExecRequest,
        protocol: IProcessProtocol,
        stdio: tuple[int, int, int] | None = None,
    ) -> IProcessTransport:
        """Run ``request`` in the bottle's agent VM, ``protocol`` attached to its stdio
        (or the command on the fds ``stdio``, ``protocol`` told only of its end); BUSY past
        the bottle's session cap (``bottles/sessions.py``)."""
        bottle = self.exec_target(name)
        return await self._counted(bottle, request, protocol, stdio)

    async def _counted(
        self,
        bottle: Bottle,
        request: ExecRequest,
        protocol: IProcessProtocol,
        stdio: tuple[int, int, int] | None = None,
    ) -> IProcessTransport:
        """A launcher's session, holding one of the bottle's slots until its child ends."""
        slot = self.sessions.take(bottle.name)
        try:
            return await attach.spawn_exec(
                self.vms, bottle, request, CountedSession(protocol, slot), stdio=stdio
            )
        except BaseException:
            slot.release()
            raise

    def watch(self, bottle: Bottle) -> None:
        """Turn the bottle degraded when its sidecar's VM process exits, and ``exited`` when
        its workload ends."""
        name = bottle.name
        if self.vms is None or bottle.vms is None:
            return
        if self._machines[name].kept_state() is BottleState.DEGRADED:
            return  # nothing left to watch: its endpoints are gone
        self.vms.watch(
            bottle,
            lambda: self._sidecar_exited(name),
            on_bridge_restarted=lambda detail: self.emit(BRIDGE_RESTARTED, name, None, detail),
            on_bridge_failed=lambda why: self._bridge_failed(name, why),
        )
        self._wait_for_workload(bottle)

    async def spawn_logs(
        self, name: str, tail: int, follow: bool, protocol: IProcessProtocol
    ) -> IProcessTransport:
        """``tail`` of the workload's log in the agent VM, ``protocol`` attached."""
        bottle = self.exec_target(name)
        vm = bottle.require_vms()
        if vm.workload is None:
            raise InvalidArgument(f"bottle {name} runs no workload (its spec names none)")
        argv = workload.logs_argv(vm.agent_vm, tail, follow)
        return await self._counted(bottle, ExecRequest(tuple(argv)), protocol)

    def _wait_for_workload(self, bottle: Bottle) -> None:
        if self.vms is not None:
            self._workloads.watch(self.vms, bottle)

    def _stop_waiting(self, name: str) -> None:
        self._workloads.stop(name)

    def stop_watching(self) -> None:
        """The daemon stops: end every workload waiter (the workloads themselves keep running)."""
        self._workloads.stop_all()

    def _workload_exited(self, name: str, code: int) -> None:
        bottle = self._bottles.get(name)
        if (
            bottle is None
            or bottle.vms is None
            or bottle.vms.workload != workload.WorkloadState.RUNNING
        ):
            return
        if not self._machines[name].workload_exited():
            return  # degraded: it stays so
        detail = f"workload exited with code {code}"
        exited = evolve(
            bottle,
            state=BottleState.EXITED,
            detail=detail,
            vms=evolve(bottle.vms, workload=workload.WorkloadState.EXITED, workload_exit_code=code),
        )
        self._bottles[name] = exited
        self.log.info("bottle {bottle}: {detail}", bottle=name, detail=detail)
        self._persist_quietly(exited)
        self.emit(WORKLOAD_EXITED, name, BottleState.EXITED, detail, code)

    def _bridge_failed(self, name: str, why: str) -> None:
        self._degrade_later(name, why)

    def _sidecar_exited(self, name: str) -> None:
        self._degrade_later(name, "sidecar VM process exited")

    def _degrade_later(self, name: str, why: str) -> None:
        """From a watch's callback: nobody awaits the result, so a failure is logged here."""

        def failed(f: Failure) -> None:
            self.log.failure("bottle {bottle}: degrading it failed", f, bottle=name)

        Deferred.fromCoroutine(self.degrade(name, why)).addErrback(failed)

    async def degrade(self, name: str, why: str) -> None:
        """Reset live relays, refuse new connections (listeners removed), record and log."""
        bottle = self._bottles.get(name)
        if bottle is None or bottle.vms is None:
            return
        if not self._machines[name].degrade():
            return  # already degraded (or still being created)
        degraded = evolve(bottle, state=BottleState.DEGRADED, detail=why)
        self._stop_waiting(name)
        self._bottles[name] = degraded
        self.log.warn("bottle {bottle} is degraded: {why}", bottle=name, why=why)
        self.emit(DEGRADED, name, BottleState.DEGRADED, why)
        if self.vms is not None:
            self.vms.unwatch(name)
        await self._table.remove_bottle(name)
        self._persist_quietly(degraded)

    # -- recovery -----------------------------------------------------------------------

    def adopt(self, bottle: Bottle) -> None:
        """Recovery: take a restored bottle into the table (its listeners are bound), idle
        in the state it was kept in."""
        self._bottles[bottle.name] = bottle
        self._machines[bottle.name] = states.adopted(bottle.state)

    async def restore_forward_only(self, bottle: Bottle) -> Bottle:
        """Recovery: claim the recorded alias and re-bind every recorded forward on its port.

        A forward that cannot be re-bound is logged and left out; the bottle is kept.
        """
        addr = self._aliases.claim(bottle.name, bottle.alias)
        restored: list[Forward] = []
        for fwd in bottle.forwards:
            try:
                info = await self._table.add(self._forward_spec(bottle.name, addr, fwd))
            except BottlenetError as e:
                self.log.error(
                    "forward of {bottle} not restored: {err}", bottle=bottle.name, err=e.message
                )
                continue
            restored.append(_kept(fwd, info))
        kept = evolve(bottle, alias=str(addr), forwards=tuple(restored))
        self.adopt(kept)
        return kept

    def _forward_spec(
        self,
        bottle: str,
        alias: ipaddress.IPv4Address,
        fwd: Forward,
        max_connections: int | None = None,
    ) -> ForwardSpec:
        return ForwardSpec(
            bottle=bottle,
            label=fwd.label,
            listen=TCPListen(alias, fwd.port),
            target=fwd.target,
            max_connections=max_connections or self._max_connections,
        )

    # -- forwards -----------------------------------------------------------------------

    async def add_forward(
        self,
        bottle: str,
        label: str,
        target: TargetSpec,
        port: int = 0,
        *,
        max_connections: int | None = None,
    ) -> ForwardInfo:
        """Bind a new agent endpoint on the bottle's alias that relays to ``target``."""
        self._require_forward_only(bottle)
        alias = self._aliases.alias_of(bottle)
        if alias is None:
            raise InvalidArgument(f"bottle {bottle} has no alias")
        fwd = Forward(label, target, port)
        spec = self._forward_spec(bottle, alias, fwd, max_connections)

        async def add() -> ForwardInfo:
            info = await self._table.add(spec)
            current = self._require(bottle)
            updated = evolve(current, forwards=(*current.forwards, _kept(fwd, info)))
            self._bottles[bottle] = updated
            try:
                self._persist(updated)
            except Unavailable:
                self._bottles[bottle] = current
                await self._table.remove(bottle, label)
                raise
            return info

        return await self._locked(bottle, add)

    async def remove_forward(self, bottle: str, label: str) -> None:
        self._require_forward_only(bottle)

        resuming = bottle in self._unsynced

        async def remove() -> None:
            current = self._require(bottle)
            if resuming and all(f.label != label for f in current.forwards):
                return  # its earlier removal became durable just now (_locked)
            await self._table.remove(bottle, label)  # closed now, whatever the disk says
            current = self._require(bottle)
            updated = evolve(
                current, forwards=tuple(f for f in current.forwards if f.label != label)
            )
            self._bottles[bottle] = updated
            self._revoke(bottle, f"removal of forward {label!r}")

        await self._locked(bottle, remove)

    def bridge_status(self, name: str) -> str | None:
        """bottlenet's in-guest bridge, described for ``bottle status`` (None: no VMs)."""
        bottle = self._require(name)
        return None if self.vms is None else self.vms.describe_bridge(bottle)

    def list_forwards(self, bottle: str | None = None) -> Sequence[ForwardInfo]:
        """Lazy (``ForwardTable.view``): each ForwardInfo is built when it is read."""
        if bottle is not None:
            self._require(bottle)
        return self._table.view(bottle)


class _BottleDict(dict[str, Bottle]):
    """The registry's name -> Bottle dict; says when a name comes or goes (wherever it is
    changed), which keeps the sorted-name cache of ``list_bottles`` honest."""

    def __init__(self, changed: Callable[[], None]) -> None:
        super().__init__()
        self._changed = changed

    def __setitem__(self, key: str, value: Bottle) -> None:
        if key not in self:
            self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self._changed()

    def pop(self, key: str, *default: Any) -> Any:
        if key in self:
            self._changed()
        return super().pop(key, *default)


def _kept(fwd: Forward, info: ForwardInfo) -> Forward:
    """The forward as it is kept: with the port it really bound (port 0 resolved)."""
    bound = info.bound
    return evolve(fwd, port=bound.port) if isinstance(bound, TCPListen) else fwd
