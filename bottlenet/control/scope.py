"""Scoped control peers: each create's holder of its capability, in a name space of its own.

Why: a fleet's bottle actors (Ray workers, docs/fleet.md) need to create, use and destroy
their own bottles through the node's socket, and nothing more: a worker that is compromised
must not reach another owner's bottle nor drain the node. And Ray runs every job of every
trainer as one uid, so the uid alone cannot tell one job from another.

``--allow-uid UID:scoped`` admits such a uid. Its identity is the uid **and a capability**:
a secret (22-128 of ``A-Za-z0-9_-``) its ``CreateBottle`` gives, or that the daemon mints and
answers when it gives none (``BottleRecord.capability``). Every later call of the peer about
that bottle presents it (the commands' optional ``capability`` argument); without the right
one the bottle answers ``NOT_FOUND`` exactly as a missing one. So two jobs of one uid reach
each other's bottles only by sharing the capability.

Names: each identity has a **name space** of its own. The bottle a scoped peer calls ``x`` is
``x-<tag>`` on the node (``tag``: 12 hex digits of the identity's digest), so a peer never
learns whether a name is held elsewhere (a create of any free name of its own succeeds, as
any other), and two jobs may both have an ``x``. Everything it is answered (records, forward
listings, events) names its bottles as it does. It may not choose an alias (which is the
node's, one per bottle): its bottles take the next free one. Its listings, stats and events
are its identity's bottles only (and the node's own events); its ``NodeInfo`` counts its own
bottles and their connections only; ``Drain``, ``Undrain`` and ``Leftovers`` answer
``PERMISSION_DENIED``. The digest (never the capability) is recorded as the bottle's creator
(``uid:N/<sha256 hex>`` in its state record), so a restart keeps it. A plain ``--allow-uid
UID`` keeps full control (a capability it sends is not needed and is ignored).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

from attrs import evolve, field, frozen

from bottlenet.bottles.events import BottleEvent
from bottlenet.bottles.tenancy import Tenancy
from bottlenet.errors import InvalidArgument, NotFound, PermissionDenied
from bottlenet.forward.spec import BOTTLE_NAME_MAX

if TYPE_CHECKING:
    from twisted.internet.interfaces import IProcessProtocol, IProcessTransport

    from bottlenet.bottles.attach import ExecRequest
    from bottlenet.bottles.egresslayer import TransparentCount
    from bottlenet.bottles.model import Bottle
    from bottlenet.bottles.probe import ProbeVerdict
    from bottlenet.bottles.spec import BottleSpec
    from bottlenet.bottles.volumes import Requester
    from bottlenet.control.backend import ControlBackend
    from bottlenet.forward.spec import TargetSpec
    from bottlenet.forward.table import ForwardInfo

_CAPABILITY = re.compile(r"[A-Za-z0-9_-]{22,128}")
#: Hex digits of an identity's digest that end its bottles' names on the node.
TAG_HEX = 12
#: The longest name a scoped peer may give a bottle (the node's name adds ``-`` and the tag).
MAX_SCOPED_NAME = BOTTLE_NAME_MAX - TAG_HEX - 1


def mint_capability() -> str:
    """A new capability: 192 random bits, 32 characters."""
    return secrets.token_urlsafe(24)


def check_capability(text: str) -> str:
    if not _CAPABILITY.fullmatch(text):
        raise InvalidArgument("capability: 22-128 of A-Z a-z 0-9 _ - (a secret; keep it so)")
    return text


@frozen
class Identity:
    """A scoped peer as one call presents itself: its uid and the capability it gave (None:
    it gave none, so it holds no bottle)."""

    uid: int
    capability: str | None = field(default=None, repr=False)
    digest: str = field(init=False, repr=False)

    @digest.default
    def _digest(self) -> str:
        if self.capability is None:
            return ""
        text = f"bottlenet capability\0{self.uid}\0{self.capability}"
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def creator(self) -> str:
        """As its bottles record their creator (the digest, never the capability)."""
        return f"uid:{self.uid}/{self.digest}" if self.digest else f"uid:{self.uid}"

    def node_name(self, name: str) -> str:
        """The node's name of its bottle ``name`` (NOT_FOUND: it holds no bottle)."""
        if not self.digest:
            raise NotFound(f"bottle {name} does not exist (no capability was given)")
        if len(name) > MAX_SCOPED_NAME:
            raise InvalidArgument(
                f"bottle name: at most {MAX_SCOPED_NAME} characters for a scoped peer"
            )
        return f"{name}-{self.digest[:TAG_HEX]}"

    def own_name(self, node_name: str) -> str | None:
        """What it calls the node's ``node_name``; None: not a name of its name space."""
        suffix = f"-{self.digest[:TAG_HEX]}"
        if not self.digest or not node_name.endswith(suffix):
            return None
        return node_name[: -len(suffix)]

    def made(self, bottle: Bottle) -> bool:
        """Whether ``bottle`` is one of this identity's (its name space and its record)."""
        creator = None if bottle.tenancy is None else bottle.tenancy.creator
        return (
            creator is not None
            and self.own_name(bottle.name) is not None
            and hmac.compare_digest(creator, self.creator)
        )


class ScopedBackend:
    """The registry as one scoped identity sees it (a ``ControlBackend``): its names in,
    its names out."""

    def __init__(self, backend: ControlBackend, identity: Identity) -> None:
        self._backend = backend
        self.identity = identity

    def inner(self, name: str) -> str:
        """The node's name of its bottle ``name`` (for what the control plane keeps by it)."""
        return self.identity.node_name(name)

    def sees(self, event: BottleEvent) -> BottleEvent | None:
        """An event as it is shown to this identity: its own bottles' (under its names) and
        the node's (their bottle is empty); None for any other."""
        if event.bottle == "":
            return event
        own = self.identity.own_name(event.bottle)
        creator = event.creator
        if (
            own is None
            or creator is None
            or not hmac.compare_digest(creator, self.identity.creator)
        ):
            return None
        return evolve(event, bottle=own)

    def _mine(self, name: str) -> str:
        """The node's name of its bottle ``name``; NOT_FOUND as for a missing one else."""
        node_name = self.identity.node_name(name)
        try:
            bottle = self._backend.get_bottle(node_name)
        except NotFound:
            raise NotFound(f"bottle {name} does not exist") from None
        if not self.identity.made(bottle):
            raise NotFound(f"bottle {name} does not exist")
        return node_name

    def _own(self, node_name: str) -> str:
        """Its name of one of its bottles (found through :meth:`Identity.made`)."""
        own = self.identity.own_name(node_name)
        assert own is not None
        return own

    def _out(self, bottle: Bottle) -> Bottle:
        return evolve(bottle, name=self._own(bottle.name))

    def _out_forward(self, info: ForwardInfo) -> ForwardInfo:
        return evolve(info, spec=evolve(info.spec, bottle=self._own(info.spec.bottle)))

    async def create_bottle(
        self,
        name: str,
        alias: ipaddress.IPv4Address | None = None,
        *,
        spec: BottleSpec | None = None,
        tenancy: Tenancy | None = None,
        requester: Requester | None = None,
    ) -> Bottle:
        if alias is not None:
            raise PermissionDenied(
                "CreateBottle: a scoped peer may not choose an alias (its bottle gets the next "
                "free one)"
            )
        node_name = self.identity.node_name(name)
        stamped = evolve(tenancy or Tenancy(), creator=self.identity.creator)
        own_spec = None if spec is None else evolve(spec, name=node_name)
        created = await self._backend.create_bottle(
            node_name, None, spec=own_spec, tenancy=stamped, requester=requester
        )
        return self._out(created)

    async def verify_bottle(self, name: str) -> tuple[Bottle, ProbeVerdict]:
        bottle, verdict = await self._backend.verify_bottle(self._mine(name))
        return self._out(bottle), verdict

    async def set_egress_policy(self, name: str, hosts: tuple[str, ...]) -> tuple[str, ...]:
        return await self._backend.set_egress_policy(self._mine(name), hosts)

    async def destroy_bottle(self, name: str) -> None:
        await self._backend.destroy_bottle(self._mine(name))

    def list_bottles(self) -> Sequence[Bottle]:
        made = self.identity.made
        return [self._out(b) for b in self._backend.list_bottles() if made(b)]

    def get_bottle(self, name: str) -> Bottle:
        return self._out(self._backend.get_bottle(self._mine(name)))

    async def add_forward(
        self, bottle: str, label: str, target: TargetSpec, port: int = 0
    ) -> ForwardInfo:
        info = await self._backend.add_forward(self._mine(bottle), label, target, port)
        return self._out_forward(info)

    async def remove_forward(self, bottle: str, label: str) -> None:
        await self._backend.remove_forward(self._mine(bottle), label)

    def list_forwards(self, bottle: str | None = None) -> Sequence[ForwardInfo]:
        if bottle is not None:
            found = self._backend.list_forwards(self._mine(bottle))
        else:
            mine = {b.name for b in self._backend.list_bottles() if self.identity.made(b)}
            found = [f for f in self._backend.list_forwards(None) if f.spec.bottle in mine]
        return [self._out_forward(f) for f in found]

    def bridge_status(self, name: str) -> str | None:
        return self._backend.bridge_status(self._mine(name))

    def transparent_stats(self, bottle: str | None = None) -> Sequence[TransparentCount]:
        if bottle is not None:
            found = self._backend.transparent_stats(self._mine(bottle))
        else:
            mine = {b.name for b in self._backend.list_bottles() if self.identity.made(b)}
            found = [r for r in self._backend.transparent_stats(None) if r.bottle in mine]
        return [evolve(r, bottle=self._own(r.bottle)) for r in found]

    async def spawn_exec(
        self,
        name: str,
        request: ExecRequest,
        protocol: IProcessProtocol,
        stdio: tuple[int, int, int] | None = None,
    ) -> IProcessTransport:
        return await self._backend.spawn_exec(self._mine(name), request, protocol, stdio)

    async def leftovers(self, name: str) -> list[str]:
        """A gone bottle's traces are the host's business, whoever made it: full control."""
        raise PermissionDenied("Leftovers: a scoped peer may not ask for it")

    async def spawn_logs(
        self, name: str, tail: int, follow: bool, protocol: IProcessProtocol
    ) -> IProcessTransport:
        return await self._backend.spawn_logs(self._mine(name), tail, follow, protocol)
