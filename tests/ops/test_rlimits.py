"""raise_nofile: the real call in a subprocess (never on the test runner), policies on a fake."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import attrs
import pytest

from bottlenet.ops import rlimits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = """
import json, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from bottlenet.ops.rlimits import raise_nofile
old, new = raise_nofile()
print(json.dumps({"old": old, "new": new, "now": list(resource.getrlimit(resource.RLIMIT_NOFILE))}))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX rlimits")
def test_raises_soft_to_hard_in_a_subprocess() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    result = json.loads(out.stdout)
    soft, hard = result["now"]
    assert result["old"] == 64
    assert result["new"] == soft
    expected = hard if sys.platform != "darwin" else min(hard, rlimits.MACOS_OPEN_MAX)
    assert soft == expected > 64


@attrs.define
class FakeResource:
    """Just enough of the ``resource`` module; ``max_soft`` plays kern.maxfilesperproc."""

    soft: int
    hard: int
    max_soft: int | None = None
    RLIMIT_NOFILE: int = 7
    RLIM_INFINITY: int = -1
    calls: list[tuple[int, int]] = attrs.field(factory=list)

    def getrlimit(self, which: int) -> tuple[int, int]:
        assert which == self.RLIMIT_NOFILE
        return (self.soft, self.hard)

    def setrlimit(self, which: int, value: tuple[int, int]) -> None:
        self.calls.append(value)
        if self.max_soft is not None and value[0] > self.max_soft:
            raise ValueError("not allowed to raise maximum limit")
        self.soft = value[0]


def test_linux_soft_to_hard() -> None:
    res = FakeResource(1024, 524288)
    assert rlimits.raise_nofile(resource_module=res, platform="linux") == (1024, 524288)
    assert res.calls == [(524288, 524288)]


def test_already_at_hard_does_nothing() -> None:
    res = FakeResource(4096, 4096)
    assert rlimits.raise_nofile(resource_module=res, platform="linux") == (4096, 4096)
    assert res.calls == []


def test_macos_infinite_hard_caps_at_open_max() -> None:
    res = FakeResource(256, -1)
    assert rlimits.raise_nofile(resource_module=res, platform="darwin") == (256, 10240)
    assert res.calls == [(10240, -1)]


def test_macos_falls_back_when_maxfilesperproc_is_lower_than_hard() -> None:
    res = FakeResource(256, 24576, max_soft=10240)
    assert rlimits.raise_nofile(resource_module=res, platform="darwin") == (256, 10240)
    assert res.calls == [(24576, 24576), (10240, 24576)]


def test_refusal_is_reported_not_raised() -> None:
    res = FakeResource(256, 4096, max_soft=256)
    assert rlimits.raise_nofile(resource_module=res, platform="linux") == (256, 256)


def test_cap_for_select_reactor() -> None:
    res = FakeResource(256, 65536)
    assert rlimits.raise_nofile(1024, resource_module=res, platform="darwin") == (256, 1024)
    # ...and a cap never lowers a limit that is already higher.
    res = FakeResource(4096, 65536)
    assert rlimits.raise_nofile(1024, resource_module=res, platform="linux") == (4096, 4096)


def test_select_reactor_cap() -> None:
    from twisted.internet.selectreactor import SelectReactor
    from twisted.internet.testing import MemoryReactorClock

    assert rlimits.select_reactor_cap(SelectReactor.__new__(SelectReactor)) == rlimits.FD_SETSIZE
    assert rlimits.select_reactor_cap(MemoryReactorClock()) is None
