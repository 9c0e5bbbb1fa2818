"""What the control server needs from the bottles layer: typed values in, bottles out.

``bottlenet.bottles.registry.BottleRegistry`` satisfies this structurally; unit tests use an
in-memory fake with the same methods. Every argument has been parsed and validated once by
the responder (with the validators the config file uses): names, addresses, specs, targets
and allow-lists arrive as their values, never as raw text or dicts. The types are named only
for the type checker (no import cycle at run time). New capabilities get new methods here and
new commands, so adding them never changes an existing one.

The method list is declared once, here: each method says with :func:`scoped` how a scoped
peer's call of it is checked, and ``control/scope.py``'s view is derived from that (a new
method without a scope is refused to scoped peers until it declares one).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from attrs import frozen

if TYPE_CHECKING:
    import ipaddress

    from twisted.internet.interfaces import IProcessProtocol, IProcessTransport

    from bottlenet.bottles.attach import ExecRequest
    from bottlenet.bottles.egresslayer import TransparentCount
    from bottlenet.bottles.model import Bottle
    from bottlenet.bottles.pooled import PoolUse
    from bottlenet.bottles.probe import ProbeVerdict
    from bottlenet.bottles.spec import BottleSpec
    from bottlenet.bottles.tenancy import Tenancy
    from bottlenet.bottles.volumes import Requester
    from bottlenet.forward.spec import TargetSpec
    from bottlenet.forward.table import ForwardInfo
    from bottlenet.node.info import NodeReport
    from bottlenet.node.pools import PoolReport


class Scope(enum.Enum):
    """How a scoped peer's call of a backend method is checked (``control/scope.py``)."""

    #: In its name space, the peer stamped as the bottle's creator; no alias of its choice.
    CREATE = "create"
    #: The first argument names a bottle: the peer's own, else NOT_FOUND as for a missing one.
    BOTTLE = "bottle"
    #: Rows of the bottle named first (checked as BOTTLE), or of every bottle: its own only.
    LISTING = "listing"
    #: The host's business whoever made the bottle: PERMISSION_DENIED.
    HOST = "host"


class Names(enum.Enum):
    """How an answer (a listing's each row) names a bottle: a scoped peer sees its names."""

    NONE = "none"  # no bottle: an allow-list, a status line, a transport
    BOTTLE = "bottle"  # a ``Bottle``
    VERIFIED = "verified"  # a ``Bottle`` and the gate's verdict
    FORWARD = "forward"  # a ``ForwardInfo`` (its spec's bottle)
    ROW = "row"  # a row with a ``bottle`` (``TransparentCount``)


@frozen
class Scoping:
    """A method's :class:`Scope`, what its answer names (:class:`Names`), the ``command`` a
    refusal names."""

    scope: Scope
    answer: Names = Names.NONE
    command: str = ""


_SCOPES: dict[str, Scoping] = {}
Method = TypeVar("Method", bound=Callable[..., Any])


def scoped(
    scope: Scope, answer: Names = Names.NONE, command: str = ""
) -> Callable[[Method], Method]:
    """Declare how a scoped peer's call of the :class:`ControlBackend` method is checked."""

    def declare(method: Method) -> Method:
        _SCOPES[method.__name__] = Scoping(scope, answer, command)
        return method

    return declare


def scoping(name: str) -> Scoping:
    """How a scoped peer's call of the backend method ``name`` is checked (KeyError: it
    declares none)."""
    return _SCOPES[name]


class ControlBackend(Protocol):
    """The registry operations the control plane exposes."""

    @scoped(Scope.CREATE, Names.BOTTLE)
    async def create_bottle(
        self,
        name: str,
        alias: ipaddress.IPv4Address | None = None,
        *,
        spec: BottleSpec | None = None,
        tenancy: Tenancy | None = None,
        requester: Requester | None = None,
        pool: PoolUse = ...,
    ) -> Bottle:
        """``pool``: whether it may take a warm pool's member of its spec (a scoped peer's
        create may, as any create: a member is no one's until it is taken)."""
        ...

    @scoped(Scope.BOTTLE, Names.VERIFIED)
    async def verify_bottle(self, name: str) -> tuple[Bottle, ProbeVerdict]: ...

    @scoped(Scope.BOTTLE)
    async def set_egress_policy(self, name: str, hosts: tuple[str, ...]) -> tuple[str, ...]: ...

    @scoped(Scope.BOTTLE)
    async def destroy_bottle(self, name: str) -> None: ...

    @scoped(Scope.LISTING, Names.BOTTLE)
    def list_bottles(self) -> Sequence[Bottle]: ...

    @scoped(Scope.BOTTLE, Names.BOTTLE)
    def get_bottle(self, name: str) -> Bottle: ...

    @scoped(Scope.BOTTLE, Names.FORWARD)
    async def add_forward(
        self, bottle: str, label: str, target: TargetSpec, port: int = 0
    ) -> ForwardInfo: ...

    @scoped(Scope.BOTTLE)
    async def remove_forward(self, bottle: str, label: str) -> None: ...

    @scoped(Scope.LISTING, Names.FORWARD)
    def list_forwards(self, bottle: str | None = None) -> Sequence[ForwardInfo]: ...

    @scoped(Scope.HOST, command="Leftovers")
    async def leftovers(self, name: str) -> list[str]:
        """What the bottle ``name``, no longer there, left on the host (one line each)."""
        ...

    @scoped(Scope.BOTTLE)
    def bridge_status(self, name: str) -> str | None:
        """bottlenet's in-guest bridge of a VM bottle, described (None: no VMs)."""
        ...

    @scoped(Scope.LISTING, Names.ROW)
    def transparent_stats(self, bottle: str | None = None) -> Sequence[TransparentCount]:
        """Transparent egress connects per bottle and target (``bottle stats``)."""
        ...

    @scoped(Scope.BOTTLE)
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

    @scoped(Scope.BOTTLE)
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

    def ensure_pool(self, doc: dict[str, Any], size: int) -> PoolReport:
        """Keep ``size`` bottles of the spec ``doc`` ready (durable; INVALID_ARGUMENT)."""
        ...

    def pool_reports(self) -> list[PoolReport]: ...

    def remove_pool(self, key: str) -> int:
        """Forget the pool ``key`` (NOT_FOUND); how many members were destroyed."""
        ...
