"""Shared test settings: a deterministic Hypothesis profile for CI (see docs/twisted-guide §6),
and the fixtures several test packages use."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from tests.netio import echo_server as _echo_server

#: No packet leaves the machine while the suite runs (see tests/netguard.py).
pytest_plugins = ["tests.netguard"]

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def echo_server() -> Iterator[int]:
    """The port of a threaded echo server on 127.0.0.1 (a stand-in for a sidecar's raw port)."""
    with _echo_server() as port:
        yield port
