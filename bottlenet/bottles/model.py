"""A bottle as the daemon remembers it: one frozen value for both kinds, and its state form.

A forward-only bottle is a :class:`Bottle` without VMs (its forwards are listed); a VM bottle
carries :class:`BottleVMs`: everything recovery needs after a restart (machine names, the
sidecar pid, raw ports, the agent endpoints with their real ports, the stamped env, the
policy, the flags), so the daemon can re-bind the same endpoints and tell its machines from
anyone else's. ``to_state``/``from_state`` are the one state-file form of one bottle, so a
store can write bottles one at a time.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Any, TypeAlias, TypeVar, overload

from attrs import field, frozen

from bottlenet.bottles.spec import BottleSpec, parse_bottle_spec
from bottlenet.bottles.store import StateError
from bottlenet.bottles.tenancy import Tenancy
from bottlenet.bottles.workload import WorkloadState
from bottlenet.errors import InvalidArgument, safe_repr
from bottlenet.fields import Fields
from bottlenet.forward.spec import (
    TargetSpec,
    check_bottle_name,
    check_label,
    check_port,
    parse_target,
    targets_dir,
)
from bottlenet.kit.program import KitRef
from bottlenet.probe.judge import ProbeResult
from bottlenet.probe.plan import IsolationMode


class Role(enum.StrEnum):
    """Which machine of a VM bottle (its name suffix and its role label)."""

    SIDECAR = "sidecar"
    AGENT = "agent"


class Source(enum.StrEnum):
    """Who made a bottle: the control plane (kept in the state file) or the config file
    (made again from it at every start)."""

    CONTROL = "control"
    CONFIG = "config"


LABEL_OWNER = "bottlenet.owner"
LABEL_BOTTLE = "bottlenet.bottle"
LABEL_ROLE = "bottlenet.role"


class BottleState(enum.StrEnum):
    """A bottle's state as the state file, the events and ``bottle status`` spell it."""

    READY = "ready"
    DEGRADED = "degraded"
    #: The workload ended; the VMs and endpoints stay up until the bottle is destroyed.
    EXITED = "exited"
    #: Only in events (a VM bottle's CREATED): never kept in the state file.
    CREATING = "creating"


class BottleKind(enum.StrEnum):
    """A bottle's kind as its state-file record spells it."""

    FORWARD = "forward"
    VM = "vm"


_KEPT_STATES = frozenset({BottleState.READY, BottleState.DEGRADED, BottleState.EXITED})
PROBE_SKIPPED_WARNING = (
    "created with --unsafe-skip-isolation-probe: the isolation of this bottle was NOT verified"
)


def machine_name(bottle: str, role: Role) -> str:
    """``bn-<bottle>-<role>``, or ``bn_<hash>-<role>`` when that breaks smolvm's name rules.

    smolvm refuses ``--`` anywhere, and a bottle name may contain ``--`` or end in ``-``
    (which the suffix would turn into ``--``). Bottle names never contain ``_``, so the
    hashed form can never collide with a literal one.
    """
    if "--" not in bottle and not bottle.endswith("-"):
        return f"bn-{bottle}-{role}"
    digest = hashlib.sha256(bottle.encode()).hexdigest()[:20]
    return f"bn_{digest}-{role}"


@frozen
class _AgentSocket:
    """The agent side of a VM bottle's endpoint for ``service``: ``path`` is the host UNIX
    socket (bottlenet's listener), mounted in the agent VM at ``guest_path``."""

    service: str
    guest_port: int
    path: str
    guest_path: str

    def agent_address(self) -> str:
        """What the agent dials: the socket path inside the guest."""
        return f"unix:{self.guest_path}"


@frozen
class SocketEndpoint(_AgentSocket):
    """An endpoint behind ``sidecar_path``, the sidecar service's socket exposed into the
    bottle's own directory (the default). It is never given to the agent."""

    sidecar_path: str

    def to_json(self) -> dict[str, Any]:
        return _endpoint_json(self, raw_port=0, sidecar_path=self.sidecar_path)


@frozen
class TCPEndpoint(_AgentSocket):
    """An endpoint behind ``raw_port``, the sidecar's published port on 127.0.0.1 (the
    ``sidecar.listen = "tcp"`` opt-in). It is never given to the agent."""

    raw_port: int

    def to_json(self) -> dict[str, Any]:
        return _endpoint_json(self, raw_port=self.raw_port, sidecar_path=None)


#: An agent endpoint of a VM bottle, by what is behind it.
Endpoint: TypeAlias = SocketEndpoint | TCPEndpoint


def _endpoint_json(e: Endpoint, *, raw_port: int, sidecar_path: str | None) -> dict[str, Any]:
    """The state-file form (the alias-mode ``host``/``port`` keys are no longer written)."""
    return {
        "service": e.service,
        "guest_port": e.guest_port,
        "raw_port": raw_port,
        "path": e.path,
        "guest_path": e.guest_path,
        "sidecar_path": sidecar_path,
    }


def endpoint_from_json(d: object, where: str = "endpoint") -> Endpoint:
    """An endpoint from its state record. A record written before alias mode was removed
    carries ``host``/``port`` too: null there (socket mode) is ignored; an alias-mode
    endpoint cannot be kept (no smolvm enforces alias mode)."""
    f = _fields(d, where)
    if f.value("host", str, optional=True) is not None or (
        f.value("port", int, optional=True) is not None
    ):
        raise f.fail("host", "an alias-mode endpoint (alias mode is no longer supported)")
    service = f.value("service", str)
    guest_port = f.value("guest_port", int)
    path = f.value("path", str)
    guest_path = f.value("guest_path", str)
    sidecar_path = f.value("sidecar_path", str, optional=True)
    if sidecar_path is not None:
        return SocketEndpoint(service, guest_port, path, guest_path, sidecar_path)
    return TCPEndpoint(service, guest_port, path, guest_path, f.value("raw_port", int))


@frozen
class Forward:
    """One forward of a forward-only bottle as it is kept: ``port`` is the port it bound."""

    label: str
    target: TargetSpec
    port: int

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "target": self.target.describe(), "port": self.port}

    @classmethod
    def from_json(cls, d: object, where: str, *, unix_root: str) -> Forward:
        f = _fields(d, where)
        return cls(
            label=check_label(f.value("label", str)),
            target=parse_target(f.value("target", str), unix_root=unix_root),
            port=check_port(f.value("port", int), allow_zero=True),
        )


@frozen
class BottleVMs:
    """The VM half of a bottle: its sidecar and agent machines and what was made for them."""

    spec: BottleSpec = field(eq=False)
    mode: IsolationMode
    mechanism: str
    sidecar_vm: str
    agent_vm: str
    sidecar_pid: int
    endpoints: tuple[Endpoint, ...]
    env: tuple[tuple[str, str], ...]
    policy: tuple[str, ...]
    probe_skipped: bool
    probe: ProbeResult
    #: None when the spec names no workload.
    workload: WorkloadState | None = None
    workload_exit_code: int | None = None
    #: Under smolvm's per-VM uids: the uids the daemon reserved for the VMMs at create (the
    #: endpoints are granted to the agent's, never to what a VMM-writable file says).
    agent_uid: int | None = None
    sidecar_uid: int | None = None
    #: bottlenet's guest kit, mounted read-only in both VMs at create (None: the image's
    #: python3 and /bin/sh run bottlenet's guest commands).
    kit: KitRef | None = None
    #: The name its machines, directory and sockets were made under when that is not the
    #: bottle's own: a bottle taken from a warm pool keeps its pool member's (None: its own).
    home: str | None = None

    @property
    def raw_ports(self) -> tuple[int, ...]:
        return tuple(e.raw_port for e in self.endpoints if isinstance(e, TCPEndpoint))

    @property
    def sidecar_sockets(self) -> tuple[str, ...]:
        return tuple(e.sidecar_path for e in self.endpoints if isinstance(e, SocketEndpoint))

    @property
    def machines(self) -> tuple[str, str]:
        return (self.sidecar_vm, self.agent_vm)


@frozen
class Bottle:
    """One bottle of either kind. Forward-only: ``vms`` is None and ``forwards`` lists its
    forwards. With VMs: ``vms`` is set and its endpoints are the daemon's own forwards."""

    name: str
    alias: str | None
    created_at: float
    source: Source = Source.CONTROL
    state: BottleState = BottleState.READY  # kept: ready, degraded or exited
    detail: str | None = None
    forwards: tuple[Forward, ...] = ()
    vms: BottleVMs | None = None
    #: Owner, scoped creator and lease (``bottles.tenancy``); None: none of them.
    tenancy: Tenancy | None = None
    #: A warm pool's member, not yet taken: the spec hash of its pool (``node/pools.py``).
    #: Such a bottle is never listed and tells the wire nothing; None: any other bottle.
    pool: str | None = None

    @property
    def has_vms(self) -> bool:
        return self.vms is not None

    @property
    def home(self) -> str:
        """The name its machines, directory and sockets were made under (its own, unless
        it was taken from a warm pool)."""
        vm = self.vms
        return self.name if vm is None or vm.home is None else vm.home

    @property
    def persisted(self) -> bool:
        """Control-created bottles are kept in the state file; the config's are made again."""
        return self.source == Source.CONTROL

    @property
    def isolation(self) -> str | None:
        """The isolation mechanism and the launch gate's verdict, in one line (VM bottles)."""
        vm = self.vms
        if vm is None:
            return None
        gate = (
            "launch gate: SKIPPED (--unsafe-skip-isolation-probe)"
            if vm.probe_skipped
            else f"launch gate: isolation probe {vm.probe}"
        )
        return f"{vm.mechanism}; {gate}"

    @property
    def warnings(self) -> tuple[str, ...]:
        """What a caller must be told about this bottle every time it is shown."""
        vm = self.vms
        return (PROBE_SKIPPED_WARNING,) if vm is not None and vm.probe_skipped else ()

    def require_vms(self) -> BottleVMs:
        """The VM half (callers have checked :attr:`has_vms`)."""
        assert self.vms is not None, f"bottle {self.name} has no VMs"
        return self.vms

    def to_state(self) -> dict[str, Any]:
        """The state-file record of this bottle (the file's format, unchanged; ``tenancy``
        only when it has one)."""
        record = self._record()
        if self.tenancy is not None:
            record["tenancy"] = self.tenancy.to_state()
        return record

    def _record(self) -> dict[str, Any]:
        vm = self.vms
        if vm is None:
            return {
                "kind": BottleKind.FORWARD,
                "alias": self.alias,
                "created_at": self.created_at,
                "forwards": [f.to_json() for f in self.forwards],
            }
        return {
            "kind": BottleKind.VM,
            "spec": vm.spec.doc,
            "mode": vm.mode,
            "mechanism": vm.mechanism,
            "alias": self.alias,
            "sidecar_vm": vm.sidecar_vm,
            "agent_vm": vm.agent_vm,
            "sidecar_pid": vm.sidecar_pid,
            "endpoints": [e.to_json() for e in vm.endpoints],
            "env": [[k, v] for k, v in vm.env],
            "policy": list(vm.policy),
            "flags": {"probe_skipped": vm.probe_skipped},
            "probe": vm.probe,
            "created_at": self.created_at,
            "state": self.state,
            "detail": self.detail,
            "workload": vm.workload,
            "workload_exit_code": vm.workload_exit_code,
            **_uids_record(vm),
            **_kit_record(vm.kit),
            **({} if vm.home is None else {"home": vm.home}),
            **({} if self.pool is None else {"pool": self.pool}),
        }

    @classmethod
    def from_state(cls, name: str, d: object, *, unix_root: str) -> Bottle:
        """Rebuild a bottle from its state record (StateError when it is malformed).

        ``unix_root`` is the state directory: a stored UNIX target must still lie in the
        bottle's own target directory under it.
        """
        try:
            check_bottle_name(name)
            f = _fields(d, "")
            kind = f.value("kind", str)
            created_at = f.number("created_at")
            raw_tenancy = f.value("tenancy", dict, optional=True)
            tenancy = None if raw_tenancy is None else Tenancy.from_state(raw_tenancy, StateError)
            if kind == BottleKind.FORWARD:
                return cls(
                    name=name,
                    tenancy=tenancy,
                    alias=f.value("alias", str),
                    created_at=created_at,
                    forwards=tuple(
                        Forward.from_json(
                            r, f"forwards[{i}]", unix_root=targets_dir(unix_root, name)
                        )
                        for i, r in enumerate(f.items("forwards"))
                    ),
                )
            if kind != BottleKind.VM:
                raise StateError("kind: unknown")
            spec_doc = f.value("spec", dict)
            flags = f.value("flags", dict)
            env = f.items("env")
            if not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                for p in env
            ):
                raise StateError("env: must be a list of [key, value] strings")
            try:
                spec = parse_bottle_spec(name, spec_doc)
            except InvalidArgument as e:
                raise StateError(f"stored spec no longer valid: {e.message}") from None
            vms = BottleVMs(
                spec=spec,
                mode=_choice(f, "mode", IsolationMode),
                mechanism=f.value("mechanism", str),
                sidecar_vm=f.value("sidecar_vm", str),
                agent_vm=f.value("agent_vm", str),
                sidecar_pid=f.value("sidecar_pid", int),
                endpoints=tuple(
                    endpoint_from_json(e, f"endpoints[{i}]")
                    for i, e in enumerate(f.items("endpoints"))
                ),
                env=tuple((k, v) for k, v in env),
                policy=f.strings("policy") or (),
                probe_skipped=flags.get("probe_skipped") is True,
                probe=_choice(f, "probe", ProbeResult),
                workload=_choice(f, "workload", WorkloadState, optional=True),
                workload_exit_code=f.value("workload_exit_code", int, optional=True),
                **_uids_from(f),
                kit=_kit_from(f),
                home=_home_from(f),
            )
            return cls(
                name=name,
                alias=f.value("alias", str, optional=True),
                created_at=created_at,
                state=_kept_state(f.value("state", str)),
                detail=f.value("detail", str, optional=True),
                vms=vms,
                tenancy=tenancy,
                pool=f.value("pool", str, optional=True),
            )
        except StateError as e:
            raise StateError(f"bottle {name}: {e.message}") from None
        except InvalidArgument as e:
            raise StateError(f"bottle {name}: stored value no longer valid: {e.message}") from None


def _home_from(f: Fields) -> str | None:
    """The pool member's name a taken bottle's machines and directory keep (a valid bottle
    name: its directory is derived from it)."""
    home = f.value("home", str, optional=True)
    if home is not None:
        try:
            check_bottle_name(home)
        except InvalidArgument:
            raise StateError("home: must be a bottle name") from None
    return home


def _kit_record(kit: KitRef | None) -> dict[str, Any]:
    """``kit`` only when one is mounted (a record without it stays as it was)."""
    return {} if kit is None else {"kit": {"digest": kit.digest, "loader": kit.loader}}


def _kit_from(f: Fields) -> KitRef | None:
    d = f.value("kit", dict, optional=True)
    if d is None:
        return None
    k = _fields(d, "kit")
    digest, loader = k.value("digest", str), k.value("loader", str)
    if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        raise StateError("kit.digest: must be 64 hex digits")
    if not loader.startswith("lib/") or "/" in loader[4:] or not loader[4:].isprintable():
        raise StateError("kit.loader: must name a file of the kit's lib/")
    return KitRef(digest, loader)


def _uids_record(vm: BottleVMs) -> dict[str, Any]:
    """``vm_uids`` only under per-VM uids (a one-uid daemon's records stay as they were)."""
    if vm.agent_uid is None and vm.sidecar_uid is None:
        return {}
    return {"vm_uids": {"agent": vm.agent_uid, "sidecar": vm.sidecar_uid}}


def _uids_from(f: Fields) -> dict[str, int | None]:
    """The reserved VMM uids of a record (absent in records older than them: None)."""
    d = f.value("vm_uids", dict, optional=True)
    if d is None:
        return {}
    u = _fields(d, "vm_uids")
    found = {f"{role}_uid": u.value(role, int, optional=True) for role in ("agent", "sidecar")}
    if any(uid is not None and uid < 0 for uid in found.values()):
        raise StateError("vm_uids: a uid must be a non-negative integer")
    return found


def _kept_state(value: str) -> BottleState:
    """A recorded state: one of the states the state file keeps (never ``creating``)."""
    if value not in _KEPT_STATES:
        raise StateError(f"state: {safe_repr(value)} is not a state a bottle is kept in")
    return BottleState(value)


def _fields(d: object, where: str) -> Fields:
    return Fields(d, where, error=StateError, what="an object")


_E = TypeVar("_E", bound=enum.StrEnum)


@overload
def _choice(f: Fields, key: str, kind: type[_E]) -> _E: ...
@overload
def _choice(f: Fields, key: str, kind: type[_E], *, optional: bool) -> _E | None: ...
def _choice(f: Fields, key: str, kind: type[_E], *, optional: bool = False) -> _E | None:
    """One of ``kind``'s strings, as its member (StateError names the allowed ones)."""
    value = f.value(key, str, optional=optional)
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        raise f.fail(key, f"must be one of {', '.join(kind)}") from None
