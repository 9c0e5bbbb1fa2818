"""Durable daemon state: one JSON document, written atomically, readable only by us.

The file records the daemon's instance id (the owner label on its machines) and every bottle
with the real ports it bound, so a restarted daemon re-binds the same endpoints and can tell
its machines from anyone else's. Writes go to a temporary file (mode 0600) that is fsynced and
renamed over the old one, then the directory is fsynced: a crash leaves the old or the new
document, never a torn one.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from typing import Any

from attrs import field, frozen

from bottlenet.errors import BottlenetError

SCHEMA_VERSION = 1
STATE_FILE = "state.json"
MAX_STATE_BYTES = 16 << 20


class StateError(BottlenetError):
    """The state file is unreadable, unsafe or from an unknown schema."""

    code = "STATE_CORRUPT"


@frozen
class State:
    """The whole persisted document. ``bottles`` maps a bottle name to its JSON record."""

    instance_id: str
    bottles: dict[str, dict[str, Any]] = field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "instance_id": self.instance_id,
            "bottles": {name: self.bottles[name] for name in sorted(self.bottles)},
        }


def new_instance_id() -> str:
    """A random id for a new daemon instance: lowercase hex, valid in a smolvm label."""
    return secrets.token_hex(8)


class StateStore:
    """Loads and atomically saves :class:`State` under the (0700) state directory.

    The registry changes one bottle at a time through :meth:`put` and :meth:`remove` (each
    durable when it returns; on an error the document is left as it was); :meth:`save`
    replaces the whole document (recovery's end, the first start).
    """

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, STATE_FILE)
        self._current: State | None = None

    def current(self) -> State:
        """The document as last loaded or written (loaded on first use)."""
        if self._current is None:
            self._current = self.load()
        return self._current

    def put(self, name: str, record: dict[str, Any]) -> None:
        """Add or replace one bottle's record, durably."""
        state = self.current()
        self.save(State(state.instance_id, {**state.bottles, name: record}))

    def remove(self, name: str) -> None:
        """Drop one bottle's record, durably (a no-op write when it has none)."""
        state = self.current()
        self.save(State(state.instance_id, {k: v for k, v in state.bottles.items() if k != name}))

    def load(self) -> State:
        """Read the state, or start a fresh one (with a new instance id) if there is none."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            self._current = State(new_instance_id())
            return self._current
        except OSError as e:
            raise StateError(f"{self.path}: cannot open: {e.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise StateError(f"{self.path}: not a regular file owned by this user")
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise StateError(f"{self.path}: mode {oct(stat.S_IMODE(st.st_mode))} is too open")
            raw = f.read(MAX_STATE_BYTES + 1)
        if len(raw) > MAX_STATE_BYTES:
            raise StateError(f"{self.path}: larger than {MAX_STATE_BYTES} bytes")
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            raise StateError(f"{self.path}: not valid JSON") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_VERSION:
            raise StateError(f"{self.path}: unknown schema (expected {SCHEMA_VERSION})")
        instance_id = doc.get("instance_id")
        bottles = doc.get("bottles")
        if not isinstance(instance_id, str) or not instance_id.isalnum():
            raise StateError(f"{self.path}: bad instance_id")
        if not isinstance(bottles, dict) or not all(isinstance(v, dict) for v in bottles.values()):
            raise StateError(f"{self.path}: bad bottles table")
        state = State(instance_id, dict(bottles))
        self._current = state
        return state

    def save(self, state: State) -> None:
        """Write ``state`` atomically: temp file (0600) + fsync + rename + fsync(dir)."""
        data = json.dumps(state.to_json(), indent=1, sort_keys=True).encode() + b"\n"
        tmp = f"{self.path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        self._current = state
        dfd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
