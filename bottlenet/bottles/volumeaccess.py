"""The agent VMM's access to the bottle's ``agent.volumes`` under per-VM uids.

smolvm (root) serves each ``--volume`` with virtiofs **from the VMM process, after it dropped
to the VM's own uid** (2000000 and up; ``src/cli/internal_boot.rs``, the uid-drop block before
libkrun; fidelity.md #2). It maps only its own pack store, never a user's volume, and opens
(``o+x``) only its own directories. So a read-write volume the VM's uid cannot write (the
usual root-owned ``0755`` directory) fails every write in the guest, the launch gate's
round trip first; and a volume under a directory that uid cannot pass (``/root/...``) fails
the VM's start.

What bottlenet does:

* **Before any machine exists**, every volume's parents must let any uid pass (``o+x``): the
  VM's uid is not known yet, and any of smolvm's is "other" to them. One that does not is
  refused with one line naming the volume, the directory and the fix (:func:`closed_parent`).
* **After the agent's uid is reserved** (before its start), each read-write volume the uid
  cannot already write gets one POSIX ACL entry ``user:<uid>:rwx`` on its directory
  (:func:`grant`); **at teardown** (and when the create rolls back) the entry is removed again,
  the uid the one reserved for the agent, kept on the bottle's record (:func:`revoke`).
  The owner, the group and the files are untouched; only the directory's ACL changes (and, as
  POSIX says for an ACL with a named entry, its mode's group bits show the ACL mask while the
  entry is there). The VM can then write the directory itself and what it creates below;
  files it creates belong to its uid on the host. Subdirectories that existed before keep
  their own permissions.

Why an ACL rather than an idmapped mount: the VMM opens the host path itself, so an idmapped
mount would have to be a second mount of the user's directory, made and kept by the daemon
for the VM's life (and re-made after a host reboot), on a kernel and filesystem that support
it; an ACL entry is one attribute on the directory, works on ext4, xfs, btrfs and tmpfs, names
exactly that uid, and is removed by removing that entry. A filesystem without POSIX ACLs fails
the create with one line naming the volume, the uid and what to do instead.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Sequence

from bottlenet.errors import InvalidArgument, IsolationUnavailable
from vmctl.spec import Volume

_XATTR = "system.posix_acl_access"
_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF
_ENTRY = struct.Struct("<HHI")
_RWX = 0o7
#: Others may pass through a directory with this bit.
_TRAVERSE = 0o001


def closed_parent(path: str) -> str | None:
    """The nearest directory above ``path`` another uid cannot pass (no ``o+x``), or None."""
    path = os.path.abspath(path)
    found = None
    while (parent := os.path.dirname(path)) != path:
        if not os.stat(parent).st_mode & _TRAVERSE:
            found = parent
        path = parent
    return found


def check_reachable(volumes: Sequence[Volume], labels: Sequence[str]) -> None:
    """Under per-VM uids, before any machine: each volume's parents let the VM's uid pass."""
    for volume, label in zip(volumes, labels, strict=True):
        closed = closed_parent(volume.host)
        if closed is not None:
            raise InvalidArgument(
                f"{label} {volume.host!r}: the agent VM's own uid (per-VM uids, 2000000 and "
                f"up) cannot pass {closed!r} (no o+x), so smolvm cannot serve this volume; "
                f"chmod o+x {closed!r} or use a directory outside it"
            )


def _entries(path: str) -> list[tuple[int, int, int]]:
    """The directory's access ACL, or the one its mode is (owner, group, other)."""
    try:
        raw = os.getxattr(path, _XATTR, follow_symlinks=False)
    except OSError as e:
        if e.errno not in (errno.ENODATA, errno.EOPNOTSUPP):
            raise
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        return [
            (_USER_OBJ, mode >> 6 & _RWX, _NO_ID),
            (_GROUP_OBJ, mode >> 3 & _RWX, _NO_ID),
            (_OTHER, mode & _RWX, _NO_ID),
        ]
    (version,) = struct.unpack_from("<I", raw)
    if version != _VERSION or (len(raw) - 4) % _ENTRY.size:
        raise OSError(errno.EINVAL, "unknown POSIX ACL format")
    return [_ENTRY.unpack_from(raw, 4 + i * _ENTRY.size) for i in range((len(raw) - 4) // 8)]


def _store(path: str, entries: list[tuple[int, int, int]]) -> None:
    """Write ``entries`` back, the mask recomputed; a minimal ACL becomes the mode again."""
    named = [e for e in entries if e[0] in (_USER, _GROUP)]
    base = [e for e in entries if e[0] not in (_USER, _GROUP, _MASK)]
    if not named:
        with_mode = {tag: perm for tag, perm, _ in base}
        try:
            os.removexattr(path, _XATTR, follow_symlinks=False)
        except OSError as e:
            if e.errno != errno.ENODATA:
                raise
        mode = stat.S_IMODE(os.lstat(path).st_mode) & ~0o777
        mode |= with_mode[_USER_OBJ] << 6 | with_mode[_GROUP_OBJ] << 3 | with_mode[_OTHER]
        os.chmod(path, mode)
        return
    mask = 0
    for tag, perm, _ in entries:
        if tag in (_USER, _GROUP, _GROUP_OBJ):
            mask |= perm
    ordered = sorted([*base, *named, (_MASK, mask, _NO_ID)], key=lambda e: (e[0], e[2]))
    raw = struct.pack("<I", _VERSION) + b"".join(_ENTRY.pack(*e) for e in ordered)
    os.setxattr(path, _XATTR, raw, follow_symlinks=False)


def _writable_by_others(path: str) -> bool:
    mode = os.lstat(path).st_mode
    return mode & 0o003 == 0o003


def grant(volumes: Sequence[Volume], labels: Sequence[str], uid: int) -> list[str]:
    """``user:<uid>:rwx`` on each read-write volume ``uid`` cannot already write; returns the
    directories granted (to revoke). IsolationUnavailable, naming the volume, when the
    filesystem has no POSIX ACLs."""
    granted: list[str] = []
    for volume, label in zip(volumes, labels, strict=True):
        path = volume.host
        if volume.read_only or not stat.S_ISDIR(os.lstat(path).st_mode):
            continue
        if _writable_by_others(path) or os.lstat(path).st_uid == uid:
            continue
        entries = [e for e in _entries(path) if not (e[0] == _USER and e[2] == uid)]
        try:
            _store(path, [*entries, (_USER, _RWX, uid)])
        except OSError as e:
            revoke(granted, uid)
            if e.errno == errno.EOPNOTSUPP:
                raise IsolationUnavailable(
                    f"{label} {path!r}: the agent VM's uid {uid} cannot write it and its "
                    "filesystem has no POSIX ACLs to grant that uid alone; make it writable "
                    f"for uid {uid}, or mount it read-only (':ro')"
                ) from None
            raise
        granted.append(path)
    return granted


def revoke(paths: Sequence[str], uid: int) -> None:
    """Remove the ``user:<uid>`` entry from each directory (nothing else changes)."""
    for path in paths:
        try:
            entries = _entries(path)
        except OSError:
            continue  # gone, or no longer a directory we can read: nothing of ours is left
        if any(tag == _USER and who == uid for tag, _, who in entries):
            _store(path, [e for e in entries if not (e[0] == _USER and e[2] == uid)])
