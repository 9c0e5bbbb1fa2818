"""What the control server needs from the bottles layer: typed values in, bottles out.

``bottlenet.bottles.registry.BottleRegistry`` satisfies this structurally; unit tests use an
in-memory fake with the same methods. Every argument has been parsed and validated once by
the responder (with the validators the config file uses): names, addresses, specs, targets
and allow-lists arrive as their values, never as raw text or dicts. The types are named only
for the type checker (no import cycle at run time). New capabilities get new methods here and
new commands, so adding them never changes an existing one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import ipaddress

    from twisted.internet.interfaces import IProcessProtocol, IProcessTransport

    from bottlenet.bottles.attach import ExecRequest
    from bottlenet.bottles.egresslayer import TransparentCount
    from bottlenet.bottles.model import Bottle
    from bottlenet.bottles.probe import ProbeVerdict
    from bottlenet.bottles.spec import BottleSpec
    from bottlenet.bottles.tenancy import Tenancy
    from bottlenet.bottles.volumes import Requester
    from bottlenet.forward.spec import TargetSpec
    from bottlenet.forward.table import ForwardInfo
    from bottlenet.node.info import NodeReport


class ControlBackend(Protocol):
    """The registry operations the control plane exposes."""

    async def create_bottle(
        self,
        name: str,
        alias: ipaddress.IPv4Address | None = None,
        *,
        spec: BottleSpec | None = None,
        tenancy: Tenancy | None = None,
        requester: Requester | None = None,
    ) -> Bottle: ...

    async def verify_bottle(self, name: str) -> tuple[Bottle, ProbeVerdict]: ...

    async def set_egress_policy(self, name: str, hosts: tuple[str, ...]) -> tuple[str, ...]: ...

    async def destroy_bottle(self, name: str) -> None: ...

    def list_bottles(self) -> Sequence[Bottle]: ...

    def get_bottle(self, name: str) -> Bottle: ...

    async def add_forward(
        self, bottle: str, label: str, target: TargetSpec, port: int = 0
    ) -> ForwardInfo: ...

    async def remove_forward(self, bottle: str, label: str) -> None: ...

    def list_forwards(self, bottle: str | None = None) -> Sequence[ForwardInfo]: ...

    async def leftovers(self, name: str) -> list[str]:
        """What the bottle ``name``, no longer there, left on the host (one line each)."""
        ...

    def bridge_status(self, name: str) -> str | None:
        """bottlenet's in-guest bridge of a VM bottle, described (None: no VMs)."""
        ...

    def transparent_stats(self, bottle: str | None = None) -> Sequence[TransparentCount]:
        """Transparent egress connects per bottle and target (``bottle stats``)."""
        ...

    async def spawn_exec(
        self,
        name: str,
        request: ExecRequest,
        protocol: IProcessProtocol,
        stdio: tuple[int, int, int] | None = None,
    ) -> IProcessTransport:
        """``stdio``: fds to give the command as its stdin, stdout, stderr (else pipes to
        ``protocol``)."""
        ...

    async def spawn_logs(
        self, name: str, tail: int, follow: bool, protocol: IProcessProtocol
    ) -> IProcessTransport: ...


class NodeControl(Protocol):
    """What the control plane needs of the node (``bottlenet.node.info.Node``)."""

    def report(self) -> NodeReport: ...

    @property
    def draining(self) -> bool: ...

    def held(self) -> int:
        """Bottles the node holds (creates in flight too)."""
        ...

    def drain(self) -> None: ...

    def undrain(self) -> None: ...

    def renew_lease(self, name: str, seconds: float) -> None:
        """Extend ``name``'s lease (NOT_FOUND, INVALID_ARGUMENT without a lease)."""
        ...

    async def when_serving(self) -> None:
        """Returns once the daemon's recovery is done."""
        ...

    async def when_empty(self, timeout: float) -> bool:
        """True once the node holds no bottle; False after ``timeout`` or an undrain."""
        ...
