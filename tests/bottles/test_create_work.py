"""The work of a create does not grow with the bottles that exist (counted, not timed).

Issue 29: the bottle cap's "others creating" check asked every bottle's machine for its
lifecycle on every create, so ``CreateBottle`` cost time in proportion to the bottles. Here
the work is counted with a profiler hook: the Python calls a create makes, and how many of
them run in automat (a bottle machine's input). Creating the 1,001st bottle makes exactly as
many machine calls as creating the 11th, and no more Python calls.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest
from twisted.internet.task import Clock

from bottlenet.bottles.registry import BottleRegistry
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import AliasPool
from bottlenet.forward.table import ForwardTable

AUTOMAT = os.path.dirname(__import__("automat").__file__)


class Counter:
    """Python calls made while it is on, and those of them inside automat."""

    def __init__(self) -> None:
        self.calls = 0
        self.machine_calls = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            self.calls += 1
            if frame.f_code.co_filename.startswith(AUTOMAT):
                self.machine_calls += 1


@pytest.fixture
def registry(tmp: str) -> Iterator[tuple[BottleRegistry, Clock]]:
    """A registry without a state file (a store's compaction would add work at one create)."""
    clock = Clock()
    aliases = AliasRegistry(AliasPool.parse("127.80.0.0/16"))
    table = ForwardTable(clock, aliases, state_dir=tmp, engine="portable")
    yield BottleRegistry(clock, table, aliases, state_dir=tmp, max_bottles=2000), clock


def create_counted(registry: BottleRegistry, name: str) -> Counter:
    """Create forward-only bottle ``name`` (it completes at once) and count its work."""
    counter = Counter()
    sys.setprofile(counter)
    try:
        coro = registry.create_bottle(name)
        try:
            coro.send(None)
        except StopIteration:
            pass
        else:
            raise AssertionError("a forward-only create waited on something")
    finally:
        sys.setprofile(None)
    assert registry.has_bottle(name)
    return counter


def test_the_1001st_create_touches_no_other_bottle(
    registry: tuple[BottleRegistry, Clock],
) -> None:
    """The 1,001st create makes as many machine calls as the 11th, and no more calls."""
    reg, _ = registry
    for i in range(10):
        create_counted(reg, f"a{i:04d}")
    eleventh = create_counted(reg, "x0011")
    for i in range(11, 1000):
        create_counted(reg, f"a{i:04d}")
    thousand_first = create_counted(reg, "x1001")
    assert thousand_first.machine_calls == eleventh.machine_calls
    assert thousand_first.calls <= eleventh.calls
