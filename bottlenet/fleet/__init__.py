"""bottlenet[ray]: bottles placed across many hosts by Ray, for the trainer's side.

Each bottle is a detached Ray actor that asks for one ``bottle`` resource, creates its bottle
through its node's bottlenet daemon with a lease, keeps the lease while its owner lives, and
destroys the bottle when asked or when the owner goes away (``docs/fleet.md``). The daemon
itself never imports this package, nor Ray.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("bottlenet.fleet needs Ray: pip install 'bottlenet[ray]'") from e

from bottlenet.fleet.bottle import Bottle
from bottlenet.fleet.errors import BottleLost, PlacementFailed, PlacementTimeout, Refusal
from bottlenet.fleet.placement import place
from bottlenet.fleet.pool import BottlePool
from bottlenet.fleet.request import BottleRequest, ExecResult, Placement

__all__ = [
    "Bottle",
    "BottleLost",
    "BottlePool",
    "BottleRequest",
    "ExecResult",
    "Placement",
    "PlacementFailed",
    "PlacementTimeout",
    "Refusal",
    "place",
]
