"""The table of the bottles the daemon knows; each operation is delegated to its owner.

A bottle is one :class:`~bottlenet.bottles.model.Bottle` value: forward-only (a name, an alias
drawn from the pool, and its forwards) or with VMs (sidecar VM + agent VM). Each has one
owner (:mod:`bottlenet.bottles.bottle`, :mod:`bottlenet.bottles.vmbottle`) that holds the
value (a VM bottle's in its machine) and does the work. The registry is only the table: the
map of owners (creates in flight among them: their count is the node's count and the cap's),
the sorted names of the bottles made, one operation at a time per bottle (the names held
now: BUSY for a second one), the restoring -> serving gate, the state file and the event bus;
it asks the node's admission before a create and tells it its count as bottles leave.
Arguments arrive validated and typed (the control responder and the config reader parse them
once); the registry re-checks only what its own table decides.
"""

from __future__ import annotations

import bisect
import ipaddress
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from attrs import evolve
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IProcessProtocol, IProcessTransport, IReactorTime
from twisted.logger import Logger

from bottlenet.bottles import execs, states
from bottlenet.bottles.attach import ExecRequest
from bottlenet.bottles.bottle import (
    BottleOwner,
    CreateRequest,
    ForwardBottle,
    Hands,
    Resync,
    VMBottle,
)
from bottlenet.bottles.core import count_lease
from bottlenet.bottles.egresslayer import TransparentCount
from bottlenet.bottles.events import EventBus
from bottlenet.bottles.host import VMHost
from bottlenet.bottles.leftovers import find_leftovers
from bottlenet.bottles.model import Bottle, Source
from bottlenet.bottles.policy import Policies
from bottlenet.bottles.pooled import PoolUse, member_spec, new_home, spec_hash
from bottlenet.bottles.probe import ProbeVerdict
from bottlenet.bottles.spec import BottleSpec, check_create
from bottlenet.bottles.states import KEPT, Lifecycle
from bottlenet.bottles.store import State, StateStore, write
from bottlenet.bottles.tenancy import Tenancy
from bottlenet.bottles.volumes import Requester
from bottlenet.errors import (
    AlreadyExists,
    BottlenetError,
    Busy,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SmolvmUnavailable,
)
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import DEFAULT_MAX_CONNECTIONS, TargetSpec
from bottlenet.forward.table import ForwardInfo, ForwardTable
from bottlenet.views import LazyView

T = TypeVar("T")
Owner = TypeVar("Owner", bound=BottleOwner)

log = Logger()
DEFAULT_MAX_BOTTLES = 256
#: A revocation that could not be made durable is written again this often until it is.
RESYNC_INTERVAL = 5.0


class BottleRegistry:
    """Forward-only and VM bottles: create, destroy, forwards, egress policy, verify."""

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
        host: VMHost | None = None,
        events: EventBus | None = None,
        policies: Policies | None = None,
    ) -> None:
        self._state_dir = state_dir
        #: The most bottles the daemon holds (``--max-bottles``), creates in flight counted.
        self.max_bottles = max_bottles
        self.instance_id = instance_id
        self.host = host
        #: One owner per name: every bottle, and per name a create is making (their count is
        #: what the node holds and what the cap counts).
        self._owners: dict[str, BottleOwner] = {}
        #: The names of the bottles made (not those being created, nor a warm pool's members),
        #: sorted as they come and go.
        self._names: list[str] = []
        #: A warm pool's members by its spec hash: their home names (fills in flight too).
        self._members: dict[str, dict[str, None]] = {}
        #: The home names of the bottles taken from a pool (home -> its name): held too.
        self._homes: dict[str, str] = {}
        #: The names an operation holds now (one at a time per bottle: another gets BUSY).
        self._busy: set[str] = set()
        #: The revocations not yet durable, retried until they are.
        self._resync = Resync(clock, self._owners, RESYNC_INTERVAL, self._busy.__contains__)
        self._gate = states.registry_gate()
        #: Every bottle event (created, ready, degraded, destroyed) as it happens: the
        #: wire's feed (the node's policies hear the owners' outputs instead).
        self.events = events or EventBus()
        #: The node's policies: asked before each create (DRAINING), told the count as
        #: bottles leave, told by each owner what it learned, counting its lease.
        self.policies = policies or Policies()
        self._hands = Hands(
            clock, table, aliases, host, store, self.events, max_connections, self._resync.arm,
            self._forget, self.reap, self.policies,
        )  # fmt: skip

    @property
    def recovering(self) -> bool:
        """True while the daemon restores its state; changes wait until it is done."""
        return not self._gate.serving()

    def begin_restore(self) -> None:
        """Recovery starts: every change waits until :meth:`end_restore`."""
        self._gate.restore()

    async def when_serving(self) -> None:
        """Returns once recovery is done (at once when it is): a bottle not restored yet is
        answered after its restore, not as missing."""
        while not self._gate.serving():
            await self._gate.when_serving()

    def end_restore(self) -> None:
        """Recovery is done (or failed): the waiting changes run."""
        waiting = self._gate.restored()
        if waiting is not None:
            waiting.fire(None)

    @property
    def aliases(self) -> AliasRegistry:
        """The alias pool's claims (forward-only bottles hold one each)."""
        return self._hands.aliases

    def state_of(self, name: str) -> Lifecycle | None:
        """Where the bottle ``name`` is in its lifecycle (None: the registry has no such name):
        its owner's phase, BUSY while an operation holds a bottle kept as it is."""
        owner = self._owners.get(name)
        if owner is None:
            return None
        phase = owner.phase()
        return Lifecycle.BUSY if name in self._busy and phase in KEPT else phase

    # -- the table ------------------------------------------------------------------------

    async def _locked(
        self,
        name: str,
        op: Callable[[], Awaitable[T]],
        *,
        make: Callable[[], BottleOwner] | None = None,
    ) -> T:
        """One operation at a time per bottle: a second one gets BUSY instead of racing.
        ``make`` (a create) makes a new name's owner; any other operation needs the bottle."""
        await self.when_serving()
        owner = self._owners.get(name)
        made = owner is None
        if owner is None:
            if make is None:
                raise NotFound(f"bottle {name} does not exist")
            owner = self._owners[name] = make()
        elif name in self._busy:
            raise Busy(f"bottle {name} has another operation in progress")
        self._busy.add(name)
        try:
            owner.sync_pending()
            return await op()
        finally:
            self._busy.discard(name)
            if made and self._owners.get(name) is owner and not owner.made:
                self._forget(name)  # a create that failed lets go of its name

    def _named(self, owner: BottleOwner) -> None:
        """The owner's bottle is made (created or restored): listed from now on (a warm
        pool's member is indexed by its pool instead)."""
        self._owners[owner.name] = owner
        value = owner.core.value
        if value.pool is not None:
            self._members.setdefault(value.pool, {})[owner.name] = None
            return
        bisect.insort(self._names, owner.name)
        if value.home != owner.name:
            self._homes[value.home] = owner.name

    def _forget(self, name: str) -> None:
        """The bottle and its record are gone (its owner's ``gone``), or its create failed:
        the admission and the pools hear the count."""
        value = self._owners.pop(name).core.value
        self._unindex(name, value)
        self.policies.admission.held(self.held())
        self.policies.pools.room()

    def _unindex(self, name: str, value: Bottle) -> None:
        """``name`` leaves the listing, its pool's members, the homes."""
        if value.pool is not None:
            members = self._members.get(value.pool, {})
            members.pop(name, None)
            if not members:
                self._members.pop(value.pool, None)
        if self._homes.get(value.home) == name:
            del self._homes[value.home]
        i = bisect.bisect_left(self._names, name)
        if i < len(self._names) and self._names[i] == name:
            del self._names[i]

    def _owner(self, name: str) -> BottleOwner:
        owner = self._owners.get(name)
        if owner is None or not owner.listed:
            raise NotFound(f"bottle {name} does not exist")
        return owner

    def owner(self, name: str, kind: type[Owner]) -> Owner:
        """The bottle's owner, of ``kind``: NOT_FOUND, or INVALID_ARGUMENT (the other kind)."""
        owner = self._owner(name)
        if not isinstance(owner, kind):
            raise InvalidArgument(f"bottle {name} {kind.other_kind}")
        return owner

    def save(self) -> None:
        """Write the whole state file, every control-created bottle's record (atomic); an I/O
        failure is UNAVAILABLE to the caller."""
        if self._hands.store is not None:
            bottles = (o.require() for o in self._owners.values() if o.made)
            state = State(self.instance_id, {b.name: b.to_state() for b in bottles if b.persisted})
            write(self._hands.store, lambda store: store.save(state))

    def stop(self) -> None:
        """The daemon stops: every watch and workload waiter ends (the VMs and workloads keep
        running); the revocations not yet durable get one last write, and no more timer."""
        for owner in list(self._owners.values()):
            owner.stop()
        self._resync.stop()

    # -- bottles ------------------------------------------------------------------------

    async def create_bottle(
        self,
        name: str,
        alias: ipaddress.IPv4Address | None = None,
        *,
        spec: BottleSpec | None = None,
        source: Source = Source.CONTROL,
        tenancy: Tenancy | None = None,
        requester: Requester | None = None,
        pool: PoolUse = PoolUse.AUTO,
    ) -> Bottle:
        """Create a bottle: forward-only (no ``spec``, or mode ``none``) or with VMs.
        ``tenancy`` (owner, scoped creator, lease) is recorded with it, its lease counted
        from the commit; a VM bottle's volumes are checked for ``requester`` (None: the
        daemon itself). A VM bottle whose spec a warm pool keeps takes a ready member of it
        unless ``pool`` is ``off`` (``only``: RESOURCE_EXHAUSTED when none is ready)."""
        with_vms = spec is not None and check_create(name, alias, spec)
        if with_vms and self.host is None:
            raise SmolvmUnavailable("this daemon runs without smolvm: VM bottles are unavailable")
        if pool is PoolUse.ONLY and (not with_vms or source is not Source.CONTROL):
            raise InvalidArgument("pool 'only': only a VM bottle's create takes from a pool")
        asked = CreateRequest(alias, spec, source, tenancy, requester)

        async def create() -> Bottle:
            self.policies.admission.admit(source)
            owner = self._owners[name]
            if owner.made or name in self._homes:
                raise AlreadyExists(f"bottle {name} already exists")
            if spec is not None and with_vms and pool is not PoolUse.OFF:
                member = self._ready_member(spec_hash(spec.doc))
                if member is not None:
                    return await self._take(member, name, asked)
                if pool is PoolUse.ONLY:
                    raise ResourceExhausted(
                        f"no warm bottle of spec {spec_hash(spec.doc)} is ready on this node"
                    )
            if self.held() > self.max_bottles:  # (this create is one of them)
                raise ResourceExhausted(
                    f"the daemon holds its maximum of {self.max_bottles} bottles"
                )
            bottle = await owner.create(asked)
            self._named(owner)
            return bottle

        def make() -> BottleOwner:
            value = asked.asked(name, self._hands.clock.seconds())
            return (VMBottle if with_vms else ForwardBottle)(name, self._hands, value)

        return await self._locked(name, create, make=make)

    def held(self) -> int:
        """The bottles the node holds, creates in flight and a warm pool's members included
        (the drain's count, and the cap's)."""
        return len(self._owners)

    # -- warm pools -----------------------------------------------------------------------

    def _ready_member(self, pool: str) -> VMBottle | None:
        """A member of ``pool`` that waits to be taken (no operation holds it)."""
        for home in self._members.get(pool, ()):
            owner = self._owners[home]
            if home not in self._busy and owner.phase() is Lifecycle.POOLED:
                assert isinstance(owner, VMBottle)
                return owner
        return None

    async def _take(self, member: VMBottle, name: str, asked: CreateRequest) -> Bottle:
        """``name``'s create takes ``member`` (held meanwhile); a failure destroys it."""
        home, pool = member.name, member.core.value.pool
        assert pool is not None
        self._busy.add(home)
        try:
            bottle = await member.take(name, asked)
        except BaseException:
            await self._drop_member(member, name)
            raise
        finally:
            self._busy.discard(home)
            self.policies.pools.taken(pool)
        del self._owners[home]
        self._unindex(home, evolve(bottle, name=home, pool=pool))
        self._named(member)  # (in the place the create held for its name)
        return bottle

    async def _drop_member(self, member: VMBottle, name: str) -> None:
        """A take failed: the member goes (its workload may have started), and a record the
        take wrote under ``name`` with it."""
        try:
            if self._hands.store is not None:
                write(self._hands.store, lambda s: s.remove(name))
            await member.destroy()
        except BottlenetError as e:
            log.error(
                "warm bottle {home}: not destroyed after a failed take: {err}",
                home=member.name,
                err=e.message,
            )

    async def fill(self, spec: BottleSpec, pool: str) -> Bottle:
        """Make one member of the warm pool ``pool`` (its spec ``spec``): booted, gated and
        bridged under a home name of its own, no workload (RESOURCE_EXHAUSTED at the cap)."""
        if self.host is None:
            raise SmolvmUnavailable("this daemon runs without smolvm: VM bottles are unavailable")
        home = new_home(pool, lambda n: n in self._owners or n in self._homes)
        asked = CreateRequest(spec=member_spec(spec, home), pool=pool)

        async def create() -> Bottle:
            if self.held() > self.max_bottles:  # (this fill is one of them)
                raise ResourceExhausted(
                    f"the daemon holds its maximum of {self.max_bottles} bottles"
                )
            owner = self._owners[home]
            bottle = await owner.create(asked)
            self._named(owner)
            return bottle

        def make() -> BottleOwner:
            self._members.setdefault(pool, {})[home] = None
            return VMBottle(home, self._hands, asked.asked(home, self._hands.clock.seconds()))

        return await self._locked(home, create, make=make)

    def members(self, pool: str) -> list[tuple[str, Lifecycle]]:
        """The home name and phase of each member of ``pool`` (fills in flight: creating)."""
        return [(home, self._owners[home].phase()) for home in self._members.get(pool, ())]

    async def destroy_member(self, home: str) -> None:
        """Destroy a warm pool's member (NOT_FOUND: none is called so; BUSY: taken now)."""
        owner = self._owners.get(home)
        if owner is None or owner.core.value.pool is None:
            raise NotFound(f"no warm bottle {home}")
        await self._locked(home, owner.destroy)

    def claims_dir(self, name: str) -> bool:
        """A bottle, a member or a taken bottle's home holds the bottle directory ``name``."""
        return name in self._owners or name in self._homes

    async def destroy_bottle(self, name: str) -> None:
        """Stop the bottle's listeners, abort its relays, delete its VMs, release its alias."""
        earlier = self._owners.get(name)
        resuming = earlier is not None and earlier.pending is not None

        async def destroy() -> None:
            if resuming and not self.has_bottle(name):
                return  # an earlier destroy of it became durable just now (_locked)
            await self._owner(name).destroy()  # (inside the lock: one being created is BUSY)

        await self._locked(name, destroy)

    def reap(self, name: str) -> Deferred[None]:
        """Destroy ``name`` for the node's lease policy (it retries on BUSY)."""
        return Deferred.fromCoroutine(self.destroy_bottle(name))

    def renew_lease(self, name: str, seconds: float) -> Tenancy:
        """Extend the bottle's lease to ``seconds`` from now (NOT_FOUND, INVALID_ARGUMENT
        without a lease); written at once, UNAVAILABLE when it cannot be."""
        return self._owner(name).renew(seconds)

    def list_bottles(self) -> Sequence[Bottle]:
        """Every bottle by name. The names are kept sorted as bottles come and go, so a page
        of a listing costs the page, not a sort of every bottle."""
        return LazyView(self._names, lambda n: self._owners[n].require())

    def get_bottle(self, name: str) -> Bottle:
        return self._owner(name).require()

    def has_bottle(self, name: str) -> bool:
        owner = self._owners.get(name)
        return owner is not None and owner.listed

    async def leftovers(self, name: str) -> list[str]:
        """What the bottle ``name``, if it no longer exists, left on the host (selftest)."""
        if self.has_bottle(name):
            return [f"bottle {name} still exists"]
        return await find_leftovers(name, self.host, self._state_dir)

    # -- VM bottles ---------------------------------------------------------------------

    async def verify_bottle(self, name: str) -> tuple[Bottle, ProbeVerdict]:
        """Run the isolation probe in the agent VM again; ISOLATION_FAILED names the leak."""
        self.owner(name, VMBottle)  # NOT_FOUND, INVALID_ARGUMENT at once, not after the lock
        return await self._locked(name, lambda: self.owner(name, VMBottle).verify())

    async def set_egress_policy(self, name: str, hosts: tuple[str, ...]) -> tuple[str, ...]:
        """Push a new (validated) allow-list; the record changes only after the sidecar
        reloaded it."""
        self.owner(name, VMBottle)  # NOT_FOUND, INVALID_ARGUMENT at once, not after the lock
        return await self._locked(name, lambda: self.owner(name, VMBottle).set_policy(hosts))

    def exec_target(self, name: str) -> Bottle:
        """The VM bottle a command may run in: NOT_FOUND, INVALID_ARGUMENT (forward-only),
        BUSY (being created or destroyed) or DEGRADED otherwise."""
        if self.state_of(name) is Lifecycle.CREATING:
            raise Busy(f"bottle {name} is being created")
        return self.owner(name, VMBottle).exec_target()

    async def spawn_exec(
        self,
        name: str,
        request: ExecRequest,
        protocol: IProcessProtocol,
        stdio: tuple[int, int, int] | None = None,
    ) -> IProcessTransport:
        """Run ``request`` in the bottle's agent VM (``bottles/execs.py``)."""
        bottle, owner = self.exec_target(name), self.owner(name, VMBottle)
        return await execs.spawn_exec(self.host, bottle, owner.session, request, protocol, stdio)

    async def spawn_logs(
        self, name: str, tail: int, follow: bool, protocol: IProcessProtocol
    ) -> IProcessTransport:
        """``tail`` of the workload's log in the agent VM (``bottles/execs.py``)."""
        bottle, owner = self.exec_target(name), self.owner(name, VMBottle)
        return await execs.spawn_logs(self.host, bottle, owner.session, tail, follow, protocol)

    # -- recovery -----------------------------------------------------------------------

    async def restore(self, bottle: Bottle) -> Bottle:
        """Recovery: take a recorded bottle back into the table (its owner's ``restore``), in
        the state it was kept in: a VM bottle kept ready or exited runs again (its sidecar,
        bridge and workload watched; a degraded one's are not); its lease counts on."""
        owner_class = ForwardBottle if bottle.vms is None else VMBottle
        owner = owner_class(bottle.name, self._hands, bottle)
        kept = await owner.restore()
        self._named(owner)
        count_lease(owner.core)
        return kept

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
        spec, fwd = self.owner(bottle, ForwardBottle).forward(label, target, port, max_connections)
        return await self._locked(
            bottle, lambda: self.owner(bottle, ForwardBottle).add_forward(spec, fwd)
        )

    async def remove_forward(self, bottle: str, label: str) -> None:
        resuming = self.owner(bottle, ForwardBottle).pending is not None
        await self._locked(
            bottle,
            lambda: self.owner(bottle, ForwardBottle).remove_forward(label, resuming=resuming),
        )

    def bridge_status(self, name: str) -> str | None:
        """bottlenet's in-guest bridge, described for ``bottle status`` (None: no VMs)."""
        owner = self._owner(name)
        return owner.bridge_status() if isinstance(owner, VMBottle) else None

    def transparent_stats(self, bottle: str | None = None) -> list[TransparentCount]:
        """Each bottle's transparent connects per target (``bottle stats``)."""
        owners = [self._owner(bottle)] if bottle is not None else self._listed()
        rows: list[TransparentCount] = []
        for owner in owners:
            if isinstance(owner, VMBottle):
                rows += owner.transparent_counts()
        return rows

    def transparent_outcomes(self) -> list[tuple[str, str, int]]:
        """(bottle, outcome, connects) of every bottle with a layer (the metrics)."""
        out = []
        for owner in self._listed():
            if isinstance(owner, VMBottle):
                out += owner.transparent_outcomes()
        return out

    def _listed(self) -> list[BottleOwner]:
        return [self._owners[name] for name in self._names]

    def list_forwards(self, bottle: str | None = None) -> Sequence[ForwardInfo]:
        """Lazy (``ForwardTable.view``): each ForwardInfo is built when it is read."""
        if bottle is not None:
            self._owner(bottle)
        return self._hands.table.view(bottle)
