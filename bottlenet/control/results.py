"""Typed results shared by the async and the blocking client.

``HelloResult`` and ``Page`` are ``NamedTuple``s (client-side values): ``bottlenetctl status``
and ``ping`` read them without importing attrs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

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
        )


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
