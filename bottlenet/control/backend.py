"""What the control server needs from the service layer.

``bottlenet.bottles.registry.BottleRegistry`` satisfies this structurally; unit tests use an
in-memory fake. New capabilities (VMs, egress policy) get new methods here and new commands,
so adding them never changes an existing command.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from bottlenet.forward.spec import ForwardSpec, ListenSpec


class CountersView(Protocol):
    @property
    def accepted(self) -> int: ...
    @property
    def active(self) -> int: ...
    @property
    def refused(self) -> int: ...
    @property
    def failed(self) -> int: ...
    @property
    def bytes_in(self) -> int: ...
    @property
    def bytes_out(self) -> int: ...


class ForwardView(Protocol):
    """Shape of ``bottlenet.forward.table.ForwardInfo``."""

    @property
    def spec(self) -> ForwardSpec: ...
    @property
    def bound(self) -> ListenSpec: ...
    @property
    def counters(self) -> CountersView: ...


class BottleView(Protocol):
    """Shape of ``bottlenet.bottles.registry.BottleInfo``."""

    @property
    def name(self) -> str: ...
    @property
    def alias(self) -> str | None: ...
    @property
    def source(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def created_at(self) -> float: ...
    @property
    def forwards(self) -> tuple[ForwardView, ...]: ...


class ControlBackend(Protocol):
    """The registry operations the control plane exposes."""

    async def create_bottle(self, name: str, alias: str | None = None) -> BottleView: ...

    async def destroy_bottle(self, name: str) -> None: ...

    def list_bottles(self) -> Sequence[BottleView]: ...

    def get_bottle(self, name: str) -> BottleView: ...

    async def add_forward(
        self, bottle: str, label: str, target: str, port: int = 0
    ) -> ForwardView: ...

    async def remove_forward(self, bottle: str, label: str) -> None: ...

    def list_forwards(self, bottle: str | None = None) -> Sequence[ForwardView]: ...
