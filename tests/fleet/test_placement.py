"""The placer's answers that need no cluster (Ray is not even initialised here)."""

from __future__ import annotations

import pytest

from bottlenet.errors import InvalidArgument
from bottlenet.fleet import BottlePool, BottleRequest
from bottlenet.fleet.placement import Placer


def test_an_empty_pool_places_nothing_and_asks_ray_nothing() -> None:
    """No bottles: an empty list at once (Ray refuses a placement group without bundles)."""
    assert Placer(BottleRequest(), 0).run() == []
    with BottlePool(0, progress=False) as pool:
        assert len(pool) == 0


def test_a_negative_count_is_a_typed_error() -> None:
    """A pool of -1 bottles is INVALID_ARGUMENT, not Ray's ValueError."""
    with pytest.raises(InvalidArgument):
        Placer(BottleRequest(), -1).run()
