"""Durable daemon state: a snapshot plus an append-only journal, readable only by us.

The state is the daemon's instance id (the owner label on its machines) and one record per
bottle with the real ports it bound, so a restarted daemon re-binds the same endpoints and can
tell its machines from anyone else's.

Why a journal: rewriting the whole document on every change costs time in proportion to the
bottles that exist (at 1,000 bottles a CreateBottle spent ~80 ms serialising and writing the
others). Here a change appends one line for the one bottle it touched (:meth:`StateStore.put`,
:meth:`StateStore.remove`) and fsyncs it: the same cost at 10,000 bottles as at 1, and durable
when the call returns, as before. The snapshot keeps today's format (``state.json``, written
atomically: temp file, fsync, rename, fsync of the directory), so a crash still leaves the
old or the new snapshot, never a torn one. Compaction (:meth:`StateStore.save`) writes a new
snapshot once the journal holds more lines than about twice the live bottles (so its cost,
linear in the bottles, is spread over as many changes: constant per change on average), then
starts a new journal.

Crash rules (each tested in ``tests/bottles/test_store.py``):

- Every journal line carries its length and a CRC-32; bytes after the last newline are a
  write torn by a crash: never acknowledged, so dropped (and cut off before the next append).
  A torn write cannot end in a newline, so a complete line that fails its check, wherever it
  is, is corruption, and the load is refused (STATE_CORRUPT).
- The journal's header is written atomically, and a first save writes the journal before the
  snapshot: a missing journal next to a snapshot of generation 1 or more, an empty one, or a
  journal holding changes with no snapshot is damage, refused, never read as "no bottles"
  (recovery would delete the bottles' VMs as orphans).
- The journal's first line names the snapshot generation it continues. Compaction writes the
  snapshot of generation N+1 first, then the journal of N+1 (temp file + rename): a crash in
  between leaves a journal of generation N, which the load ignores (its changes are in the
  snapshot) and the next change replaces.
- Snapshot and journal must be regular files owned by us with no group/other bits; symlinks are
  refused (``O_NOFOLLOW``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import zlib
from collections.abc import Callable
from typing import Any

from attrs import field, frozen
from twisted.logger import Logger

from bottlenet.errors import BottlenetError, Unavailable
from bottlenet.paths import NotRegularFile, open_regular

SCHEMA_VERSION = 1
STATE_FILE = "state.json"
JOURNAL_FILE = "state.journal"
MAX_STATE_BYTES = 16 << 20
#: Compaction keeps the journal far below this (it compacts at half of it at the latest).
MAX_JOURNAL_BYTES = 64 << 20
#: The journal is compacted once it has this many lines and more than twice the live bottles.
COMPACT_MIN_LINES = 1024
JOURNAL_VERSION = 1


class StateError(BottlenetError):
    """The state file is unreadable, unsafe or from an unknown schema."""

    code = "STATE_CORRUPT"


@frozen
class State:
    """The whole persisted document. ``bottles`` maps a bottle name to its JSON record."""

    instance_id: str
    bottles: dict[str, dict[str, Any]] = field(factory=dict)
    #: The node's own record (``node.drain``: draining). None: none was loaded; in a
    #: save, keep the record the store holds.
    node: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        doc = {
            "schema": SCHEMA_VERSION,
            "instance_id": self.instance_id,
            "bottles": {name: self.bottles[name] for name in sorted(self.bottles)},
        }
        if self.node:  # left out while empty: the file of a daemon that never drained
            doc["node"] = self.node
        return doc


def new_instance_id() -> str:
    """A random id for a new daemon instance: lowercase hex, valid in a smolvm label."""
    return secrets.token_hex(8)


def _line(doc: dict[str, Any]) -> bytes:
    """One journal line: ``<length> <crc32> <json>\\n`` (length and CRC of the JSON bytes)."""
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return b"%d %08x %s\n" % (len(body), zlib.crc32(body), body)


def _header(instance_id: str, generation: int) -> bytes:
    """A journal's first line: the state and the snapshot generation it continues."""
    return _line({"journal": JOURNAL_VERSION, "generation": generation, "instance_id": instance_id})


def _parse_line(raw: bytes) -> dict[str, Any] | None:
    """The document of one complete line (newline stripped), or None if it fails its checks."""
    try:
        length_text, crc_text, body = raw.split(b" ", 2)
        if int(length_text) != len(body) or int(crc_text, 16) != zlib.crc32(body):
            return None
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class StateStore:
    """Loads the state and keeps it durable, one bottle record at a time.

    The interface the registry uses: :meth:`load` (everything), :meth:`put` and
    :meth:`remove` (one bottle, durable on return), :meth:`save` (the whole state at once, e.g.
    after recovery; also what compaction does). Writes raise ``OSError``.
    """

    log = Logger()

    def __init__(self, state_dir: str, *, compact_min_lines: int = COMPACT_MIN_LINES) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, STATE_FILE)
        self.journal_path = os.path.join(state_dir, JOURNAL_FILE)
        self._compact_min = compact_min_lines
        # What is on disk (snapshot + journal), kept for compaction.
        self._instance_id: str | None = None
        self._records: dict[str, dict[str, Any]] = {}
        self._node: dict[str, Any] = {}
        self._generation = 0
        self._journal_fd: int | None = None
        self._journal_lines = 0
        self._journal_good = 0  # bytes of the journal that hold whole, valid lines
        self._journal_current = False  # the journal on disk continues this generation

    # -- reading ------------------------------------------------------------------------

    def load(self) -> State:
        """Read snapshot and journal, or start a fresh state (new instance id) if there is none."""
        self._remove_temp_files()
        raw = self._read_private(self.path)
        if raw is None:
            self._check_journal_without_snapshot()
            self._instance_id = new_instance_id()
            self._records, self._generation, self._node = {}, 0, {}
            self._journal_current = False
            self._close_journal()
            return State(self._instance_id)
        instance_id, bottles, generation, self._node = self._parse_snapshot(raw)
        self._instance_id, self._records, self._generation = instance_id, bottles, generation
        self._replay_journal()
        return State(instance_id, dict(self._records), dict(self._node) or None)

    def _read_private(self, path: str, limit: int = MAX_STATE_BYTES) -> bytes | None:
        try:
            fd = open_regular(path)  # a FIFO here must not hang the daemon's start
        except FileNotFoundError:
            return None
        except NotRegularFile:
            raise StateError(f"{path}: not a regular file owned by this user") from None
        except OSError as e:
            raise StateError(f"{path}: cannot open: {e.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise StateError(f"{path}: not a regular file owned by this user")
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise StateError(f"{path}: mode {oct(stat.S_IMODE(st.st_mode))} is too open")
            raw = f.read(limit + 1)
        if len(raw) > limit:
            raise StateError(f"{path}: larger than {limit} bytes")
        return raw

    def _remove_temp_files(self) -> None:
        """Temp files of a write a crash cut short (``state.json.tmp-*``, ``state.journal.tmp-*``):
        never renamed, so never part of the state; only one daemon holds the directory (its
        lock), so none is being written now. Symlinks and other kinds are left alone."""
        prefixes = (f"{STATE_FILE}.tmp-", f"{JOURNAL_FILE}.tmp-")
        try:
            names = os.listdir(self.state_dir)
        except OSError:
            return
        for name in names:
            if not name.startswith(prefixes):
                continue
            path = os.path.join(self.state_dir, name)
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):
                    os.unlink(path)
                    self.log.info("removed {name}, left by a write a crash cut short", name=name)
            except OSError:
                pass

    def _check_journal_without_snapshot(self) -> None:
        """A journal but no snapshot: a first save cut short (a header alone: a fresh start)
        or a deleted snapshot (changes after the header: refused, never read as no bottles)."""
        raw = self._read_private(self.journal_path, MAX_JOURNAL_BYTES)
        if raw is not None and raw.count(b"\n") > 1:
            raise StateError(
                f"{self.path}: missing, but {JOURNAL_FILE} holds changes; restore it or move "
                "the state directory away"
            )

    def _parse_snapshot(
        self, raw: bytes
    ) -> tuple[str, dict[str, dict[str, Any]], int, dict[str, Any]]:
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            raise StateError(f"{self.path}: not valid JSON") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_VERSION:
            raise StateError(f"{self.path}: unknown schema (expected {SCHEMA_VERSION})")
        instance_id = doc.get("instance_id")
        bottles = doc.get("bottles")
        generation = doc.get("generation", 0)  # absent in files written before the journal
        if not isinstance(instance_id, str) or not instance_id.isalnum():
            raise StateError(f"{self.path}: bad instance_id")
        if not isinstance(bottles, dict) or not all(isinstance(v, dict) for v in bottles.values()):
            raise StateError(f"{self.path}: bad bottles table")
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
            raise StateError(f"{self.path}: bad generation")
        node = doc.get("node", {})  # absent until the node first records something
        if not isinstance(node, dict):
            raise StateError(f"{self.path}: bad node record")
        return instance_id, dict(bottles), generation, node

    def _replay_journal(self) -> None:
        self._close_journal()
        self._journal_current = False
        self._journal_lines = self._journal_good = 0
        raw = self._read_private(self.journal_path, MAX_JOURNAL_BYTES)
        if raw is None:
            if self._generation == 0:
                return  # a snapshot from before the journal existed: it holds everything
            # Every save writes a journal, and a first save writes it before the snapshot:
            # only damage or deletion leaves a snapshot without one. Reading that as "no
            # changes" would forget acknowledged bottles and delete their VMs as orphans.
            raise StateError(
                f"{self.journal_path}: missing, but {STATE_FILE} (generation "
                f"{self._generation}) expects one; restore it or move the state directory away"
            )
        lines = raw.split(b"\n")
        # After the last newline: b"" unless the last append was torn by a crash (never
        # acknowledged: dropped). A torn write cannot end in a newline, so every complete
        # line must pass its checks; the header is written atomically, so it is always there.
        lines.pop()
        docs: list[dict[str, Any] | None] = [_parse_line(line) for line in lines]
        if None in docs:
            bad = docs.index(None) + 1
            raise StateError(f"{self.journal_path}: line {bad} is corrupt")
        good = sum(len(line) + 1 for line in lines)
        valid = [d for d in docs if d is not None]
        if not valid:
            raise StateError(f"{self.journal_path}: empty (no header line): damaged")
        header = valid[0]
        if header.get("journal") != JOURNAL_VERSION or header.get("instance_id") != (
            self._instance_id
        ):
            raise StateError(f"{self.journal_path}: not a journal of this state")
        if header.get("generation") != self._generation:
            return  # from before the last compaction: its changes are in the snapshot
        for i, doc in enumerate(valid[1:], start=2):
            name, op = doc.get("name"), doc.get("op")
            if not isinstance(name, str):
                raise StateError(f"{self.journal_path}: line {i}: bad bottle name")
            if op == "node" and isinstance(doc.get("record"), dict):
                self._node = doc["record"]
            elif op == "put" and isinstance(doc.get("record"), dict):
                self._records[name] = doc["record"]
            elif op == "remove":
                self._records.pop(name, None)
            else:
                raise StateError(f"{self.journal_path}: line {i}: unknown change")
        self._journal_current = True
        self._journal_lines = len(valid) - 1
        self._journal_good = good

    # -- writing ------------------------------------------------------------------------

    def put(self, name: str, record: dict[str, Any]) -> None:
        """Record (replace) one bottle's record; durable when this returns, and raises
        OSError only when the change is not on disk."""
        self._append({"op": "put", "name": name, "record": record})
        self._records[name] = record
        self._compact_quietly()

    def replace(self, old: str, name: str, record: dict[str, Any]) -> None:
        """Record ``name`` (``record``), then forget ``old``: a crash between leaves both (the
        reader keeps ``name``'s: a warm pool's member taken, ``recovery.py``)."""
        self.put(name, record)
        self.remove(old)

    @property
    def node(self) -> dict[str, Any]:
        """The node's own record as it is now (empty: none)."""
        return dict(self._node or {})

    def put_node(self, record: dict[str, Any]) -> None:
        """Record (replace) the node's own record; durable when this returns (OSError: not
        on disk)."""
        self._append({"op": "node", "name": "", "record": record})
        self._node = dict(record)
        self._compact_quietly()

    def remove(self, name: str) -> None:
        """Forget one bottle; durable when this returns (OSError: not on disk). Unknown
        names are a no-op."""
        if name not in self._records:
            return
        self._append({"op": "remove", "name": name})
        del self._records[name]
        self._compact_quietly()

    def _compact_quietly(self) -> None:
        """The change is already durable: a failed compaction must not fail it (the caller
        would answer UNAVAILABLE and roll back what the next start restores). It is logged
        and tried again after the next change."""
        try:
            self._maybe_compact()
        except OSError as e:
            self.log.error("state compaction failed (retried later): {err}", err=e.strerror)

    def save(self, state: State) -> None:
        """Write the whole ``state`` as a new snapshot and start an empty journal after it."""
        generation = self._generation + 1
        if state.node is None:  # a save of the bottles alone keeps the node's record
            state = State(state.instance_id, state.bottles, self._node)
        doc = state.to_json()
        doc["generation"] = generation
        data = json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"
        if not os.path.lexists(self.journal_path):
            # No journal yet (a new state dir): write this generation's first, so that no
            # crash leaves a snapshot without a journal (which the load refuses as damage).
            self._write_atomically(self.journal_path, _header(state.instance_id, generation))
        self._write_atomically(self.path, data)
        # From here on the snapshot holds everything: an old journal is ignored if we crash.
        self._instance_id, self._records = state.instance_id, dict(state.bottles)
        self._node = dict(state.node or {})
        self._generation = generation
        self._close_journal()
        self._journal_current = False
        self._new_journal()

    def close(self) -> None:
        """Release the journal's descriptor (the store reopens it when written again)."""
        self._close_journal()

    def _append(self, doc: dict[str, Any]) -> None:
        if self._instance_id is None:
            raise RuntimeError("StateStore: load() or save() first")
        if not self._journal_current:
            self._new_journal()
        fd = self._open_journal()
        line = _line(doc)
        try:
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(28, "short write to the state journal")  # ENOSPC-like
            os.fsync(fd)
        except OSError:
            # Cut off whatever part of the line made it, now: a change the caller is told
            # failed must not come back at the next start (best effort; the next append
            # cuts it again before writing).
            with contextlib.suppress(OSError):
                os.ftruncate(fd, self._journal_good)
            self._close_journal()
            raise
        self._journal_good += len(line)
        self._journal_lines += 1

    def _open_journal(self) -> int:
        fd = self._journal_fd
        if fd is not None:
            return fd
        fd = os.open(self.journal_path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            # Drop a torn tail (or a failed append) before appending after it.
            os.ftruncate(fd, self._journal_good)
            os.lseek(fd, 0, os.SEEK_END)
        except BaseException:
            os.close(fd)
            raise
        self._journal_fd = fd
        return fd

    def _new_journal(self) -> None:
        """A journal holding only its header, for the current generation (atomic)."""
        assert self._instance_id is not None
        header = _header(self._instance_id, self._generation)
        self._close_journal()
        self._write_atomically(self.journal_path, header)
        self._journal_current = True
        self._journal_lines = 0
        self._journal_good = len(header)

    def _maybe_compact(self) -> None:
        lines = self._journal_lines
        if (
            lines >= self._compact_min and lines > 2 * len(self._records)
        ) or self._journal_good > MAX_JOURNAL_BYTES // 2:
            assert self._instance_id is not None
            self.save(State(self._instance_id, self._records, self._node))

    def _close_journal(self) -> None:
        fd, self._journal_fd = self._journal_fd, None
        if fd is not None:
            os.close(fd)

    def _write_atomically(self, path: str, data: bytes) -> None:
        """temp file (0600) + fsync + rename + fsync(dir)."""
        tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        dfd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def write(store: StateStore, change: Callable[[StateStore], None]) -> None:
    """One change to the state file (a bottle's record, the node's); an I/O failure is
    UNAVAILABLE (and logged)."""
    try:
        change(store)
    except OSError as e:
        StateStore.log.error("cannot write the state file: {err}", err=e.strerror)
        raise Unavailable(f"cannot write the state file: {e.strerror}") from None
