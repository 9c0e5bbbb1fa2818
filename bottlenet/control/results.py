"""Typed results shared by the clients, and the JSON reading of the wire's record lists.

``HelloResult``, ``Page`` and ``BottleRow`` are ``NamedTuple``s (client-side values):
``bottlenetctl status``, ``ping`` and ``bottle ls`` read them without importing attrs.
:class:`BottleRow` is how the light client reads a bottle; the daemon's attrs record
(:class:`~bottlenet.control.records.BottleRecord`) is built from one, so both read the JSON
the same way (``tests/control/test_lightclient.py`` checks that their fields agree).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from bottlenet.fields import FieldError, Fields

if TYPE_CHECKING:
    from bottlenet.control.records import ForwardRecord

T = TypeVar("T")


class HelloResult(NamedTuple):
    server_version: str
    protocol: int
    features: tuple[str, ...]
    smolvm_available: bool
    smolvm_version: str | None
    smolvm_source: str | None = None
    vm_uids: str | None = None
    #: Why ``vm_uids`` says what it says: ``seen: ...`` or ``expected: ...`` (protocol.md).
    vm_uids_basis: str | None = None
    #: False for a smolvm outside the tested versions; None from an older daemon.
    smolvm_tested: bool | None = None
    #: The versions bottlenet is tested with (empty from an older daemon).
    smolvm_tested_versions: tuple[str, ...] = ()
    #: bottlenet's guest kit (``KitKeeper.describe``); None from an older daemon.
    guest_kit: str | None = None
    #: The ready kit's program as a guest runs it (empty: no kit ready, or an older daemon).
    guest_kit_argv: tuple[str, ...] = ()

    @classmethod
    def from_answer(cls, d: dict[str, Any]) -> HelloResult:
        return cls(
            server_version=d["server_version"],
            protocol=d["protocol"],
            features=tuple(d["features"]),
            smolvm_available=d["smolvm_available"],
            smolvm_version=d["smolvm_version"],
            smolvm_source=d.get("smolvm_source"),
            vm_uids=d.get("vm_uids"),
            vm_uids_basis=d.get("vm_uids_basis"),
            smolvm_tested=d.get("smolvm_tested"),
            smolvm_tested_versions=tuple(d.get("smolvm_tested_versions") or ()),
            guest_kit=d.get("guest_kit"),
            guest_kit_argv=tuple(d.get("guest_kit_argv") or ()),
        )


class NodeInfoRecord(NamedTuple):
    """``NodeInfo``'s answer: this node as a placer sees it (docs/protocol.md)."""

    server_version: str
    protocol: int
    host: str
    labels: dict[str, str]
    privilege: str
    smolvm: str | None
    vm_possible: bool
    vm_why_not: str | None
    kvm: str
    max_bottles: int
    bottles: int
    vm_bottles: int
    connections_used: int
    connections_total: int
    health: str
    health_reasons: tuple[str, ...]
    draining: bool
    #: False when ``smolvm`` is outside the tested versions; None from an older daemon.
    smolvm_tested: bool | None = None
    #: Per-VM uids the node can still give out (None: not per-VM uids, or an older daemon).
    vm_uids_left: int | None = None
    vm_uids: str | None = None
    #: The warm pools (``PoolRecord``s; none from an older daemon).
    pools: tuple[Any, ...] = ()

    @classmethod
    def from_answer(cls, d: dict[str, Any]) -> NodeInfoRecord:
        fields: dict[str, Any] = {k: d.get(k) for k in cls._fields}
        fields["labels"] = dict(label.partition("=")[::2] for label in d["labels"])
        fields["health_reasons"] = tuple(d["health_reasons"])
        fields["pools"] = tuple(d.get("pools") or ())
        return cls(**fields)


class DrainResult(NamedTuple):
    """``Drain``'s answer: ``empty`` once the node holds no bottle (``held`` then)."""

    draining: bool
    held: int
    empty: bool

    @classmethod
    def from_answer(cls, d: dict[str, Any]) -> DrainResult:
        return cls(draining=d["draining"], held=d["held"], empty=d["empty"])


class Page(NamedTuple, Generic[T]):
    """One page of a listing; ask again with ``offset=next_offset`` while it is not None."""

    items: tuple[T, ...]
    total: int
    next_offset: int | None

    @classmethod
    def from_answer(cls, d: dict[str, Any], key: str) -> Page[T]:
        return cls(items=tuple(d[key]), total=d["total"], next_offset=d["next_offset"])


class AgentEndpoint(NamedTuple):
    """Where the agent connects for a new forward: ``host:port`` or a UNIX ``path``."""

    forward: ForwardRecord
    host: str | None
    port: int | None
    path: str | None

    @classmethod
    def from_answer(cls, d: dict[str, Any]) -> AgentEndpoint:
        return cls(forward=d["forward"], host=d["host"], port=d["port"], path=d["path"])

    def describe(self) -> str:
        return self.forward.endpoint


class RecordError(FieldError):
    """A JSON record did not have the expected shape (message names no peer value)."""


def record_fields(d: object, what: str) -> Fields:
    """The typed fields of one JSON record (``what`` names it in an error)."""
    return Fields(d, what, error=RecordError, what="an object")


def _reject_constant(name: str) -> Any:
    raise RecordError("NaN and Infinity are not allowed")


def record_objects(data: bytes) -> list[dict[str, Any]]:
    """A JSON list of record objects (UTF-8, no NaN), as the daemon encodes records."""
    try:
        items = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # bad UTF-8, bad JSON, an over-long integer
        raise RecordError("record list is not valid JSON") from None
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise RecordError("record list must be a JSON list of objects")
    return items


class EndpointRow(NamedTuple):
    """One agent endpoint of a VM bottle (the fields of ``EndpointRecord``)."""

    service: str
    endpoint: str
    host_path: str | None = None

    @classmethod
    def from_json(cls, d: object) -> EndpointRow:
        f = record_fields(d, "endpoint")
        return cls(
            service=f.value("service", str),
            endpoint=f.value("endpoint", str),
            host_path=f.value("host_path", str, optional=True),
        )


class PoolRow(NamedTuple):
    """A warm pool as a client reads it (the fields of ``PoolRecord``, in order)."""

    spec_hash: str
    size: int
    ready: int
    filling: int
    failed: int
    detail: str | None = None

    @classmethod
    def from_json(cls, d: object) -> PoolRow:
        f = record_fields(d, "pool")
        return cls(
            spec_hash=f.value("spec_hash", str),
            size=f.value("size", int),
            ready=f.value("ready", int),
            filling=f.value("filling", int),
            failed=f.value("failed", int),
            detail=f.value("detail", str, optional=True),
        )


class BottleRow(NamedTuple):
    """A bottle as a client reads it (the fields of ``BottleRecord``, in order)."""

    name: str
    alias: str | None
    source: str
    state: str
    created_at: float
    forwards: int
    mode: str | None = None
    isolation: str | None = None
    sidecar_vm: str | None = None
    agent_vm: str | None = None
    endpoints: tuple[EndpointRow, ...] = ()
    env: Mapping[str, str] = {}
    policy: tuple[str, ...] | None = None
    probe: str | None = None
    warnings: tuple[str, ...] = ()
    detail: str | None = None
    workload: str | None = None
    workload_exit_code: int | None = None
    bridge: str | None = None
    owner: str | None = None
    lease_seconds: float | None = None
    lease_expires_at: float | None = None
    capability: str | None = None

    @classmethod
    def from_json(cls, d: object) -> BottleRow:
        f = record_fields(d, "bottle")
        return cls(
            name=f.value("name", str),
            alias=f.value("alias", str, optional=True),
            source=f.value("source", str),
            state=f.value("state", str),
            created_at=f.number("created_at"),
            forwards=f.value("forwards", int),
            mode=f.value("mode", str, optional=True),
            isolation=f.value("isolation", str, optional=True),
            sidecar_vm=f.value("sidecar_vm", str, optional=True),
            agent_vm=f.value("agent_vm", str, optional=True),
            endpoints=tuple(EndpointRow.from_json(e) for e in f.items("endpoints", optional=True)),
            env=f.str_map("env"),
            policy=f.strings("policy", optional=True),
            probe=f.value("probe", str, optional=True),
            warnings=f.strings("warnings", optional=True) or (),
            detail=f.value("detail", str, optional=True),
            workload=f.value("workload", str, optional=True),
            workload_exit_code=f.value("workload_exit_code", int, optional=True),
            bridge=f.value("bridge", str, optional=True),
            owner=f.value("owner", str, optional=True),
            lease_seconds=_optional_number(f, "lease_seconds"),
            lease_expires_at=_optional_number(f, "lease_expires_at"),
            capability=f.value("capability", str, optional=True),
        )


def _optional_number(f: Fields, key: str) -> float | None:
    return None if f.table.get(key) is None else f.number(key)
