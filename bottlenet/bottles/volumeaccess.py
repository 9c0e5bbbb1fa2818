"""The agent VMM's access to the bottle's read-write volumes under per-VM uids.

smolvm (root) serves each ``--volume`` with virtiofs **from the VMM process, after it dropped
to the VM's own uid** (2000000 and up; ``src/cli/internal_boot.rs``, the uid-drop block before
libkrun; fidelity.md #2). So a read-write volume the VM's uid cannot write (the usual
``0755`` directory) fails every write in the guest, the launch gate's round trip first.

What bottlenet does, **after the agent's uid is reserved** (before its start), on each
read-write volume as :mod:`~bottlenet.bottles.volumes` resolved and checked it (a descriptor,
never the path again): if that uid cannot already write it, one POSIX ACL entry
``user:<uid>:rwx`` (:func:`grant`), recorded first (``volumegrants``); **at teardown**, when the
create rolls back, and at recovery for a create a crash cut short, that entry is removed
again (:func:`revoke`), on the very directory it was put on (:func:`reopen`), in one
``setxattr`` through the descriptor (no ``chmod``, nothing by name).

Nothing else of the user's directory changes: owner, group and files stay; an ACL that had a
mask keeps it (a mask the entry would have to widen, which would also widen every named entry
it holds back, refuses the grant, naming the directory); a directory without an ACL gets one
while the grant lasts (its mode's group bits then show the mask, as POSIX says) and its exact
mode back after, setgid and sticky bits included.

Why an ACL rather than an idmapped mount: the VMM opens the host path itself, so an idmapped
mount would have to be a second mount of the user's directory, made and kept by the daemon
for the VM's life (and re-made after a host reboot), on a kernel and filesystem that support
it; an ACL entry is one attribute on the directory, works on ext4, xfs, btrfs and tmpfs, names
exactly that uid, and is removed by removing that entry. A filesystem without POSIX ACLs fails
the create with one line naming the volume, the uid and what to do instead.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Sequence

from twisted.logger import Logger

from bottlenet.bottles import posixacl
from bottlenet.bottles.posixacl import Credentials
from bottlenet.bottles.volumegrants import Grant, GrantBook
from bottlenet.bottles.volumes import ResolvedVolumes, shown
from bottlenet.errors import InvalidArgument, IsolationUnavailable
from bottlenet.paths import (
    SymlinkInPath,
    file_handle,
    open_by_handle,
    open_dir_nofollow,
)

log = Logger()


def grant(resolved: ResolvedVolumes, uid: int, book: GrantBook, bottle: str) -> list[Grant]:
    """``user:<uid>:rwx`` on each read-write volume ``uid`` cannot already write; returns the
    grants made (to revoke). A failure takes back the grants this call made, then raises:
    InvalidArgument for a mask that would widen, IsolationUnavailable naming the volume when
    its filesystem has no POSIX ACLs, OSError otherwise."""
    made: list[Grant] = []
    try:
        for r in resolved:
            if r.volume.read_only:
                continue
            acl = posixacl.read(r.fd)
            st = os.fstat(r.fd)
            if posixacl.permits(acl, st, Credentials(uid, uid), posixacl.RWX):
                continue
            where = f"{r.label} {shown(r.volume.host)}"
            mask = acl.mask
            if mask is not None and mask != posixacl.RWX:
                raise InvalidArgument(
                    f"{where}: its ACL mask ({_perm(mask)}) holds its named entries back, and "
                    f"granting the agent VM's uid {uid} rwx would widen it for all of them; "
                    "set the mask to rwx (setfacl -m m::rwx), make the directory writable for "
                    "that uid, or mount it read-only (':ro')"
                )
            made_grant = Grant(bottle, r.label, r.volume.host, r.dev, r.ino, uid, file_handle(r.fd))
            book.record(made_grant)
            made.append(made_grant)
            try:
                posixacl.write(r.fd, acl.with_user(uid, posixacl.RWX))
            except OSError as e:
                if e.errno == errno.EOPNOTSUPP:
                    raise IsolationUnavailable(
                        f"{where}: the agent VM's uid {uid} cannot write it and its "
                        "filesystem has no POSIX ACLs to grant that uid alone; make it "
                        f"writable for uid {uid}, or mount it read-only (':ro')"
                    ) from None
                raise
    except BaseException:
        revoke(made, book)
        raise
    return made


def _perm(perm: int) -> str:
    return "".join(c if perm & bit else "-" for c, bit in (("r", 4), ("w", 2), ("x", 1)))


def revoke(grants: Sequence[Grant], book: GrantBook) -> list[str]:
    """Remove each grant's ``user:<uid>`` entry from the directory it was made on, then its
    record. Never raises: what could not be done is returned (and logged), each grant tried;
    a grant whose record stays is tried again by the next teardown or recovery."""
    problems = []
    for g in grants:
        why = _revoke_one(g)
        if why is None:
            book.forget(g)
            continue
        problems.append(why)
        log.error(
            "bottle {bottle}: the volume grant for uid {uid} on {path} could not be taken "
            "back: {why}",
            bottle=g.bottle,
            uid=g.uid,
            path=shown(g.path),
            why=why,
        )
    return problems


def _revoke_one(g: Grant) -> str | None:
    """None when the grant is gone (taken back now, or its directory is gone); else why not."""
    try:
        fd = reopen(g)
    except OSError as e:
        return f"reopening it: {e.strerror}"
    if fd is None:
        log.warn(
            "bottle {bottle}: the directory granted to uid {uid} ({path}) is no longer "
            "there: nothing to take back",
            bottle=g.bottle,
            uid=g.uid,
            path=shown(g.path),
        )
        return None
    try:
        _take_back(fd, g.uid)
    except OSError as e:
        return e.strerror or str(e)
    finally:
        os.close(fd)
    return None


def _take_back(fd: int, uid: int) -> None:
    """Remove ``user:<uid>`` from the ACL of the directory behind ``fd``, if it is there."""
    acl = posixacl.read(fd)
    if acl.user(uid) is not None:
        posixacl.write(fd, acl.without_user(uid))


def reopen(g: Grant) -> int | None:
    """An ``O_PATH`` descriptor of the very directory ``g`` was made on: by its file handle
    (found wherever it was moved), else by its path resolved without links; either must be
    the same device and inode. None when it is gone or only another directory is there
    (logged: the entry, if any, stays on the one granted, which the daemon cannot find)."""
    fd = _by_handle(g)
    if fd is None:
        try:
            fd = open_dir_nofollow(g.path)
        except (FileNotFoundError, NotADirectoryError, SymlinkInPath):
            return None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (g.dev, g.ino):
        os.close(fd)
        log.warn(
            "bottle {bottle}: {path} is no longer the directory granted to uid {uid} "
            "(renamed or replaced): its entry, if any, stays there",
            bottle=g.bottle,
            path=shown(g.path),
            uid=g.uid,
        )
        return None
    return fd


def _by_handle(g: Grant) -> int | None:
    """The directory by its file handle, through a directory of its filesystem found on its
    old path (the nearest that still exists, on the same device)."""
    if g.handle is None:
        return None
    mount = _same_device_dir(g.path, g.dev)
    if mount is None:
        return None
    try:
        return open_by_handle(g.handle, mount)
    except OSError:
        return None
    finally:
        os.close(mount)


def _same_device_dir(path: str, dev: int) -> int | None:
    """An ``O_RDONLY`` descriptor of ``path`` or its nearest existing parent on ``dev``."""
    here = path
    while True:
        with contextlib.suppress(OSError):
            probe = open_dir_nofollow(here)
            try:
                if os.fstat(probe).st_dev == dev:
                    return os.open(
                        f"/proc/self/fd/{probe}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
                    )
            finally:
                os.close(probe)
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def revoke_by_path(paths: Sequence[str], uid: int) -> None:
    """A bottle recorded before grants were (``volumegrants``): remove ``user:<uid>`` from
    each read-write volume's directory, resolved without links (that uid is the bottle's
    own, never handed out again, so no other grant can be touched). Never raises."""
    for path in paths:
        try:
            fd = open_dir_nofollow(path)
        except OSError:
            continue
        try:
            _take_back(fd, uid)
        except OSError as e:
            log.error(
                "the volume grant for uid {uid} on {path} could not be taken back: {why}",
                uid=uid,
                path=shown(path),
                why=e.strerror,
            )
        finally:
            os.close(fd)
