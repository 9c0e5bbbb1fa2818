"""Placing bottles: Ray chooses a node with a free ``bottle`` resource, the node's daemon may
refuse, and a refused bottle is tried again on another node, within a bound.

Each attempt is one detached :class:`~bottlenet.fleet.actor.BottleActor` asking for one
``bottle`` and no CPU; its constructor creates the bottle on its node. A refusal (draining,
full, daemon unreachable) kills that actor and starts another whose label selector excludes
every node that said no to this bottle (``ray.io/node-id`` not in them). Ray waits with an
actor no node can take, so a deadline bounds the whole placement. Nothing is half-made: when
one bottle of a batch fails, every bottle placed for the batch is destroyed before the error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from bottlenet.fleet.actor import BottleActor, OwnerAnchor
from bottlenet.fleet.bottle import Bottle
from bottlenet.fleet.errors import (
    PlacementFailed,
    PlacementTimeout,
    Refusal,
    describe_refusals,
)
from bottlenet.fleet.request import BOTTLE_RESOURCE, NODE_ID_LABEL, BottleRequest, Placement

#: Concurrent calls one bottle actor serves (execs, logs, status, destroy).
ACTOR_CONCURRENCY = 8
_RemoteBottle = ray.remote(BottleActor)
_RemoteAnchor = ray.remote(OwnerAnchor)
_anchors: dict[str, Any] = {}
_anchors_lock = threading.Lock()


def owner_anchor() -> Any:
    """This trainer's anchor actor (one per job, made on first use, on the trainer's node):
    it dies with the trainer, and the bottle actors take that as their owner going away."""
    context = ray.get_runtime_context()
    job = context.get_job_id()
    with _anchors_lock:
        anchor = _anchors.get(job)
        if anchor is None:
            strategy = NodeAffinitySchedulingStrategy(context.get_node_id(), soft=False)
            anchor = _RemoteAnchor.options(num_cpus=0, scheduling_strategy=strategy).remote()
            _anchors[job] = anchor
        return anchor


def actor_options(request: BottleRequest, excluded: Sequence[str]) -> dict[str, Any]:
    """Ray options of one attempt: one ``bottle``, no CPU, detached, never restarted."""
    selector = dict(request.label_selector)
    if excluded:
        selector[NODE_ID_LABEL] = f"!in({','.join(sorted(set(excluded)))})"
    options: dict[str, Any] = {
        "num_cpus": 0,
        "resources": {BOTTLE_RESOURCE: 1},
        "lifetime": "detached",
        "max_restarts": 0,
        "max_task_retries": 0,
        "max_concurrency": ACTOR_CONCURRENCY,
    }
    if selector:
        options["label_selector"] = selector
    return options


@attrs.define
class _Slot:
    """One bottle being placed: its attempts so far and the actor of the current one."""

    index: int
    refusals: list[Refusal] = attrs.field(factory=list)
    actor: Any = None
    name: str = ""


@attrs.define
class Placer:
    """Places ``count`` bottles of ``request``; ``progress(done)`` after each one is ready."""

    request: BottleRequest
    count: int
    max_attempts: int = 3
    timeout: float = 300.0
    progress: Callable[[int], None] = lambda done: None
    owner_label: str = ""
    placed: dict[int, Bottle] = attrs.field(factory=dict)
    #: every refusal on the way, those of bottles placed elsewhere afterwards too
    refusals: list[Refusal] = attrs.field(factory=list)
    _pending: dict[Any, _Slot] = attrs.field(factory=dict)

    def run(self) -> list[Bottle]:
        anchor = owner_anchor()
        self.owner_label = self.owner_label or f"ray-job-{ray.get_runtime_context().get_job_id()}"
        deadline = time.monotonic() + self.timeout
        try:
            for i in range(self.count):
                self._launch(_Slot(i), anchor)
            while self._pending:
                self._settle_one(deadline, anchor)
        except BaseException:
            self._abandon()
            raise
        return [self.placed[i] for i in range(self.count)]

    def _launch(self, slot: _Slot, anchor: Any) -> None:
        slot.name = self.request.new_name()
        options = actor_options(self.request, [r.node_id for r in slot.refusals])
        slot.actor = _RemoteBottle.options(**options).remote(
            self.request, slot.name, anchor, self.owner_label
        )
        self._pending[slot.actor.ready.remote()] = slot

    def _settle_one(self, deadline: float, anchor: Any) -> None:
        left = deadline - time.monotonic()
        done, _ = ray.wait(list(self._pending), num_returns=1, timeout=max(left, 0.0))
        if not done:
            raise PlacementTimeout(
                f"{len(self._pending)} of {self.count} bottles found no node with a free "
                f"'{BOTTLE_RESOURCE}' resource within {self.timeout:g}s"
            )
        slot = self._pending.pop(done[0])
        try:
            placement: Placement = ray.get(done[0])
        except RayActorError as e:
            refusal = Refusal("?", "ACTOR_DIED", type(e).__name__)
        else:
            if not placement.refused:
                self.placed[slot.index] = Bottle(slot.actor, placement)
                self.progress(len(self.placed))
                return
            assert placement.refusal_code is not None
            refusal = Refusal(
                placement.node_id, placement.refusal_code, placement.refusal_message or ""
            )
        ray.kill(slot.actor, no_restart=True)
        slot.refusals.append(refusal)
        self.refusals.append(refusal)
        refused_by = {r.node_id for r in slot.refusals}
        if len(slot.refusals) >= self.max_attempts or bottle_nodes() <= refused_by:
            raise PlacementFailed(
                f"bottle {slot.index} refused {len(slot.refusals)} times, by every node it "
                f"may use or up to the bound ({describe_refusals(slot.refusals)})",
                slot.refusals,
            )
        self._launch(slot, anchor)

    def _abandon(self) -> None:
        """Kill every pending attempt and destroy every bottle placed so far."""
        for slot in self._pending.values():
            ray.kill(slot.actor, no_restart=True)
        self._pending.clear()
        destroy_all(list(self.placed.values()))


def bottle_nodes() -> set[str]:
    """The live nodes that offer any ``bottle`` resource (Ray's node table)."""
    return {
        n["NodeID"]
        for n in ray.nodes()
        if n.get("Alive") and n.get("Resources", {}).get(BOTTLE_RESOURCE, 0) > 0
    }


def destroy_all(bottles: Sequence[Bottle], timeout: float = 120.0) -> None:
    """Destroy every bottle at once, then end every actor (a dead one is already done)."""
    refs = {b.actor.destroy.remote(): b for b in bottles}
    pending = list(refs)
    deadline = time.monotonic() + timeout
    while pending:
        done, pending = ray.wait(
            pending, num_returns=len(pending), timeout=deadline - time.monotonic()
        )
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                pass  # its actor died: the node reaps the bottle once its lease runs out
        if not done:
            break
    for b in bottles:
        ray.kill(b.actor, no_restart=True)


def place(
    request: BottleRequest | None = None,
    *,
    max_attempts: int = 3,
    timeout: float = 300.0,
) -> Bottle:
    """One bottle (as a one-bottle pool, without the context manager)."""
    return Placer(request or BottleRequest(), 1, max_attempts, timeout).run()[0]
