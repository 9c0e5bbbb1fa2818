"""The fleet tiers need Ray (the ``ray`` extra, which ``dev`` does not pull: docs/fleet.md)."""

from __future__ import annotations

import os

import pytest

# Ray sends usage statistics off the machine unless told not to; nothing may leave it.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

pytest.importorskip(
    "ray", reason="Ray is not installed: the fleet tiers need pip install '.[ray]' (docs/fleet.md)"
)
