"""The record of every volume ACL grant the daemon has made and not yet taken back.

Why: a grant (``volumeaccess``) changes a user's directory; the bottle's own record is written
only when its create ends, so a crash in between would leave ``user:<uid>:rwx`` there with
nothing that says so. Each grant is written here, and fsynced, **before** it is made, and
removed only after it was taken back: recovery revokes every grant whose uid no kept bottle
holds (a create cut short), teardown every grant of the bottle's agent uid.

A grant remembers the directory it was made on (device, inode, the kernel's file handle, the
path it had), so the revoke acts on that very directory whatever was renamed or re-pointed
since, and on nothing else (``volumeaccess.reopen``).

One file per grant, ``<state-dir>/volume-grants/<uid>-<dev>-<ino>.json``, in a 0700 directory
of the daemon's; written in full and fsynced (file and directory) before the ACL changes, so a
file that does not parse is one whose grant was never made (it is dropped).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator

from attrs import frozen
from twisted.logger import Logger

from bottlenet.fields import Fields
from bottlenet.paths import ensure_private_dir, open_regular

GRANTS_DIR = "volume-grants"
#: A record is a few hundred bytes; anything larger is not one of ours.
_MAX_RECORD = 8192


class GrantRecordError(ValueError):
    """A grant record that does not parse."""


@frozen
class Grant:
    """``user:<uid>:rwx`` on one directory, for the agent VM of ``bottle``."""

    bottle: str
    label: str
    path: str
    dev: int
    ino: int
    uid: int
    #: The kernel's handle of the directory (``paths.file_handle``); None where its
    #: filesystem has none.
    handle: bytes | None = None

    @property
    def file_name(self) -> str:
        return f"{self.uid}-{self.dev}-{self.ino}.json"

    def to_json(self) -> dict[str, object]:
        return {
            "bottle": self.bottle,
            "label": self.label,
            "path": self.path,
            "dev": self.dev,
            "ino": self.ino,
            "uid": self.uid,
            "handle": None if self.handle is None else self.handle.hex(),
        }

    @classmethod
    def from_json(cls, doc: object) -> Grant:
        f = Fields(
            doc,
            allowed={"bottle", "label", "path", "dev", "ino", "uid", "handle"},
            error=GrantRecordError,
        )
        handle = f.value("handle", str, optional=True)
        try:
            raw = None if handle is None else bytes.fromhex(handle)
        except ValueError:
            raise GrantRecordError("handle: must be hex") from None
        return cls(
            f.value("bottle", str),
            f.value("label", str),
            f.value("path", str),
            f.integer("dev", 0, 2**64 - 1),
            f.integer("ino", 0, 2**64 - 1),
            f.integer("uid", 1, 2**32 - 2),
            raw,
        )


class GrantBook:
    """The grant records under one state directory."""

    log = Logger()

    def __init__(self, state_dir: str) -> None:
        self.dir = os.path.join(state_dir, GRANTS_DIR)

    def record(self, grant: Grant) -> None:
        """Write ``grant``'s record durably (before the grant is made). OSError."""
        ensure_private_dir(self.dir)
        path = os.path.join(self.dir, grant.file_name)
        data = json.dumps(grant.to_json(), sort_keys=True).encode()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._sync_dir()

    def forget(self, grant: Grant) -> None:
        """The grant was taken back (or its directory is gone): its record goes."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.dir, grant.file_name))
            self._sync_dir()

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def grants(self, uid: int | None = None) -> list[Grant]:
        """Every recorded grant (of ``uid`` only, when given); a record that does not parse
        (a write a crash cut short: its grant was never made) is removed and logged."""
        return [g for g in self._all() if uid is None or g.uid == uid]

    def _all(self) -> Iterator[Grant]:
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return
        for name in names:
            if not name.endswith(".json"):
                continue
            path = os.path.join(self.dir, name)
            try:
                grant = self._read(path)
            except (OSError, GrantRecordError) as e:
                self.log.warn(
                    "volume grant record {name} unreadable ({why}): dropped (a record is "
                    "complete before its grant is made)",
                    name=name,
                    why=getattr(e, "strerror", None) or str(e),
                )
                with contextlib.suppress(OSError):
                    os.unlink(path)
                continue
            if grant.file_name == name:
                yield grant

    def _read(self, path: str) -> Grant:
        fd = open_regular(path)
        try:
            data = os.read(fd, _MAX_RECORD + 1)
        finally:
            os.close(fd)
        if len(data) > _MAX_RECORD:
            raise OSError(errno.EFBIG, "too large")
        try:
            doc = json.loads(data)
        except ValueError:
            raise GrantRecordError("not JSON") from None
        return Grant.from_json(doc)
