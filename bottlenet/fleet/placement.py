"""Placing bottles: Ray reserves a ``bottle`` for each on nodes that have one free, the node's
host creates it there, a node's daemon may refuse, and a refused bottle is tried again on
another node, within a bound.

A batch's reservation is one Ray placement group of ``count`` bundles of one ``bottle`` each,
every bundle with the request's label selector, spread over the nodes or packed as the request
says: Ray reserves all of them or none, and starts no process for it. Each bottle is then made
by its node's host (one actor per trainer process and node: :mod:`bottlenet.fleet.host`). A
refusal (draining, full, daemon unreachable) places that bottle again under a one-bundle group
whose label selector excludes every node that said no to it (``ray.io/node-id`` not in them);
the refused bundle stays reserved with its batch (its node said no to a bottle just now). Ray
waits with a group no node can take, so a deadline bounds the whole placement. Nothing is
half-made: when one bottle of a batch fails, every bottle made for the batch is destroyed and
every reservation removed before the error.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from bottlenet.errors import InvalidArgument
from bottlenet.fleet.errors import (
    PlacementFailed,
    PlacementTimeout,
    Refusal,
    describe_refusals,
)
from bottlenet.fleet.hosts import JobHosts, hosts_of
from bottlenet.fleet.owner import job_owner
from bottlenet.fleet.placed import PlacedBottle
from bottlenet.fleet.request import BOTTLE_RESOURCE, REFUSAL_CODES, BottleRequest, Placement


def reserve(request: BottleRequest, count: int, excluded: Sequence[str] = ()) -> PlacementGroup:
    """A placement group of ``count`` bundles of one ``bottle``, on nodes the request may
    use and none of ``excluded``."""
    selector = request.node_selector(excluded)
    return placement_group(
        [{BOTTLE_RESOURCE: 1}] * count,
        strategy=request.strategy.ray,
        bundle_label_selector=[selector] * count if selector else None,
    )


def bundle_nodes(reservation: PlacementGroup) -> list[str]:
    """The node of each bundle of a ready reservation, in bundle order."""
    table = placement_group_table(reservation)["bundles_to_node_id"]
    return [table[i] for i in range(len(table))]


class Step(enum.StrEnum):
    """What a pending ObjectRef of a placement waits for."""

    RESERVED = "reserved"
    CREATED = "created"


@attrs.define(eq=False)
class _Slot:
    """One bottle being placed: its attempts so far and the current one's name and host."""

    index: int
    refusals: list[Refusal] = attrs.field(factory=list)
    name: str = ""
    node_id: str = ""
    host: Any = None
    #: its own reservation (after a refusal); None while it holds a bundle of its batch's
    reservation: PlacementGroup | None = None


@attrs.define
class Placer:
    """Places ``count`` bottles of ``request``; ``progress(done)`` after each one is ready.

    After :meth:`run`, ``shared`` is the batch's reservation while any of its bottles holds a
    bundle of it: the caller removes it once they are destroyed (:class:`BottlePool` does).
    A single bottle gets the batch's reservation as its own.
    """

    request: BottleRequest
    count: int
    max_attempts: int = 3
    timeout: float = 300.0
    progress: Callable[[int], None] = lambda done: None
    placed: dict[int, PlacedBottle] = attrs.field(factory=dict)
    #: every refusal on the way, those of bottles placed elsewhere afterwards too
    refusals: list[Refusal] = attrs.field(factory=list)
    shared: PlacementGroup | None = None
    _hosts: JobHosts | None = None
    _pending: dict[Any, tuple[_Slot, Step]] = attrs.field(factory=dict)

    def run(self) -> list[PlacedBottle]:
        if self.count < 0:
            raise InvalidArgument(f"a pool of {self.count} bottles")
        if self.count == 0:
            return []  # Ray refuses a placement group without bundles
        deadline = time.monotonic() + self.timeout
        try:
            owner = job_owner()
            self._hosts = hosts_of(owner)
            self.shared = reserve(self.request, self.count)
            self._wait_reserved(self.shared, deadline)
            nodes = bundle_nodes(self.shared)
            hosts = self._hosts.on(nodes)
            for i, node in enumerate(nodes):
                self._create(_Slot(i), node, hosts[node])
            while self._pending:
                self._settle_one(deadline)
            self._wait_owner(owner, deadline)
        except BaseException:
            self._abandon()
            raise
        bottles = [self.placed[i] for i in range(self.count)]
        if self.count == 1 and bottles[0].reservation is None:
            bottles[0].reservation, self.shared = self.shared, None
        elif all(b.reservation is not None for b in bottles):
            self._release_shared()  # every bottle went elsewhere: the batch's holds none
        return bottles

    def _wait_owner(self, owner: Any, deadline: float) -> None:
        """The bottles are handed over only once the owner answers: the hosts renew leases
        only after it has, and a process whose owner never starts would hold bottles that
        nothing keeps. The hosts started beside it, so this waits only for what is left of
        the owner's own start (nothing, but for a first pool)."""
        left = max(deadline - time.monotonic(), 0.0)
        ready, _ = ray.wait([owner.ping.remote()], timeout=left)
        if not ready:
            raise PlacementTimeout(
                f"the placing process's owner actor did not start within {self.timeout:g}s"
            )
        ray.get(ready[0])

    def _wait_reserved(self, reservation: PlacementGroup, deadline: float) -> None:
        ready, _ = ray.wait([reservation.ready()], timeout=max(deadline - time.monotonic(), 0))
        if not ready:
            raise PlacementTimeout(
                f"{self.count} of {self.count} bottles found no node with a free "
                f"'{BOTTLE_RESOURCE}' resource within {self.timeout:g}s"
            )

    def _create(self, slot: _Slot, node_id: str, host: Any) -> None:
        slot.name = self.request.new_name()  # a refused name was never made
        slot.node_id, slot.host = node_id, host
        self._pending[host.create.remote(slot.name, self.request)] = (slot, Step.CREATED)

    def _settle_one(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        done, _ = ray.wait(list(self._pending), num_returns=1, timeout=max(left, 0.0))
        if not done:
            raise self._timeout()
        slot, step = self._pending.pop(done[0])
        if step is Step.RESERVED:
            assert slot.reservation is not None
            [node] = bundle_nodes(slot.reservation)
            assert self._hosts is not None
            self._create(slot, node, self._hosts.on([node])[node])
            return
        try:
            placement: Placement = ray.get(done[0])
        except RayActorError as e:
            assert self._hosts is not None
            self._hosts.forget(slot.node_id, slot.host)
            refusal = Refusal(slot.node_id, "HOST_LOST", type(e).__name__)
        else:
            if not placement.refused:
                self.placed[slot.index] = PlacedBottle(slot.host, placement, slot.reservation)
                self.progress(len(self.placed))
                return
            assert placement.refusal_code is not None
            refusal = Refusal(
                placement.node_id, placement.refusal_code, placement.refusal_message or ""
            )
        self._retry(slot, refusal)

    def _retry(self, slot: _Slot, refusal: Refusal) -> None:
        slot.refusals.append(refusal)
        self.refusals.append(refusal)
        if slot.reservation is not None:
            remove_placement_group(slot.reservation)
            slot.reservation = None
        # a node that refused is not asked again; a lost host's node may be (a new host)
        refused_by = {r.node_id for r in slot.refusals if r.code in REFUSAL_CODES}
        if len(slot.refusals) >= self.max_attempts or (refused_by and bottle_nodes() <= refused_by):
            raise PlacementFailed(
                f"bottle {slot.index} refused {len(slot.refusals)} times, by every node it "
                f"may use or up to the bound ({describe_refusals(slot.refusals)})",
                slot.refusals,
            )
        slot.reservation = reserve(self.request, 1, sorted(refused_by))
        self._pending[slot.reservation.ready()] = (slot, Step.RESERVED)

    def _timeout(self) -> PlacementTimeout:
        waiting = sum(step is Step.RESERVED for _, step in self._pending.values())
        if waiting:
            return PlacementTimeout(
                f"{waiting} of {self.count} bottles found no node with a free "
                f"'{BOTTLE_RESOURCE}' resource within {self.timeout:g}s"
            )
        return PlacementTimeout(
            f"{len(self._pending)} of {self.count} bottles were not made within {self.timeout:g}s"
        )

    def _abandon(self) -> None:
        """Destroy every bottle placed or being made, and remove every reservation."""
        making = []
        for slot, step in self._pending.values():
            if step is Step.CREATED:
                making.append(PlacedBottle(slot.host, Placement(slot.node_id, slot.name, "")))
            if slot.reservation is not None:
                remove_placement_group(slot.reservation)
        self._pending.clear()
        destroy_all([*self.placed.values(), *making])
        self._release_shared()

    def _release_shared(self) -> None:
        shared, self.shared = self.shared, None
        if shared is not None:
            remove_placement_group(shared)


def bottle_nodes() -> set[str]:
    """The live nodes that offer any ``bottle`` resource (Ray's node table)."""
    return {
        n["NodeID"]
        for n in ray.nodes()
        if n.get("Alive") and n.get("Resources", {}).get(BOTTLE_RESOURCE, 0) > 0
    }


def start_hosts(timeout: float = 120.0, *, wait: bool = True) -> int:
    """Start this process's host on every live node that offers bottles, so that the first
    pool waits for no Ray worker to start (else a node's host starts with the first bottle
    placed there); how many hosts there are. With ``wait`` (the default) it returns once
    each host and the owner answer; without, at once (call it right after ``ray.init``, and
    the hosts start while the trainer gets ready)."""
    owner = job_owner()
    hosts = hosts_of(owner).on(bottle_nodes())
    if wait:
        ray.get(
            [owner.ping.remote(), *(h.phases.remote() for h in hosts.values())], timeout=timeout
        )
    return len(hosts)


def destroy_all(bottles: Sequence[PlacedBottle], timeout: float = 120.0) -> None:
    """Destroy every bottle at once (one call per host), then free their own reservations (a
    host that died: its node reaps the bottles once their leases run out)."""
    by_host: dict[Any, list[str]] = {}
    for b in bottles:
        by_host.setdefault(b.host, []).append(b.name)
    refs = [host.destroy_many.remote(names) for host, names in by_host.items()]
    deadline = time.monotonic() + timeout
    pending = refs
    while pending:
        done, pending = ray.wait(
            pending, num_returns=len(pending), timeout=max(deadline - time.monotonic(), 0)
        )
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                pass  # its host died: the node reaps the bottles once their leases run out
        if not done:
            break
    for b in bottles:
        b.release()


def place(
    request: BottleRequest | None = None,
    *,
    max_attempts: int = 3,
    timeout: float = 300.0,
) -> PlacedBottle:
    """One bottle (its own reservation; destroy it when done)."""
    return Placer(request or BottleRequest(), 1, max_attempts, timeout).run()[0]
