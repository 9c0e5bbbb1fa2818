"""State store rules no test pinned before (mutants S05b, S07, S08, S13, S14 of ``tests-2.md``).

The files must be ours and private (owner and group bits, not only "other"), a short write to
the journal is an error and loses nothing acknowledged, and compaction writes the snapshot
before the journal that continues it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bottlenet.bottles import store as store_mod
from bottlenet.bottles.store import JOURNAL_FILE, STATE_FILE, State, StateError, StateStore


def fresh(tmp_path: Path) -> StateStore:
    d = tmp_path / "s"
    d.mkdir(mode=0o700)
    s = StateStore(str(d))
    s.save(s.load())
    s.put("a", {"x": 1})  # a journal with one change next to the snapshot
    return s


@pytest.mark.parametrize("name", [STATE_FILE, JOURNAL_FILE])
@pytest.mark.parametrize("mode", [0o640, 0o620, 0o660])
def test_group_bits_on_a_state_file_are_refused(tmp_path: Path, name: str, mode: int) -> None:
    """S08: group-readable or group-writable state is someone else's to change."""
    s = fresh(tmp_path)
    os.chmod(os.path.join(s.state_dir, name), mode)
    with pytest.raises(StateError, match="too open"):
        StateStore(s.state_dir).load()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
@pytest.mark.parametrize("name", [STATE_FILE, JOURNAL_FILE])
def test_a_state_file_owned_by_another_uid_is_refused(tmp_path: Path, name: str) -> None:
    """S07: a 0600 file of another uid (that uid wrote it) is not ours."""
    s = fresh(tmp_path)
    os.chown(os.path.join(s.state_dir, name), 65534, 65534)
    with pytest.raises(StateError, match="owned by this user"):
        StateStore(s.state_dir).load()


def test_a_short_journal_write_is_an_error_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S14: half a line written is ENOSPC-like; the records before and after it survive."""
    s = fresh(tmp_path)
    real = os.write

    def short(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(JOURNAL_FILE):
            return real(fd, data[: len(data) // 2])
        return real(fd, data)

    monkeypatch.setattr(store_mod.os, "write", short)
    with pytest.raises(OSError) as info:
        s.put("b", {"y": 2})
    assert info.value.errno == 28
    monkeypatch.undo()
    s.put("c", {"z": 3})
    assert StateStore(s.state_dir).load().bottles == {"a": {"x": 1}, "c": {"z": 3}}


def test_a_failed_snapshot_write_during_compaction_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S13: the snapshot is replaced before the journal; when that fails the old pair holds."""
    s = fresh(tmp_path)
    real = os.replace

    def failing(src: str, dst: str) -> None:
        if dst.endswith(STATE_FILE):
            raise OSError(5, "I/O error writing the snapshot")
        real(src, dst)

    monkeypatch.setattr(store_mod.os, "replace", failing)
    with pytest.raises(OSError):
        s.save(State(s.load().instance_id, {"a": {"x": 1}, "b": {"y": 2}}))
    monkeypatch.undo()
    assert StateStore(s.state_dir).load().bottles == {"a": {"x": 1}}
    assert sorted(os.listdir(s.state_dir)) == [JOURNAL_FILE, STATE_FILE]


def test_a_journal_of_another_instance_is_refused(tmp_path: Path) -> None:
    """S05b: a's journal next to b's snapshot (same generation) is not replayed over it."""
    import shutil

    a = fresh(tmp_path)
    b_dir = tmp_path / "b"
    b_dir.mkdir(mode=0o700)
    b = StateStore(str(b_dir))
    b.save(b.load())  # another instance, the same generation as a's
    shutil.copy(b_dir / STATE_FILE, os.path.join(a.state_dir, STATE_FILE))
    with pytest.raises(StateError, match="not a journal of this state"):
        StateStore(a.state_dir).load()
