"""Durable state: atomic, private, schema-checked."""

from __future__ import annotations

import json
import os
import stat

import pytest

from bottlenet.bottles.store import SCHEMA_VERSION, State, StateError, StateStore


def test_fresh_state_has_an_instance_id(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = StateStore(str(tmp_path))
    a = store.load()
    b = StateStore(str(tmp_path)).load()
    assert a.instance_id.isalnum() and a.bottles == {}
    assert a.instance_id != b.instance_id  # nothing saved yet: each load starts fresh


def test_round_trip_mode_0600_and_no_temp_left(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = StateStore(str(tmp_path))
    state = State("abc123", {"demo": {"alias": "127.77.0.2", "forwards": {"web": 43001}}})
    store.save(state)
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["state.json"]
    loaded = store.load()
    assert loaded == state
    with open(store.path) as f:
        assert json.load(f)["schema"] == SCHEMA_VERSION


def test_save_replaces_atomically(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = StateStore(str(tmp_path))
    store.save(State("id1", {"a": {}}))
    inode = os.stat(store.path).st_ino
    store.save(State("id1", {"b": {}}))
    assert os.stat(store.path).st_ino != inode  # a new file renamed over, not rewritten in place
    assert set(store.load().bottles) == {"b"}


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[]",
        b'{"schema": 99}',
        b'{"schema": 1, "instance_id": "x y", "bottles": {}}',
        b'{"schema": 1, "instance_id": "x", "bottles": []}',
        b"\xff",
    ],
)
def test_corrupt_state_is_refused(tmp_path, content: bytes) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "state.json"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(StateError):
        StateStore(str(tmp_path)).load()


def test_open_mode_and_symlink_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = StateStore(str(tmp_path))
    store.save(State("id1"))
    os.chmod(store.path, 0o644)
    with pytest.raises(StateError, match="too open"):
        store.load()
    os.chmod(store.path, 0o600)
    os.rename(store.path, tmp_path / "real.json")
    os.symlink(tmp_path / "real.json", store.path)
    with pytest.raises(StateError):
        store.load()
