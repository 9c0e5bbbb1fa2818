"""Wire records of the control protocol, the one conversion from the bottles' values to them,
and their JSON encoding (the AMP arguments that carry them live in
:mod:`~bottlenet.control.commands`, so the light client reads records without importing AMP).

These are the control plane's own value types (not the registry's), so the wire format
does not change when the service layer's internals do: :func:`bottle_record`,
:func:`forward_record` and :func:`stats_record` are the only places that read a bottle or a
forward to build one. Records evolve like commands: add fields with defaults only; decoders
ignore keys they do not know. (The client side imports this module: the bottles' types are
named for the type checker only.)
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import attrs
from attrs import field, frozen

from bottlenet.control.results import BottleRow, EndpointRow, PoolRow, record_objects
from bottlenet.control.results import RecordError as RecordError  # raised by the readers
from bottlenet.control.results import record_fields as _fields

if TYPE_CHECKING:
    from bottlenet.bottles.egresslayer import TransparentCount
    from bottlenet.bottles.model import Bottle
    from bottlenet.forward.table import ForwardInfo
    from bottlenet.node.pools import PoolReport


@frozen
class EndpointRecord:
    """One agent endpoint of a VM bottle: what the agent dials (never the raw port)."""

    service: str
    endpoint: str  # "alias:port" (alias mode) or "unix:GUEST_PATH" (socket mode)
    host_path: str | None = None  # socket mode: the host socket mounted into the agent VM

    @classmethod
    def from_json(cls, d: object) -> EndpointRecord:
        return cls(*EndpointRow.from_json(d))


@frozen
class BottleRecord:
    """A bottle. Fields after ``forwards`` were added with VM bottles; they are left out of
    the JSON when they hold their default (so forward-only records are unchanged)."""

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
    endpoints: tuple[EndpointRecord, ...] = ()
    env: dict[str, str] = field(factory=dict)
    policy: tuple[str, ...] | None = None
    probe: str | None = None
    warnings: tuple[str, ...] = ()
    detail: str | None = None
    workload: str | None = None
    workload_exit_code: int | None = None
    #: bottlenet's in-guest bridge (socket mode): "running (3128, ...)", "off", ...
    bridge: str | None = None
    #: Its owner label and lease (``bottles.tenancy``): the lease's length and its expiry
    #: (Unix seconds) as last granted.
    owner: str | None = None
    lease_seconds: float | None = None
    lease_expires_at: float | None = None
    #: ``CreateBottle``'s answer to a scoped peer only: the capability its later calls about
    #: this bottle present (``control/scope.py``); a secret, shown to no one else.
    capability: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BottleRecord:
        """Read as the client's :class:`~bottlenet.control.results.BottleRow` is (one reader)."""
        row = BottleRow.from_json(d)
        endpoints = tuple(EndpointRecord(*e) for e in row.endpoints)
        return cls(**{**row._asdict(), "endpoints": endpoints, "env": dict(row.env)})


@frozen
class EventRecord:
    """One bottle event pushed to watchers: ``kind`` is ``created``, ``ready``,
    ``degraded``, ``workload_exited``, ``destroyed``, ``bridge_restarted`` or
    ``lease_expired``, or the node's ``drained``/``undrained`` (``bottle`` empty); ``seq``
    grows by one per event."""

    seq: int
    kind: str
    bottle: str
    at: float
    state: str | None = None
    detail: str | None = None
    exit_code: int | None = None
    #: The scoped peer (``uid:N``) that created the bottle; None: not a scoped peer.
    creator: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EventRecord:
        f = _fields(d, "event")
        return cls(
            seq=f.value("seq", int),
            kind=f.value("kind", str),
            bottle=f.value("bottle", str),
            at=f.number("at"),
            state=f.value("state", str, optional=True),
            detail=f.value("detail", str, optional=True),
            exit_code=f.value("exit_code", int, optional=True),
            creator=f.value("creator", str, optional=True),
        )


@frozen
class PoolRecord:
    """A warm pool (``node/pools.py``): its spec hash, size, members ready and being made,
    fills that failed and the last failure's error."""

    spec_hash: str
    size: int
    ready: int
    filling: int
    failed: int
    detail: str | None = None

    @classmethod
    def from_json(cls, d: object) -> PoolRecord:
        return cls(*PoolRow.from_json(d))


def pool_record(report: PoolReport) -> PoolRecord:
    """The one conversion of a warm pool's report to its wire record."""
    return PoolRecord(
        spec_hash=report.spec_hash,
        size=report.size,
        ready=report.ready,
        filling=report.filling,
        failed=report.failed,
        detail=report.detail,
    )


@frozen
class ForwardRecord:
    bottle: str
    label: str
    target: str
    endpoint: str

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ForwardRecord:
        f = _fields(d, "forward")
        return cls(
            bottle=f.value("bottle", str),
            label=f.value("label", str),
            target=f.value("target", str),
            endpoint=f.value("endpoint", str),
        )


#: The label of a ``bottle stats`` row that counts transparent egress connects to a target.
TRANSPARENT_LABEL = "transparent:"


@frozen
class StatsRecord:
    bottle: str
    label: str
    endpoint: str
    accepted: int
    active: int
    refused: int
    failed: int
    bytes_in: int
    bytes_out: int

    COUNTERS: ClassVar[tuple[str, ...]] = (
        "accepted",
        "active",
        "refused",
        "failed",
        "bytes_in",
        "bytes_out",
    )

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StatsRecord:
        f = _fields(d, "stats")
        return cls(
            bottle=f.value("bottle", str),
            label=f.value("label", str),
            endpoint=f.value("endpoint", str),
            accepted=f.value("accepted", int),
            active=f.value("active", int),
            refused=f.value("refused", int),
            failed=f.value("failed", int),
            bytes_in=f.value("bytes_in", int),
            bytes_out=f.value("bytes_out", int),
        )


def bottle_record(
    bottle: Bottle, forwards: int, *, with_env: bool = True, bridge: str | None = None
) -> BottleRecord:
    """The wire view of a bottle with ``forwards`` live forwards; listings leave the
    (possibly large) stamped env out. The raw ports are never part of it."""
    vm = bottle.vms
    tenancy = bottle.tenancy
    lease = None if tenancy is None else tenancy.lease
    return BottleRecord(
        name=bottle.name,
        alias=bottle.alias,
        source=bottle.source,
        state=bottle.state,
        created_at=float(bottle.created_at),
        forwards=forwards,
        mode=vm.mode if vm else None,
        isolation=bottle.isolation,
        sidecar_vm=vm.sidecar_vm if vm else None,
        agent_vm=vm.agent_vm if vm else None,
        endpoints=tuple(
            EndpointRecord(e.service, e.agent_address(), e.path)
            for e in (vm.endpoints if vm else ())
        ),
        env=dict(vm.env) if vm and with_env else {},
        policy=vm.policy if vm else None,
        probe=vm.probe if vm else None,
        warnings=bottle.warnings,
        detail=bottle.detail,
        workload=vm.workload if vm else None,
        workload_exit_code=vm.workload_exit_code if vm else None,
        bridge=bridge,
        owner=None if tenancy is None else tenancy.owner,
        lease_seconds=None if lease is None else lease.seconds,
        lease_expires_at=None if lease is None else lease.expires_at,
    )


def forward_record(info: ForwardInfo) -> ForwardRecord:
    return ForwardRecord(
        bottle=info.spec.bottle,
        label=info.spec.label,
        target=info.spec.target.describe(),
        endpoint=info.bound.describe(),
    )


def transparent_record(info: TransparentCount) -> StatsRecord:
    """A bottle's transparent egress connects to one target, as the row ``transparent:TARGET``
    (accepted: tunnelled; refused: by the proxy; failed: the proxy did not answer)."""
    return StatsRecord(
        bottle=info.bottle,
        label=f"{TRANSPARENT_LABEL}{info.target}",
        endpoint="transparent egress",
        accepted=info.ok,
        active=0,
        refused=info.refused,
        failed=info.failed,
        bytes_in=0,
        bytes_out=0,
    )


def stats_record(info: ForwardInfo) -> StatsRecord:
    c = info.counters
    return StatsRecord(
        bottle=info.spec.bottle,
        label=info.spec.label,
        endpoint=info.bound.describe(),
        accepted=c.accepted,
        active=c.active,
        refused=c.refused,
        failed=c.failed,
        bytes_in=c.bytes_in,
        bytes_out=c.bytes_out,
    )


class _Record(Protocol):
    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Any: ...


R = TypeVar("R", bound=_Record)


def _record_json(record: Any) -> dict[str, Any]:
    """A record as a JSON object; fields that have a default are omitted while they hold it."""
    plain = attrs.asdict(record)
    out: dict[str, Any] = {}
    for f in attrs.fields(type(record)):
        if f.default is not attrs.NOTHING:
            default = f.default.factory() if isinstance(f.default, attrs.Factory) else f.default  # type: ignore[arg-type]
            if getattr(record, f.name) == default:
                continue
        out[f.name] = plain[f.name]
    return out


def encode_records(records: list[Any]) -> bytes:
    """Compact JSON for a list of attrs records (UTF-8, no NaN, no spaces)."""
    return json.dumps(
        [_record_json(r) for r in records],
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8")


def decode_records(data: bytes, record: type[R]) -> list[R]:
    """A JSON list of records (as :func:`encode_records` writes it) back to records."""
    return [record.from_json(i) for i in record_objects(data)]
