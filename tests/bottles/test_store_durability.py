"""The state on disk matches what clients were told (security T5b, T6, T14)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from bottlenet.bottles.store import State, StateError, StateStore


def _fresh(tmp_path: Path) -> StateStore:
    store = StateStore(str(tmp_path))
    store.save(store.load())  # what the daemon does at its first start
    return store


def _with_a_bottle(tmp_path: Path) -> StateStore:
    store = _fresh(tmp_path)
    store.put("vm1", {"n": 1})
    store.close()
    return store


def test_t6_missing_journal_is_refused(tmp_path: Path) -> None:
    """T6: a deleted journal is damage, refused with one line, never read as "no bottles"."""
    store = _with_a_bottle(tmp_path)
    os.unlink(store.journal_path)
    with pytest.raises(StateError, match=r"state\.journal: missing"):
        StateStore(str(tmp_path)).load()


def test_t6_empty_journal_is_refused(tmp_path: Path) -> None:
    """T6: an emptied journal (its header is written atomically, so no crash empties it)."""
    store = _with_a_bottle(tmp_path)
    os.truncate(store.journal_path, 0)
    with pytest.raises(StateError, match=r"state\.journal: empty"):
        StateStore(str(tmp_path)).load()


def test_t6_a_complete_last_line_that_fails_its_check_is_corruption(tmp_path: Path) -> None:
    """T6: a torn append never ends in a newline; a complete bad last line is damage."""
    store = _with_a_bottle(tmp_path)
    raw = Path(store.journal_path).read_bytes()
    flipped = raw[:-3] + bytes([raw[-3] ^ 0x01]) + raw[-2:]
    Path(store.journal_path).write_bytes(flipped)
    with pytest.raises(StateError, match="line 2 is corrupt"):
        StateStore(str(tmp_path)).load()


def test_t6_a_fifo_at_the_journal_is_refused_without_blocking(tmp_path: Path) -> None:
    """T6: a FIFO at the journal path is refused at once (it hung the daemon's start)."""
    store = _with_a_bottle(tmp_path)
    os.unlink(store.journal_path)
    os.mkfifo(store.journal_path, 0o600)
    out: list[BaseException] = []

    def load() -> None:
        try:
            StateStore(str(tmp_path)).load()
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(timeout=10)
    if t.is_alive():
        os.close(os.open(store.journal_path, os.O_WRONLY | os.O_NONBLOCK))
        t.join()
        pytest.fail("load() blocked in open() on a FIFO")
    assert len(out) == 1 and isinstance(out[0], StateError)


def test_first_save_writes_the_journal_before_the_snapshot(tmp_path: Path) -> None:
    """A first save cut short leaves a header-only journal and no snapshot: a fresh start;
    a journal with changes and no snapshot is a deleted snapshot: refused."""
    store = _with_a_bottle(tmp_path)
    header_only = Path(store.journal_path).read_bytes().split(b"\n")[0] + b"\n"
    os.unlink(store.path)
    with pytest.raises(StateError, match=r"state\.json: missing"):
        StateStore(str(tmp_path)).load()
    Path(store.journal_path).write_bytes(header_only)
    again = StateStore(str(tmp_path))
    state = again.load()
    assert state.bottles == {}
    again.save(state)  # the daemon's first save, over the stale header
    again.put("a", {"n": 1})
    assert StateStore(str(tmp_path)).load().bottles == {"a": {"n": 1}}


def test_a_first_save_cut_after_its_first_file_is_a_fresh_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order itself (tests-3 D06): a crash right after a new state dir's first file is
    written leaves what the next start reads as fresh, never a snapshot without a journal."""
    real = StateStore._write_atomically
    written: list[str] = []

    def crash_after_the_first(self: StateStore, path: str, data: bytes) -> None:
        if written:
            raise OSError(5, "the daemon died here")
        written.append(os.path.basename(path))
        real(self, path, data)

    store = StateStore(str(tmp_path))
    state = store.load()
    monkeypatch.setattr(StateStore, "_write_atomically", crash_after_the_first)
    with pytest.raises(OSError, match="died here"):
        store.save(state)
    monkeypatch.undo()
    assert written == ["state.journal"]
    assert StateStore(str(tmp_path)).load().bottles == {}


def test_a_snapshot_from_before_the_journal_still_loads(tmp_path: Path) -> None:
    """Generation 0 (files written before the journal existed) needs no journal."""
    store = StateStore(str(tmp_path))
    state = store.load()
    store.save(State(state.instance_id, {"a": {"n": 1}}))
    doc = Path(store.path).read_text().replace('"generation": 1', '"generation": 0')
    Path(store.path).write_text(doc)
    os.unlink(store.journal_path)
    assert StateStore(str(tmp_path)).load().bottles == {"a": {"n": 1}}


def test_t5b_a_failed_compaction_does_not_fail_a_durable_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """T5b: the change is appended and fsynced before compaction: a compaction that fails
    must not answer UNAVAILABLE for it (the caller rolled back what the next start restored)."""
    store = StateStore(str(tmp_path), compact_min_lines=4)
    store.save(store.load())
    for i in range(3):
        store.put("a", {"n": i})
    real_replace = os.replace

    def eio(src: str, dst: str) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", eio)
    store.put("a", {"n": 3})  # the 4th line: compaction runs and fails, the put stands
    monkeypatch.setattr(os, "replace", real_replace)
    assert StateStore(str(tmp_path)).load().bottles == {"a": {"n": 3}}
    store.put("a", {"n": 4})  # the compaction is tried again and now succeeds
    assert len(Path(store.journal_path).read_bytes().splitlines()) == 1  # the header alone
    assert StateStore(str(tmp_path)).load().bottles == {"a": {"n": 4}}


def test_t5b_a_change_that_failed_its_fsync_does_not_come_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """T5b: a change answered "failed" is cut off the journal at once, not only before the
    next append: a restart in between must not restore it."""
    store = _with_a_bottle(tmp_path)

    def eio(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(OSError):
        store.put("ghost", {"n": 9})
    monkeypatch.undo()
    assert StateStore(str(tmp_path)).load().bottles == {"vm1": {"n": 1}}


def test_t14_compaction_temp_files_are_removed_at_start(tmp_path: Path) -> None:
    """T14: a kill -9 during compaction leaves a temp file; the next load removes it (and
    leaves other names and non-regular files alone)."""
    _with_a_bottle(tmp_path)
    left = [tmp_path / "state.json.tmp-123-abcd", tmp_path / "state.journal.tmp-123-ef01"]
    for p in left:
        p.write_bytes(b"{}")
    other = tmp_path / "state.json.bak"
    other.write_bytes(b"keep")
    (tmp_path / "state.json.tmp-link").symlink_to(other)
    assert StateStore(str(tmp_path)).load().bottles == {"vm1": {"n": 1}}
    assert not any(p.exists() for p in left)
    assert other.read_bytes() == b"keep" and (tmp_path / "state.json.tmp-link").is_symlink()
