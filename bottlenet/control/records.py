"""Wire records of the control protocol and the AMP argument that carries lists of them.

These are the control plane's own value types (not the registry's), so the wire format
does not change when the service layer's internals do. Records evolve like commands: add
fields with defaults only; decoders ignore keys they do not know.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import attrs
from attrs import frozen
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


@frozen
class BottleRecord:
    name: str
    alias: str | None
    source: str
    state: str
    created_at: float
    forwards: int

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BottleRecord:
        return cls(
            name=_get(d, "name", str),
            alias=_get(d, "alias", str, optional=True),
            source=_get(d, "source", str),
            state=_get(d, "state", str),
            created_at=float(_get(d, "created_at", (int, float))),
            forwards=_get(d, "forwards", int),
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


def encode_records(records: list[Any]) -> bytes:
    """Compact JSON for a list of attrs records (UTF-8, no NaN, no spaces)."""
    return json.dumps(
        [attrs.asdict(r) for r in records],
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
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
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
