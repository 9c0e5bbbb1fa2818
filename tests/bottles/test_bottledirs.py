"""A bottle's directory is hostile ground under per-VM uids (security-3 R3): whatever the
sidecar VMM uid leaves in ``sidecar/`` goes at teardown, never fails a teardown, a recovery
or a daemon's start, and a leftover never blocks the name at the next create."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred, fail, maybeDeferred

from bottlenet.bottles import bottledirs
from bottlenet.bottles.bottle import VMBottle
from bottlenet.bottles.bottledirs import TRASH_PREFIX, remove_bottle_dir
from tests.bottles.memsmolvm import Rig
from tests.bottles.test_rollback import spec
from tests.test_remove_tree import _nest


def _bottles(state: str) -> list[str]:
    return sorted(os.listdir(os.path.join(state, "bottles")))


def test_a_planted_file_goes_with_the_directory(tmp_path: Path) -> None:
    """R3 'file': a file in ``sidecar/`` no longer keeps the directory (and the name)."""
    sidecar = tmp_path / "bottles" / "s1" / "sidecar"
    sidecar.mkdir(parents=True)
    (sidecar / "notes.txt").write_text("x")
    assert remove_bottle_dir(str(tmp_path), "s1")
    assert _bottles(str(tmp_path)) == []


def test_what_one_attempt_cannot_remove_is_moved_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the entry bound: the name is free at once, the rest waits in ``.trash-*``."""
    sidecar = tmp_path / "bottles" / "s1" / "sidecar"
    sidecar.mkdir(parents=True)
    for i in range(30):
        (sidecar / f"f{i}").write_text("")
    monkeypatch.setattr(bottledirs, "remove_tree_at", _bounded(10))
    assert remove_bottle_dir(str(tmp_path), "s1")
    (aside,) = _bottles(str(tmp_path))
    assert aside.startswith(TRASH_PREFIX)
    monkeypatch.undo()
    assert remove_bottle_dir(str(tmp_path), aside)
    assert _bottles(str(tmp_path)) == []


def _bounded(n: int) -> Callable[[int, str], None]:
    from bottlenet.paths import remove_tree_at

    return lambda fd, name: remove_tree_at(fd, name, max_entries=n)


def test_a_removal_that_fails_outright_never_raises(tmp_path: Path) -> None:
    """No ``bottles/`` directory to open (a file there): False, logged, no exception."""
    (tmp_path / "bottles").write_text("not a directory")
    assert remove_bottle_dir(str(tmp_path), "s1") is False


def test_create_clears_a_leftover_directory_of_a_bottle_that_is_gone(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """R3: ``bottles/rb`` left behind (a file in its ``sidecar/``): the create clears it
    instead of failing ``File exists``."""
    rig = rigs()
    sidecar = os.path.join(rig.state_dir, "bottles", "rb", "sidecar")
    os.makedirs(sidecar)
    Path(sidecar, "notes.txt").write_text("x")
    rig.run(rig.registry.create_bottle("rb", spec=spec(tmp)))
    assert os.listdir(sidecar) == []
    assert [b.name for b in rig.registry.list_bottles()] == ["rb"]


def test_destroy_removes_a_sidecar_tree_deeper_than_path_max(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """R3 'deep': 600 nested directories in ``sidecar/``: the destroy succeeds, nothing left."""
    rig = rigs()
    rig.run(rig.registry.create_bottle("rb", spec=spec(tmp)))
    _nest(Path(rig.state_dir, "bottles", "rb", "sidecar"), 600)
    rig.run(rig.registry.destroy_bottle("rb"))
    assert rig.registry.list_bottles() == []
    assert _bottles(rig.state_dir) == []


def test_recovery_tears_down_a_degraded_bottle_whose_tree_is_deep(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """R3 'deep' at restart: a degraded bottle with the deep tree is torn down and the start
    goes on (it used to exit 1 in recovery, at every start)."""
    first = rigs()
    first.run(first.registry.create_bottle("rb", spec=spec(tmp)))
    first.run(first.registry.owner("rb", VMBottle).degrade("test"))
    assert first.state()["rb"]["state"] == "degraded"
    _nest(Path(first.state_dir, "bottles", "rb", "sidecar"), 600)
    first.close()
    rig = rigs(smolvm=first.smolvm)
    rig.recover()
    assert rig.registry.list_bottles() == []
    assert _bottles(rig.state_dir) == []


def test_an_oserror_from_one_bottles_teardown_never_stops_recovery(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """R3: whatever a teardown at recovery raises from the filesystem, that bottle is kept as
    degraded and the others are restored: the daemon's start goes on."""
    first = rigs()
    for name in ("ra", "rb"):
        first.run(first.registry.create_bottle(name, spec=spec(tmp, name)))
    first.run(first.registry.owner("ra", VMBottle).degrade("test"))
    first.close()
    rig = rigs(smolvm=first.smolvm)

    def failing_release(fn: Callable[..., Any], *args: Any) -> Deferred[Any]:
        if fn is remove_bottle_dir:  # the teardown's release of the bottle's directory
            return fail(OSError(36, "File name too long"))
        return maybeDeferred(fn, *args)

    rig.use(blocking=failing_release)
    rig.recover()
    assert {b.name: b.state for b in rig.registry.list_bottles()} == {
        "ra": "degraded",
        "rb": "ready",
    }
    assert not rig.registry.recovering
