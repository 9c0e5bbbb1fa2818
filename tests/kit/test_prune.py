"""Old guest kits are removed at the daemon's start, but those still in use (issue 36 follow-up).

A kit is keyed by its inputs, so each upgrade of the interpreter or of bottlenet left one more
under ``<state-dir>/kit/``. At start, off the reactor, the keeper removes every kit of another
key that no live bottle of the daemon mounts and no other daemon sharing the cache uses (each
daemon holds a shared lock on ``<key>.use`` of the kits it uses).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from twisted.internet.defer import Deferred, maybeDeferred

from bottlenet.bottles.store import State
from bottlenet.kit.build import Kit, KitCache, remove
from bottlenet.kit.keeper import KitKeeper, KitState
from bottlenet.tap import mounted_kits


def _now(f: object) -> Deferred[object]:
    return maybeDeferred(f)  # type: ignore[arg-type]


def fake_kit(cache_dir: str, key: str, digest: str) -> str:
    """An old kit as the cache keeps one: its directory and its recorded digest."""
    root = os.path.join(cache_dir, key)
    os.makedirs(os.path.join(root, "app"))
    with open(os.path.join(root, "app", "main.pyc"), "wb") as fh:
        fh.write(b"old")
    with open(root + ".digest", "w") as fh:
        fh.write(digest + "\n")
    return root


@pytest.fixture
def cache_dir(built_kit: tuple[KitCache, Kit]) -> Iterator[str]:
    """The session's kit cache, with old kits added (removed again after the test)."""
    cache, _ = built_kit
    before = set(os.listdir(cache.dir))
    yield cache.dir
    for name in set(os.listdir(cache.dir)) - before:
        path = os.path.join(cache.dir, name)
        if os.path.isdir(path):
            remove(path)
        else:
            os.unlink(path)


def test_the_start_removes_old_kits_but_the_mounted_and_the_used(
    built_kit: tuple[KitCache, Kit], cache_dir: str
) -> None:
    """Of three old kits, the one a live bottle mounts and the one another daemon uses stay;
    the third (and a build that died) is removed; today's kit is ready and kept."""
    _, kit = built_kit
    mounted = fake_kit(cache_dir, "b" * 16, "b" * 64)
    unused = fake_kit(cache_dir, "c" * 16, "c" * 64)
    theirs = fake_kit(cache_dir, "d" * 16, "d" * 64)
    os.makedirs(os.path.join(cache_dir, ".build-dead", "x"))
    other = KitCache(os.path.dirname(cache_dir))  # another daemon sharing the cache
    other._hold("d" * 16)
    keeper = KitKeeper(
        None, KitCache(os.path.dirname(cache_dir)), run=_now, mounted=lambda: {"b" * 64}
    )
    try:
        keeper.startService()
        assert keeper.state is KitState.READY and keeper.kit is not None
        assert keeper.kit.key == kit.key and os.path.isdir(kit.root)
        assert os.path.isdir(mounted) and os.path.isdir(theirs)
        assert not os.path.lexists(unused) and not os.path.lexists(unused + ".digest")
        assert not os.path.lexists(os.path.join(cache_dir, ".build-dead"))
        # the keeper now holds the mounted kit too: another daemon's prune leaves it
        assert other.prune() == []
        assert os.path.isdir(mounted)
    finally:
        keeper.stopService()
        other.release()
    # once nobody holds them, the next start removes them
    again = KitCache(os.path.dirname(cache_dir))
    try:
        assert sorted(again.prune()) == ["b" * 16, "d" * 16]
        assert os.path.isdir(kit.root)
    finally:
        again.release()


def test_the_state_names_the_kits_its_bottles_mount() -> None:
    """``mounted_kits``: each VM bottle record's kit digest; forward-only ones have none."""
    state = State(
        "i",
        {
            "vm": {"kind": "vm", "kit": {"digest": "e" * 64, "loader": "lib/ld.so"}},
            "old": {"kind": "vm"},
            "fwd": {"kind": "forward"},
        },
    )
    assert mounted_kits(state) == frozenset({"e" * 64})
