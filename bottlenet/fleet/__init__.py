"""bottlenet[ray]: bottles placed across many hosts by Ray, for the trainer's side.

Ray reserves one ``bottle`` resource per bottle (placement groups: no process); one host
actor per trainer process and node creates the bottles there through its node's bottlenet
daemon with a lease, keeps the leases while the trainer lives, and destroys the bottles when
asked or when the trainer goes away (``docs/fleet.md``). The daemon itself never imports this
package, nor Ray.

- :mod:`~bottlenet.fleet.request`: the values that cross between the trainer and a host actor.
- :mod:`~bottlenet.fleet.placement`: ``place``, with retries on another node after a refusal.
- :mod:`~bottlenet.fleet.pool`: ``BottlePool``, N bottles of one request destroyed together.
- :mod:`~bottlenet.fleet.placed`: the trainer's handle on one placed bottle.
- :mod:`~bottlenet.fleet.owner`: the owner actor, alive as long as the placing process.
- :mod:`~bottlenet.fleet.hosts`: the placing process's host on each node, started by it.
- :mod:`~bottlenet.fleet.host`: one host actor per owner and node, which keeps its bottles.
- :mod:`~bottlenet.fleet.renewal`: a host's leases kept while the trainer lives.
- :mod:`~bottlenet.fleet.raystart`: ``ray start`` arguments from this node's daemon.
- :mod:`~bottlenet.fleet.errors`: the trainer side's typed errors.

The names below are imported on first use: a Ray worker that unpickles the owner imports
that module only (a few milliseconds), not the placer, the hosts' control client and the
pool's progress bar (about 0.15 s here).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

try:
    import ray  # noqa: F401
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("bottlenet.fleet needs Ray: pip install 'bottlenet[ray]'") from e

if TYPE_CHECKING:
    from bottlenet.fleet.errors import BottleLost, PlacementFailed, PlacementTimeout, Refusal
    from bottlenet.fleet.placed import PlacedBottle
    from bottlenet.fleet.placement import place, start_hosts
    from bottlenet.fleet.pool import BottlePool
    from bottlenet.fleet.request import BottleRequest, ExecResult, Placement, Strategy

_WHERE = {
    "BottleLost": "errors",
    "PlacementFailed": "errors",
    "PlacementTimeout": "errors",
    "Refusal": "errors",
    "PlacedBottle": "placed",
    "place": "placement",
    "start_hosts": "placement",
    "BottlePool": "pool",
    "BottleRequest": "request",
    "ExecResult": "request",
    "Placement": "request",
    "Strategy": "request",
}
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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
