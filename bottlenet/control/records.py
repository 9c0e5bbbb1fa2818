"""Wire records of the control protocol and the AMP argument that carries lists of them.

These are the control plane's own value types (not the registry's), so the wire format
does not change when the service layer's internals do. Records evolve like commands: add
fields with defaults only; decoders ignore keys they do not know.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import attrs
from attrs import field, frozen
from twisted.protocols import amp

from bottlenet.control.framing import MAX_VALUE_LENGTH


class RecordError(ValueError):
    """A JSON record did not have the expected shape (message names no peer value)."""


def _get(d: dict[str, Any], key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
    if key not in d or d[key] is None:
        if optional:
            return None
        raise RecordError(f"record field {key!r} is missing")
    value = d[key]
    if isinstance(value, bool) and kind is not bool:
        raise RecordError(f"record field {key!r} has the wrong type")
    if not isinstance(value, kind):
        raise RecordError(f"record field {key!r} has the wrong type")
    return value


def _str_map(d: dict[str, Any], key: str) -> dict[str, str]:
    value = _get(d, key, dict, optional=True) or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise RecordError(f"record field {key!r} has the wrong type")
    return dict(value)


def _str_list(d: dict[str, Any], key: str) -> tuple[str, ...] | None:
    value = _get(d, key, list, optional=True)
    if value is None:
        return None
    if not all(isinstance(v, str) for v in value):
        raise RecordError(f"record field {key!r} has the wrong type")
    return tuple(value)


@frozen
class EndpointRecord:
    """One agent endpoint of a VM bottle: what the agent dials (never the raw port)."""

    service: str
    endpoint: str  # "alias:port" (alias mode) or "unix:GUEST_PATH" (socket mode)
    host_path: str | None = None  # socket mode: the host socket mounted into the agent VM

    @classmethod
    def from_json(cls, d: object) -> EndpointRecord:
        if not isinstance(d, dict):
            raise RecordError("endpoint record must be an object")
        return cls(
            service=_get(d, "service", str),
            endpoint=_get(d, "endpoint", str),
            host_path=_get(d, "host_path", str, optional=True),
        )


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

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BottleRecord:
        endpoints = _get(d, "endpoints", list, optional=True) or []
        return cls(
            name=_get(d, "name", str),
            alias=_get(d, "alias", str, optional=True),
            source=_get(d, "source", str),
            state=_get(d, "state", str),
            created_at=float(_get(d, "created_at", (int, float))),
            forwards=_get(d, "forwards", int),
            mode=_get(d, "mode", str, optional=True),
            isolation=_get(d, "isolation", str, optional=True),
            sidecar_vm=_get(d, "sidecar_vm", str, optional=True),
            agent_vm=_get(d, "agent_vm", str, optional=True),
            endpoints=tuple(EndpointRecord.from_json(e) for e in endpoints),
            env=_str_map(d, "env"),
            policy=_str_list(d, "policy"),
            probe=_get(d, "probe", str, optional=True),
            warnings=_str_list(d, "warnings") or (),
            detail=_get(d, "detail", str, optional=True),
        )


@frozen
class ForwardRecord:
    bottle: str
    label: str
    target: str
    endpoint: str

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ForwardRecord:
        return cls(
            bottle=_get(d, "bottle", str),
            label=_get(d, "label", str),
            target=_get(d, "target", str),
            endpoint=_get(d, "endpoint", str),
        )


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
        return cls(
            bottle=_get(d, "bottle", str),
            label=_get(d, "label", str),
            endpoint=_get(d, "endpoint", str),
            accepted=_get(d, "accepted", int),
            active=_get(d, "active", int),
            refused=_get(d, "refused", int),
            failed=_get(d, "failed", int),
            bytes_in=_get(d, "bytes_in", int),
            bytes_out=_get(d, "bytes_out", int),
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


def _reject_constant(name: str) -> Any:
    raise RecordError("NaN and Infinity are not allowed")


class RecordList(amp.Argument, Generic[R]):
    """An AMP argument holding a list of records as one compact JSON value (< 64 KiB)."""

    def __init__(self, record: type[R], optional: bool = False) -> None:
        super().__init__(optional=optional)
        self.record = record

    def toString(self, inObject: list[R]) -> bytes:
        data = encode_records(list(inObject))
        if len(data) > MAX_VALUE_LENGTH:
            raise amp.TooLong(False, True, data, None)
        return data

    def fromString(self, inString: bytes) -> list[R]:
        try:
            items = json.loads(inString.decode("utf-8"), parse_constant=_reject_constant)
        except (ValueError, RecursionError):  # bad UTF-8, bad JSON, an over-long integer
            raise RecordError("record list is not valid JSON") from None
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise RecordError("record list must be a JSON list of objects")
        return [self.record.from_json(i) for i in items]


class Record(amp.Argument, Generic[R]):
    """An AMP argument holding one record as compact JSON."""

    def __init__(self, record: type[R], optional: bool = False) -> None:
        super().__init__(optional=optional)
        self.record = record
        self._list = RecordList(record)

    def toString(self, inObject: R) -> bytes:
        return self._list.toString([inObject])[1:-1]

    def fromString(self, inString: bytes) -> R:
        items = self._list.fromString(b"[" + inString + b"]")
        if len(items) != 1:
            raise RecordError("expected exactly one record")
        return items[0]
