"""The bottles the daemon knows, and the operations the control plane and the config run.

A bottle is either forward-only (a name, an alias drawn from the pool, and its forwards) or a
VM bottle (sidecar VM + agent VM, see :mod:`bottlenet.bottles.lifecycle`). The registry adds
what the lower layers do not know: bottle names (unique across both kinds), one operation at
a time per bottle (BUSY), a limit on the number of bottles, and persistence: every change to a
control-created bottle is written to the state file, so a restarted daemon can restore it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from attrs import evolve, frozen
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from bottlenet.bottles.lifecycle import VMLifecycle
from bottlenet.bottles.model import STATE_DEGRADED, STATE_READY, Endpoint, VMBottle
from bottlenet.bottles.probe import ProbeVerdict
from bottlenet.bottles.spec import check_allow_hosts, parse_bottle_spec
from bottlenet.bottles.store import State, StateStore
from bottlenet.errors import (
    AlreadyExists,
    Busy,
    InvalidArgument,
    IsolationFailed,
    NotFound,
    ResourceExhausted,
    SmolvmUnavailable,
    Unavailable,
)
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import (
    DEFAULT_MAX_CONNECTIONS,
    ForwardSpec,
    TCPListen,
    check_bottle_name,
    check_label,
    check_port,
    parse_target,
    targets_dir,
)
from bottlenet.forward.table import ForwardInfo, ForwardTable

T = TypeVar("T")

DEFAULT_MAX_BOTTLES = 256
PROBE_SKIPPED_WARNING = (
    "created with --unsafe-skip-isolation-probe: the isolation of this bottle was NOT verified"
)


@frozen
class BottleInfo:
    """What the control plane reports about a bottle (VM fields are None/empty otherwise)."""

    name: str
    alias: str | None
    source: str  # "config" | "control"
    state: str  # "ready" | "degraded"
    created_at: float
    forwards: tuple[ForwardInfo, ...] = ()
    mode: str | None = None
    isolation: str | None = None
    sidecar_vm: str | None = None
    agent_vm: str | None = None
    endpoints: tuple[Endpoint, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    policy: tuple[str, ...] | None = None
    probe: str | None = None
    warnings: tuple[str, ...] = ()
    detail: str | None = None


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
        self._bottles: dict[str, BottleInfo] = {}
        self._vms: dict[str, VMBottle] = {}
        self._busy: set[str] = set()
        self._creating: set[str] = set()
        self._recovering = False
        self._recovery_waiters: list[Deferred[None]] = []

    @property
    def recovering(self) -> bool:
        """True while the daemon restores its state; changes wait until it is done."""
        return self._recovering

    @recovering.setter
    def recovering(self, value: bool) -> None:
        self._recovering = value
        if not value:
            waiters, self._recovery_waiters = self._recovery_waiters, []
            for d in waiters:
                d.callback(None)

    # -- bookkeeping --------------------------------------------------------------------

    @contextmanager
    def _operation(self, name: str) -> Iterator[None]:
        """One operation at a time per bottle: a second one gets BUSY instead of racing."""
        if name in self._busy:
            raise Busy(f"bottle {name} has another operation in progress")
        self._busy.add(name)
        try:
            yield
        finally:
            self._busy.discard(name)

    async def _locked(self, name: str, op: Callable[[], Awaitable[T]]) -> T:
        while self._recovering:
            waiter: Deferred[None] = Deferred()
            self._recovery_waiters.append(waiter)
            await waiter
        with self._operation(name):
            return await op()

    def _exists(self, name: str) -> bool:
        return name in self._bottles or name in self._vms

    def _require(self, name: str) -> BottleInfo:
        check_bottle_name(name)
        if name in self._vms:
            return self._vm_info(self._vms[name])
        try:
            return self._bottles[name]
        except KeyError:
            raise NotFound(f"bottle {name} does not exist") from None

    def _require_vm(self, name: str) -> VMBottle:
        self._require(name)
        vb = self._vms.get(name)
        if vb is None:
            raise InvalidArgument(f"bottle {name} is forward-only: it has no VMs")
        return vb

    def state_records(self) -> dict[str, dict[str, Any]]:
        """What the state file holds: control-created bottles of both kinds."""
        records: dict[str, dict[str, Any]] = {}
        for name, info in self._bottles.items():
            if info.source != "control":
                continue
            records[name] = {
                "kind": "forward",
                "alias": info.alias,
                "created_at": info.created_at,
                "forwards": [
                    {
                        "label": f.spec.label,
                        "target": f.spec.target.describe(),
                        "port": f.bound.port if isinstance(f.bound, TCPListen) else 0,
                    }
                    for f in self._table.list(name)
                ],
            }
        for name, vb in self._vms.items():
            records[name] = vb.to_state()
        return records

    def save(self) -> None:
        """Write the state file (atomic); an I/O failure is UNAVAILABLE to the caller."""
        if self._store is None:
            return
        try:
            self._store.save(State(self.instance_id, self.state_records()))
        except OSError as e:
            self.log.error("cannot write the state file: {err}", err=e.strerror)
            raise Unavailable(f"cannot write the state file: {e.strerror}") from None

    def _save_quietly(self) -> None:
        try:
            self.save()
        except Unavailable:
            pass

    # -- bottles ------------------------------------------------------------------------

    async def create_bottle(
        self,
        name: str,
        alias: str | None = None,
        *,
        source: str = "control",
        spec: Mapping[str, Any] | None = None,
    ) -> BottleInfo:
        """Create a bottle: forward-only (no ``spec``, or mode ``none``) or with VMs."""
        check_bottle_name(name)
        if alias is not None and not isinstance(alias, str):
            raise InvalidArgument("alias must be a string")
        parsed = (
            parse_bottle_spec(name, dict(spec), self.protected_dirs) if spec is not None else None
        )

        async def create() -> BottleInfo:
            if self._exists(name):
                raise AlreadyExists(f"bottle {name} already exists")
            if len(self._bottles) + len(self._vms) + len(self._creating) >= self._max_bottles:
                raise ResourceExhausted(
                    f"the daemon holds its maximum of {self._max_bottles} bottles"
                )
            if parsed is not None and parsed.has_vms:
                return await self._create_vm(name, alias, parsed, dict(spec or {}))
            addr = self._aliases.claim(name, alias)
            info = BottleInfo(
                name=name,
                alias=str(addr),
                source=source,
                state=STATE_READY,
                created_at=self._clock.seconds(),
            )
            self._bottles[name] = info
            if source == "control":
                try:
                    self.save()
                except Unavailable:
                    del self._bottles[name]
                    self._aliases.release(name)
                    raise
            self.log.info("bottle {bottle} created on {alias}", bottle=name, alias=str(addr))
            return info

        return await self._locked(name, create)

    async def _create_vm(
        self, name: str, alias: str | None, spec: Any, doc: dict[str, Any]
    ) -> BottleInfo:
        if self.vms is None:
            raise SmolvmUnavailable("this daemon runs without smolvm: VM bottles are unavailable")
        vms = self.vms

        def commit(vb: VMBottle) -> None:
            self._vms[name] = vb
            try:
                self.save()
            except Unavailable:
                del self._vms[name]
                raise

        self._creating.add(name)
        try:
            vb = await vms.create(spec, doc, alias, commit)
        finally:
            self._creating.discard(name)
        self.watch(vb)
        return self._vm_info(vb)

    async def destroy_bottle(self, name: str) -> None:
        """Stop the bottle's listeners, abort its relays, delete its VMs, release its alias."""
        check_bottle_name(name)

        async def destroy() -> None:
            self._require(name)  # (inside the lock: a bottle being created is BUSY)
            vb = self._vms.get(name)
            if vb is not None:
                assert self.vms is not None
                try:
                    await self.vms.teardown(vb)
                except Exception as e:
                    detail = f"teardown incomplete: {getattr(e, 'code', type(e).__name__)}"
                    self._vms[name] = evolve(vb, state=STATE_DEGRADED, detail=detail)
                    self._save_quietly()
                    raise
                del self._vms[name]
            else:
                info = self._bottles[name]
                await self._table.remove_bottle(name)
                self._aliases.release(name)
                del self._bottles[name]
                if info.source != "control":
                    self.log.info("bottle {bottle} destroyed", bottle=name)
                    return
            self.save()
            self.log.info("bottle {bottle} destroyed", bottle=name)

        await self._locked(name, destroy)

    def list_bottles(self) -> list[BottleInfo]:
        names = sorted(set(self._bottles) | set(self._vms))
        return [self.get_bottle(name) for name in names]

    def get_bottle(self, name: str) -> BottleInfo:
        info = self._require(name)
        return evolve(info, forwards=tuple(self._table.list(name)))

    def _vm_info(self, vb: VMBottle) -> BottleInfo:
        gate = (
            "launch gate: SKIPPED (--unsafe-skip-isolation-probe)"
            if vb.probe_skipped
            else f"launch gate: isolation probe {vb.probe}"
        )
        return BottleInfo(
            name=vb.name,
            alias=vb.alias,
            source="control",
            state=vb.state,
            created_at=vb.created_at,
            mode=vb.mode,
            isolation=f"{vb.mechanism}; {gate}",
            sidecar_vm=vb.sidecar_vm,
            agent_vm=vb.agent_vm,
            endpoints=vb.endpoints,
            env=vb.env,
            policy=vb.policy,
            probe=vb.probe,
            warnings=(PROBE_SKIPPED_WARNING,) if vb.probe_skipped else (),
            detail=vb.detail,
        )

    # -- VM bottles ---------------------------------------------------------------------

    async def verify_bottle(self, name: str) -> tuple[BottleInfo, ProbeVerdict]:
        """Run the isolation probe in the agent VM again; ISOLATION_FAILED names the leak."""
        vb = self._require_vm(name)
        assert self.vms is not None
        vms = self.vms

        async def verify() -> tuple[BottleInfo, ProbeVerdict]:
            verdict = await vms.verify(vb)
            current = self._vms.get(name)
            if current is not None:
                updated = evolve(current, probe="PASS" if verdict.passed else "FAIL")
                self._vms[name] = updated
                self._save_quietly()
            if not verdict.passed:
                raise IsolationFailed(f"bottle {name}: {verdict.describe()}")
            return self.get_bottle(name), verdict

        return await self._locked(name, verify)

    async def set_egress_policy(self, name: str, hosts: object) -> tuple[str, ...]:
        """Push a new allow-list; the record changes only after the sidecar reloaded it."""
        allow = check_allow_hosts(hosts)
        vb = self._require_vm(name)
        assert self.vms is not None
        vms = self.vms

        async def push() -> tuple[str, ...]:
            current = self._vms.get(name, vb)
            updated = await vms.set_policy(current, allow)
            self._vms[name] = updated
            self.save()
            self.log.info(
                "bottle {bottle}: egress policy set ({n} hosts)", bottle=name, n=len(allow)
            )
            return allow

        return await self._locked(name, push)

    def watch(self, vb: VMBottle) -> None:
        """Turn the bottle degraded when its sidecar's VM process exits."""
        if self.vms is None or vb.state == STATE_DEGRADED:
            return
        self.vms.watch(vb, lambda: self._sidecar_exited(vb.name))

    def _sidecar_exited(self, name: str) -> None:
        Deferred.fromCoroutine(self.degrade(name, "sidecar VM process exited"))

    async def degrade(self, name: str, why: str) -> None:
        """Reset live relays, refuse new connections (listeners removed), record and log."""
        vb = self._vms.get(name)
        if vb is None or vb.state == STATE_DEGRADED:
            return
        self._vms[name] = evolve(vb, state=STATE_DEGRADED, detail=why)
        self.log.warn("bottle {bottle} is degraded: {why}", bottle=name, why=why)
        if self.vms is not None:
            self.vms.unwatch(name)
        await self._table.remove_bottle(name)
        self._save_quietly()

    # -- recovery hooks -----------------------------------------------------------------

    def adopt_forward_only(self, name: str, alias: str, created_at: float) -> None:
        """Re-register a persisted forward-only bottle (its forwards are added after)."""
        addr = self._aliases.claim(name, alias)
        self._bottles[name] = BottleInfo(
            name=name,
            alias=str(addr),
            source="control",
            state=STATE_READY,
            created_at=created_at,
        )

    def adopt_vm(self, vb: VMBottle) -> None:
        self._vms[vb.name] = vb

    def forget_vm(self, name: str) -> None:
        self._vms.pop(name, None)

    def forget(self, name: str) -> None:
        self._bottles.pop(name, None)
        self._aliases.release(name)

    def has_bottle(self, name: str) -> bool:
        return self._exists(name)

    def vm_bottles(self) -> list[VMBottle]:
        return [self._vms[n] for n in sorted(self._vms)]

    # -- forwards -----------------------------------------------------------------------

    async def add_forward(
        self,
        bottle: str,
        label: str,
        target: str,
        port: int = 0,
        *,
        max_connections: int | None = None,
    ) -> ForwardInfo:
        """Bind a new agent endpoint on the bottle's alias that relays to ``target``."""
        info = self._require(bottle)
        if bottle in self._vms:
            raise InvalidArgument(
                f"bottle {bottle} has VMs: its forwards are managed by the daemon"
            )
        check_label(label)
        check_port(port, allow_zero=True)
        target_spec = parse_target(target, unix_root=targets_dir(self._state_dir, bottle))
        alias = self._aliases.alias_of(bottle)
        if info.alias is None or alias is None:
            raise InvalidArgument(f"bottle {bottle} has no alias")
        spec = ForwardSpec(
            bottle=bottle,
            label=label,
            listen=TCPListen(alias, port),
            target=target_spec,
            max_connections=max_connections or self._max_connections,
        )

        async def add() -> ForwardInfo:
            result = await self._table.add(spec)
            if info.source == "control":
                try:
                    self.save()
                except Unavailable:
                    await self._table.remove(bottle, label)
                    raise
            return result

        return await self._locked(bottle, add)

    async def restore_forward(self, bottle: str, label: str, target: str, port: int) -> None:
        """Recovery: re-bind a persisted forward on the same alias and port."""
        alias = self._aliases.alias_of(bottle)
        assert alias is not None
        await self._table.add(
            ForwardSpec(
                bottle=bottle,
                label=label,
                listen=TCPListen(alias, port),
                target=parse_target(target, unix_root=targets_dir(self._state_dir, bottle)),
                max_connections=self._max_connections,
            )
        )

    async def remove_forward(self, bottle: str, label: str) -> None:
        info = self._require(bottle)
        if bottle in self._vms:
            raise InvalidArgument(
                f"bottle {bottle} has VMs: its forwards are managed by the daemon"
            )
        check_label(label)

        async def remove() -> None:
            await self._table.remove(bottle, label)
            if info.source == "control":
                self.save()

        await self._locked(bottle, remove)

    def list_forwards(self, bottle: str | None = None) -> list[ForwardInfo]:
        if bottle is not None:
            self._require(bottle)
        return self._table.list(bottle)
