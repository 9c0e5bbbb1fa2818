"""bottlenet[ray]: bottles placed across many hosts by Ray, for the trainer's side.

Ray reserves one ``bottle`` resource per bottle (placement groups: no process); one host
actor per trainer process and node creates the bottles there through its node's bottlenet
daemon with a lease, keeps the leases while the trainer lives, and destroys the bottles when
asked or when the trainer goes away (``docs/fleet.md``). The daemon itself never imports this
package, nor Ray.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("bottlenet.fleet needs Ray: pip install 'bottlenet[ray]'") from e

from bottlenet.fleet.errors import BottleLost, PlacementFailed, PlacementTimeout, Refusal
from bottlenet.fleet.placed import PlacedBottle
from bottlenet.fleet.placement import place, start_hosts
from bottlenet.fleet.pool import BottlePool
from bottlenet.fleet.request import BottleRequest, ExecResult, Placement, Strategy

__all__ = [
    "BottleLost",
    "BottlePool",
    "BottleRequest",
    "ExecResult",
    "PlacedBottle",
    "Placement",
    "PlacementFailed",
    "PlacementTimeout",
    "Refusal",
    "Strategy",
    "place",
    "start_hosts",
]
