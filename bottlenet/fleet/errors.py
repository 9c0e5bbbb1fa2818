"""The trainer side's typed errors: placement that could not be done, a bottle whose actor died.

They carry codes like the daemon's errors (:mod:`bottlenet.errors`) so a trainer handles every
failure by type, and their messages name nodes and codes, never anything a guest wrote.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from bottlenet.errors import BottlenetError


@attrs.frozen
class Refusal:
    """One node's answer to one create: which node, the daemon's code, its message."""

    node_id: str
    code: str
    message: str


class PlacementFailed(BottlenetError):
    """No node took the bottle within the attempt bound; ``refusals`` says who said what."""

    code = "PLACEMENT_FAILED"

    def __init__(self, message: str, refusals: Sequence[Refusal] = ()) -> None:
        super().__init__(message)
        self.refusals = tuple(refusals)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message, self.refusals))


class PlacementTimeout(PlacementFailed):
    """Ray found no node with a free ``bottle`` resource (and the labels) within the timeout."""

    code = "PLACEMENT_TIMEOUT"


class BottleLost(BottlenetError):
    """The bottle's actor is gone (its node, raylet or worker died, or it was killed); the
    node reaps the bottle itself once its lease and grace run out."""

    code = "BOTTLE_LOST"


def describe_refusals(refusals: Sequence[Refusal]) -> str:
    """``n1: DRAINING, n2: RESOURCE_EXHAUSTED`` (node ids shortened to 8 characters)."""
    return ", ".join(f"{r.node_id[:8]}: {r.code}" for r in refusals) or "none"
