"""Durable state: atomic, private, schema-checked; the journal survives torn writes."""

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
    assert stat.S_IMODE(os.stat(store.journal_path).st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["state.journal", "state.json"]
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


def _journal_lines(store: StateStore) -> list[bytes]:
    with open(store.journal_path, "rb") as f:
        return f.read().splitlines(keepends=True)


def _fresh(tmp_path, **kw) -> StateStore:  # type: ignore[no-untyped-def]
    store = StateStore(str(tmp_path), **kw)
    store.save(store.load())  # what the daemon does on its first start
    return store


def test_a_change_appends_one_line_and_leaves_the_snapshot_alone(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = _fresh(tmp_path)
    for i in range(50):
        store.put(f"b{i}", {"alias": f"127.77.0.{i + 2}"})
    snapshot = os.stat(store.path)
    before = len(_journal_lines(store))
    store.put("b7", {"alias": "127.77.1.1"})
    store.remove("b8")
    store.remove("never-existed")  # no-op, writes nothing
    assert len(_journal_lines(store)) == before + 2
    assert os.stat(store.path).st_ino == snapshot.st_ino  # snapshot not rewritten
    loaded = StateStore(str(tmp_path)).load()
    assert loaded.bottles["b7"] == {"alias": "127.77.1.1"}
    assert "b8" not in loaded.bottles and len(loaded.bottles) == 49


@pytest.mark.parametrize("cut", [1, 5, -1])
def test_torn_tail_is_dropped_and_cut_before_the_next_append(tmp_path, cut: int) -> None:  # type: ignore[no-untyped-def]
    store = _fresh(tmp_path)
    store.put("a", {"n": 1})
    store.put("b", {"n": 2})
    store.close()
    # A crash in the middle of appending b's line: only part of it reached the disk.
    lines = _journal_lines(store)
    last = lines[-1]
    torn = last[:cut] if cut > 0 else last[:-1] + b"x"  # partial, or garbled before the newline
    with open(store.journal_path, "wb") as f:
        f.write(b"".join(lines[:-1]) + torn)
    again = StateStore(str(tmp_path))
    assert again.load().bottles == {"a": {"n": 1}}  # b was never acknowledged
    again.put("c", {"n": 3})  # appends after the good part, not after the garbage
    assert StateStore(str(tmp_path)).load().bottles == {"a": {"n": 1}, "c": {"n": 3}}


def test_a_bad_line_before_good_ones_is_corruption(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = _fresh(tmp_path)
    store.put("a", {"n": 1})
    store.put("b", {"n": 2})
    store.close()
    lines = _journal_lines(store)
    lines[1] = lines[1].replace(b'"n":1', b'"n":7')  # CRC no longer matches
    with open(store.journal_path, "wb") as f:
        f.write(b"".join(lines))
    with pytest.raises(StateError, match="line 2 is corrupt"):
        StateStore(str(tmp_path)).load()


def test_compaction_keeps_everything_and_bounds_the_journal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = _fresh(tmp_path, compact_min_lines=16)
    expected: dict[str, dict[str, int]] = {}
    for i in range(200):
        name = f"b{i % 10}"
        if i % 7 == 3:
            store.remove(name)
            expected.pop(name, None)
        else:
            store.put(name, {"i": i})
            expected[name] = {"i": i}
        # header + at most the threshold (16 lines, or twice the live bottles, 10 at most)
        assert len(_journal_lines(store)) <= 1 + max(16, 2 * 10 + 1)
    assert StateStore(str(tmp_path)).load().bottles == expected
    with open(store.path) as f:
        assert json.load(f)["generation"] > 1  # it did compact


def test_crash_between_snapshot_and_new_journal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Compaction writes the snapshot first; a crash before the new journal leaves the old
    journal (an older generation), which must be ignored, not replayed over the snapshot."""
    store = _fresh(tmp_path)
    store.put("a", {"n": 1})
    store.put("b", {"n": 2})
    store.close()
    with open(store.journal_path, "rb") as f:
        old_journal = f.read()
    store.remove("a")
    store.save(State(store.load().instance_id, {"b": {"n": 2}}))
    with open(store.journal_path, "wb") as f:  # as if the new journal never made it
        f.write(old_journal)
    os.chmod(store.journal_path, 0o600)
    again = StateStore(str(tmp_path))
    assert again.load().bottles == {"b": {"n": 2}}  # not "a" again from the old journal
    again.put("c", {"n": 3})  # starts a journal of the current generation
    assert StateStore(str(tmp_path)).load().bottles == {"b": {"n": 2}, "c": {"n": 3}}


def test_a_failed_append_is_not_kept(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    store = _fresh(tmp_path)
    store.put("a", {"n": 1})

    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError):
        store.put("b", {"n": 2})
    monkeypatch.undo()
    store.put("c", {"n": 3})  # the unacknowledged line is cut off first
    assert StateStore(str(tmp_path)).load().bottles == {"a": {"n": 1}, "c": {"n": 3}}


def test_journal_is_private_and_not_followed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = _fresh(tmp_path)
    store.put("a", {"n": 1})
    store.close()
    os.chmod(store.journal_path, 0o644)
    with pytest.raises(StateError, match="too open"):
        StateStore(str(tmp_path)).load()
    os.chmod(store.journal_path, 0o600)
    os.rename(store.journal_path, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", store.journal_path)
    with pytest.raises(StateError):
        StateStore(str(tmp_path)).load()


_WRITER = """
import sys
from bottlenet.bottles.store import StateStore
store = StateStore(sys.argv[1], compact_min_lines=64)
store.save(store.load())
i = 0
while True:
    store.put(f"b{i % 40}", {"i": i})
    if i % 3 == 0:
        store.remove(f"b{(i + 20) % 40}")
    print(i, flush=True)  # acknowledged: both changes are durable
    i += 1
"""


def test_kill_9_mid_write_loses_nothing_acknowledged(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A real writer (appends and compactions) killed with SIGKILL at an arbitrary point: the
    state loads, and holds every acknowledged change and at most the one after it."""
    import signal
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=root),
    )
    assert proc.stdout is not None
    acked = -1
    for line in proc.stdout:
        acked = int(line)
        if acked >= 400:  # several compactions (every ~80 changes) have happened
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    for line in proc.stdout.read().split():  # acknowledged before the kill landed
        acked = int(line)
    bottles = StateStore(str(tmp_path)).load().bottles

    def model(upto: int) -> dict[str, dict[str, int]]:
        state: dict[str, dict[str, int]] = {}
        for i in range(upto + 1):
            state[f"b{i % 40}"] = {"i": i}
            if i % 3 == 0:
                state.pop(f"b{(i + 20) % 40}", None)
        return state

    # Either exactly the acknowledged changes, or those plus (part of) the next one.
    nxt = acked + 1
    partial = model(acked)
    partial[f"b{nxt % 40}"] = {"i": nxt}
    assert bottles in (model(acked), partial, model(nxt))
