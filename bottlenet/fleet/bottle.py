"""The trainer's handle on one placed bottle: blocking calls on its actor, a dead actor as
:class:`~bottlenet.fleet.errors.BottleLost`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError

from bottlenet.control.records import BottleRecord
from bottlenet.fleet.errors import BottleLost
from bottlenet.fleet.request import ExecResult, Placement

T = TypeVar("T")


class Bottle:
    """One bottle and its actor. ``actor`` is the Ray handle for ``.remote()`` calls (many
    bottles at once: ``ray.get([b.actor.exec.remote(argv) for b in pool])``)."""

    def __init__(self, actor: Any, placement: Placement) -> None:
        self.actor = actor
        self.placement = placement

    @property
    def name(self) -> str:
        return self.placement.name

    @property
    def node_id(self) -> str:
        return self.placement.node_id

    def __repr__(self) -> str:
        return f"<Bottle {self.name} on {self.placement.hostname} {self.node_id[:8]}>"

    def _get(self, ref: Any, timeout: float | None) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except RayActorError as e:
            raise BottleLost(
                f"the actor of bottle {self.name} on node {self.node_id[:8]} died"
                f" ({type(e).__name__})"
            ) from None

    def exec(
        self, argv: Sequence[str], *, timeout: float | None = None, **options: Any
    ) -> ExecResult:
        """Run ``argv`` in the bottle (``stdin``, ``env``, ``user``, ``workdir``,
        ``time_limit``: as :meth:`BottleActor.exec`)."""
        result: ExecResult = self._get(self.actor.exec.remote(list(argv), **options), timeout)
        return result

    def logs(self, tail: int | None = None, *, timeout: float | None = None) -> bytes:
        data: bytes = self._get(self.actor.logs.remote(tail), timeout)
        return data

    def status(self, *, timeout: float | None = None) -> BottleRecord:
        record: BottleRecord = self._get(self.actor.status.remote(), timeout)
        return record

    def destroy(self, *, timeout: float | None = None) -> None:
        """Destroy the bottle and end its actor (a lost actor: nothing left to do here)."""
        try:
            self._get(self.actor.destroy.remote(), timeout)
        except BottleLost:
            pass
        ray.kill(self.actor, no_restart=True)
