"""Scoped control peers: a uid that sees and acts only on the bottles it created.

Why: a fleet's host actors (Ray workers, docs/fleet.md) need to create, use and destroy
their own bottles through the node's socket, and nothing more: a worker that is compromised
must not reach another owner's bottle nor drain the node. ``--allow-uid UID:scoped`` admits
such a uid; its connections get a :class:`ScopedBackend` instead of the registry. Every bottle
it creates records it as its creator (``uid:N``, in the bottle's state record, so it survives a
restart); any other bottle's name answers ``NOT_FOUND`` exactly as a missing one does;
listings, stats and events show its own bottles only; ``Drain``, ``Undrain`` and
``Leftovers`` (``bottlenetctl selftest``'s last step) answer ``PERMISSION_DENIED``. A plain
``--allow-uid UID`` keeps full control, as before.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import TYPE_CHECKING

from attrs import evolve

from bottlenet.bottles.events import BottleEvent
from bottlenet.bottles.tenancy import Tenancy
from bottlenet.errors import NotFound, PermissionDenied

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


class ScopedBackend:
    """The registry as one scoped peer sees it (a ``ControlBackend``)."""

    def __init__(self, backend: ControlBackend, creator: str) -> None:
        self._backend = backend
        self.creator = creator

    def owns(self, bottle: Bottle) -> bool:
        return bottle.tenancy is not None and bottle.tenancy.creator == self.creator

    def sees(self, event: BottleEvent) -> bool:
        """Its own bottles' events, and the node's (their bottle is empty)."""
        return event.bottle == "" or event.creator == self.creator

    def _mine(self, name: str) -> Bottle:
        bottle = self._backend.get_bottle(name)
        if not self.owns(bottle):
            raise NotFound(f"bottle {name} does not exist")  # the registry's own words
        return bottle

    async def create_bottle(
        self,
        name: str,
        alias: ipaddress.IPv4Address | None = None,
        *,
        spec: BottleSpec | None = None,
        tenancy: Tenancy | None = None,
        requester: Requester | None = None,
    ) -> Bottle:
        stamped = evolve(tenancy or Tenancy(), creator=self.creator)
        return await self._backend.create_bottle(
            name, alias, spec=spec, tenancy=stamped, requester=requester
        )

    async def verify_bottle(self, name: str) -> tuple[Bottle, ProbeVerdict]:
        self._mine(name)
        return await self._backend.verify_bottle(name)

    async def set_egress_policy(self, name: str, hosts: tuple[str, ...]) -> tuple[str, ...]:
        self._mine(name)
        return await self._backend.set_egress_policy(name, hosts)

    async def destroy_bottle(self, name: str) -> None:
        self._mine(name)
        await self._backend.destroy_bottle(name)

    def list_bottles(self) -> Sequence[Bottle]:
        return [b for b in self._backend.list_bottles() if self.owns(b)]

    def get_bottle(self, name: str) -> Bottle:
        return self._mine(name)

    async def add_forward(
        self, bottle: str, label: str, target: TargetSpec, port: int = 0
    ) -> ForwardInfo:
        self._mine(bottle)
        return await self._backend.add_forward(bottle, label, target, port)

    async def remove_forward(self, bottle: str, label: str) -> None:
        self._mine(bottle)
        await self._backend.remove_forward(bottle, label)

    def list_forwards(self, bottle: str | None = None) -> Sequence[ForwardInfo]:
        if bottle is not None:
            self._mine(bottle)
            return self._backend.list_forwards(bottle)
        mine = {b.name for b in self.list_bottles()}
        return [f for f in self._backend.list_forwards(None) if f.spec.bottle in mine]

    def bridge_status(self, name: str) -> str | None:
        self._mine(name)
        return self._backend.bridge_status(name)

    def transparent_stats(self, bottle: str | None = None) -> Sequence[TransparentCount]:
        if bottle is not None:
            self._mine(bottle)
            return self._backend.transparent_stats(bottle)
        mine = {b.name for b in self.list_bottles()}
        return [r for r in self._backend.transparent_stats(None) if r.bottle in mine]

    async def spawn_exec(
        self,
        name: str,
        request: ExecRequest,
        protocol: IProcessProtocol,
        stdio: tuple[int, int, int] | None = None,
    ) -> IProcessTransport:
        self._mine(name)
        return await self._backend.spawn_exec(name, request, protocol, stdio)

    async def leftovers(self, name: str) -> list[str]:
        """A gone bottle's traces are the host's business, whoever made it: full control."""
        raise PermissionDenied("Leftovers: a scoped peer may not ask for it")

    async def spawn_logs(
        self, name: str, tail: int, follow: bool, protocol: IProcessProtocol
    ) -> IProcessTransport:
        self._mine(name)
        return await self._backend.spawn_logs(name, tail, follow, protocol)
