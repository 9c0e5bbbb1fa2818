"""A directory's POSIX access ACL, read and written through a descriptor, and who it lets in.

Why a module of its own: the volume rules ask whether a requester's uid may write a directory
(``volumes``), and the volume grant adds and removes one entry (``volumeaccess``); both read the
same ``system.posix_acl_access`` attribute, always through ``/proc/self/fd/N`` of a descriptor
resolved without following links, never through a path a user can re-point.

:func:`permits` is the kernel's own rule (``posix_acl_permission`` in ``fs/posix_acl.c``, and
the mode bits when there is no ACL), so the daemon can answer "could this uid do it itself"
without running anything as that uid. ``tests/bottles/test_posixacl.py`` checks it against the
kernel's ``access(2)`` as real uids.
"""

from __future__ import annotations

import errno
import os
import stat
import struct

from attrs import frozen

from bottlenet.paths import proc_fd

XATTR = "system.posix_acl_access"
_VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
NO_ID = 0xFFFFFFFF
_ENTRY = struct.Struct("<HHI")
RWX = 0o7
R, W, X = 0o4, 0o2, 0o1


@frozen
class Entry:
    tag: int
    perm: int
    id: int = NO_ID


@frozen
class Acl:
    """The entries of an access ACL, sorted as the kernel keeps them; a directory without one
    reads as its mode's three entries (``minimal``)."""

    entries: tuple[Entry, ...]

    @classmethod
    def of_mode(cls, mode: int) -> Acl:
        return cls(
            (
                Entry(USER_OBJ, mode >> 6 & RWX),
                Entry(GROUP_OBJ, mode >> 3 & RWX),
                Entry(OTHER, mode & RWX),
            )
        )

    @classmethod
    def decode(cls, raw: bytes) -> Acl:
        if len(raw) < 4 or (len(raw) - 4) % _ENTRY.size:
            raise OSError(errno.EINVAL, "not a POSIX ACL")
        (version,) = struct.unpack_from("<I", raw)
        if version != _VERSION:
            raise OSError(errno.EINVAL, "unknown POSIX ACL version")
        count = (len(raw) - 4) // _ENTRY.size
        return cls(
            tuple(Entry(*_ENTRY.unpack_from(raw, 4 + i * _ENTRY.size)) for i in range(count))
        )

    def encode(self) -> bytes:
        ordered = sorted(self.entries, key=lambda e: (e.tag, e.id))
        return struct.pack("<I", _VERSION) + b"".join(
            _ENTRY.pack(e.tag, e.perm, e.id) for e in ordered
        )

    @property
    def named(self) -> tuple[Entry, ...]:
        return tuple(e for e in self.entries if e.tag in (USER, GROUP))

    @property
    def mask(self) -> int | None:
        return next((e.perm for e in self.entries if e.tag == MASK), None)

    def user(self, uid: int) -> Entry | None:
        return next((e for e in self.entries if e.tag == USER and e.id == uid), None)

    def without_user(self, uid: int) -> Acl:
        """This ACL without ``user:<uid>``; without its mask too when no named entry is left
        (a minimal ACL, which the kernel stores as the mode alone)."""
        kept = [e for e in self.entries if not (e.tag == USER and e.id == uid)]
        if not any(e.tag in (USER, GROUP) for e in kept):
            kept = [e for e in kept if e.tag != MASK]
        return Acl(tuple(kept))

    def with_user(self, uid: int, perm: int) -> Acl:
        """This ACL with ``user:<uid>:perm``; a minimal one gains the mask that entry needs
        (the owning group's own bits stay what they were: the mask only adds ``perm``)."""
        kept = [e for e in self.without_user(uid).entries if e.tag != MASK]
        mask = self.mask
        if mask is None:
            group_obj = next(e.perm for e in kept if e.tag == GROUP_OBJ)
            mask = group_obj | perm
        return Acl((*kept, Entry(USER, perm, uid), Entry(MASK, mask)))


def read(fd: int) -> Acl:
    """The access ACL of the directory behind ``fd`` (its mode's, when it has none)."""
    try:
        return Acl.decode(os.getxattr(proc_fd(fd), XATTR))
    except OSError as e:
        if e.errno not in (errno.ENODATA, errno.EOPNOTSUPP):
            raise
    return Acl.of_mode(stat.S_IMODE(os.fstat(fd).st_mode))


def write(fd: int, acl: Acl) -> None:
    """Store ``acl`` on the object behind ``fd``. A minimal ACL is written as an ACL too: the
    kernel then sets the mode's permission bits from it (keeping setuid, setgid and sticky)
    and keeps no attribute, in one call on the object, with no ``chmod`` by name."""
    os.setxattr(proc_fd(fd), XATTR, acl.encode())


@frozen
class Credentials:
    """Who asks: a uid, its primary gid and its supplementary groups."""

    uid: int
    gid: int
    groups: frozenset[int] = frozenset()

    def in_group(self, gid: int) -> bool:
        return gid == self.gid or gid in self.groups


def permits(acl: Acl, st: os.stat_result, who: Credentials, want: int) -> bool:
    """Whether ``who`` may ``want`` (a mask of R, W, X) the object of ``st`` whose access ACL
    is ``acl``, by the kernel's rule (``acl_permission_check`` in ``fs/namei.c``): root always
    may (a directory); the owner gets the owner's bits; then, when the mode's group bits (the
    mask) are not all clear, a named user its entry under the mask, a matching group (the
    owning one or a named one) its bits under the mask, and no matching group that allows it
    means no; else (and always when the mask is empty: the kernel skips the ACL then) the
    owning group gets the group bits, others the other bits. A read-only filesystem is the
    caller's to ask (``ST_RDONLY``)."""
    if who.uid == 0:
        return True
    mask = acl.mask
    masked = RWX if mask is None else mask
    if st.st_uid == who.uid:
        return _has(acl, USER_OBJ, want)
    if mask == 0:
        bits = 0 if who.in_group(st.st_gid) else _perm(acl, OTHER)
        return bits & want == want
    for e in acl.entries:
        if e.tag == USER and e.id == who.uid:
            return e.perm & masked & want == want
    found = False
    for e in acl.entries:
        if (e.tag == GROUP_OBJ and who.in_group(st.st_gid)) or (
            e.tag == GROUP and who.in_group(e.id)
        ):
            found = True
            if e.perm & want == want:
                return e.perm & masked & want == want
    if found:
        return False
    return _has(acl, OTHER, want)


def _has(acl: Acl, tag: int, want: int) -> bool:
    return _perm(acl, tag) & want == want


def _perm(acl: Acl, tag: int) -> int:
    return next((e.perm for e in acl.entries if e.tag == tag), 0)
