"""What the control server needs from the service layer.

``bottlenet.bottles.registry.BottleRegistry`` satisfies this structurally; unit tests use an
in-memory fake with the same attributes. The values are the registry's own attrs types,
named only for the type checker (no import cycle at run time). New capabilities (VMs, egress
policy) get new methods here and new commands, so adding them never changes an existing one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from twisted.internet.interfaces import IProcessProtocol, IProcessTransport

    from bottlenet.bottles.attach import ExecRequest
    from bottlenet.bottles.probe import ProbeVerdict
    from bottlenet.bottles.registry import BottleInfo
    from bottlenet.forward.table import ForwardInfo


class ControlBackend(Protocol):
    """The registry operations the control plane exposes."""

    async def create_bottle(
        self, name: str, alias: str | None = None, *, spec: Mapping[str, Any] | None = None
    ) -> BottleInfo: ...

    async def verify_bottle(self, name: str) -> tuple[BottleInfo, ProbeVerdict]: ...

    async def set_egress_policy(self, name: str, hosts: object) -> tuple[str, ...]: ...

    async def destroy_bottle(self, name: str) -> None: ...

    def list_bottles(self) -> Sequence[BottleInfo]: ...

    def get_bottle(self, name: str) -> BottleInfo: ...

    async def add_forward(
        self, bottle: str, label: str, target: str, port: int = 0
    ) -> ForwardInfo: ...

    async def remove_forward(self, bottle: str, label: str) -> None: ...

    def list_forwards(self, bottle: str | None = None) -> Sequence[ForwardInfo]: ...

    async def spawn_exec(
        self, name: str, request: ExecRequest, protocol: IProcessProtocol
    ) -> IProcessTransport: ...
