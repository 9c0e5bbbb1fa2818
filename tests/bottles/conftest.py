"""Fixtures for the bottles layer's unit seam (``tests/bottles/memsmolvm.py``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.bottles.memsmolvm import Rig


@pytest.fixture
def tmp() -> Iterator[str]:
    """A short private directory (socket-mode endpoints live under it; sun_path is small)."""
    path = tempfile.mkdtemp(prefix="bnu-", dir="/tmp")
    yield path
    shutil.rmtree(path, True)


@pytest.fixture
def rigs(tmp: str) -> Iterator[Callable[..., Rig]]:
    """``rigs(**kw)``: a new Rig on ``tmp/s`` (a second call is the daemon restarted)."""
    made: list[Rig] = []

    def make(**kw: Any) -> Rig:
        rig = Rig(os.path.join(tmp, "s"), **kw)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()
