"""The trainer's handle on one placed bottle: blocking calls through its node's host, a lost host
or bottle as :class:`~bottlenet.fleet.errors.BottleLost`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, remove_placement_group

from bottlenet.control.records import BottleRecord
from bottlenet.fleet.errors import BottleLost
from bottlenet.fleet.request import ExecResult, Placement


class PlacedBottle:
    """One bottle, its node's host (``host``, a Ray actor handle shared by the owner's bottles
    on that node) and, for a bottle placed alone, its own ``bottle`` reservation (a Ray
    placement group, removed when it is destroyed; a pool's bottles share the pool's).

    The ``*_ref`` methods return Ray ObjectRefs, for calls on many bottles at once:
    ``ray.get([b.exec_ref(argv) for b in pool])``.
    """

    def __init__(
        self, host: Any, placement: Placement, reservation: PlacementGroup | None = None
    ) -> None:
        self.host = host
        self.placement = placement
        self.reservation = reservation

    @property
    def name(self) -> str:
        return self.placement.name

    @property
    def node_id(self) -> str:
        return self.placement.node_id

    def __repr__(self) -> str:
        return f"<PlacedBottle {self.name} on {self.placement.hostname} {self.node_id[:8]}>"

    def _get(self, ref: Any, timeout: float | None) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except RayActorError as e:
            raise BottleLost(
                f"the host of bottle {self.name} on node {self.node_id[:8]} died"
                f" ({type(e).__name__})"
            ) from None

    def exec_ref(self, argv: Sequence[str], **options: Any) -> Any:
        """The exec as an ObjectRef of an :class:`ExecResult` (options as :meth:`exec`)."""
        return self.host.exec.remote(self.name, list(argv), **options)

    def status_ref(self) -> Any:
        """The daemon's record as an ObjectRef of a :class:`BottleRecord`."""
        return self.host.status.remote(self.name)

    def exec(
        self, argv: Sequence[str], *, timeout: float | None = None, **options: Any
    ) -> ExecResult:
        """Run ``argv`` in the bottle (``stdin``, ``env``, ``user``, ``workdir``,
        ``time_limit``: as :meth:`NodeHost.exec <bottlenet.fleet.host.NodeHost.exec>`)."""
        result: ExecResult = self._get(self.exec_ref(argv, **options), timeout)
        return result

    def logs(self, tail: int | None = None, *, timeout: float | None = None) -> bytes:
        data: bytes = self._get(self.host.logs.remote(self.name, tail), timeout)
        return data

    def status(self, *, timeout: float | None = None) -> BottleRecord:
        record: BottleRecord = self._get(self.status_ref(), timeout)
        return record

    def destroy(self, *, timeout: float | None = None) -> None:
        """Destroy the bottle (a lost one: nothing left to do here) and free its own
        reservation."""
        try:
            self._get(self.host.destroy.remote(self.name), timeout)
        except BottleLost:
            pass
        finally:
            self.release()

    def release(self) -> None:
        """Free the bottle's own reservation, if it has one (once)."""
        reservation, self.reservation = self.reservation, None
        if reservation is not None:
            remove_placement_group(reservation)
