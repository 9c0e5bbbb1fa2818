"""A VM bottle's ``agent.volumes``: each resolved once, and handed to a bottle only where its
requester may.

Why: the daemon runs smolvm (as root, or as its own user) and, under per-VM uids, adds an ACL
entry to each read-write volume (``volumeaccess``). A path string is what a requester, or a
local user who owns one of its parents, can re-point between a check and a use; a check made
with the daemon's rights says nothing of what the requester may do. So, at create, before any
machine (:func:`resolve`):

* **Resolved once, without following links.** Each host path is opened component by
  component from ``/`` (``paths.open_dir_nofollow``): a symlink anywhere in it refuses the
  volume, naming the link. The descriptor is what every check below, the grant and the launch
  gate use; smolvm is handed the path the kernel gives for it.
* **Never the daemon's own.** No volume may be, contain or lie inside a path the daemon reads
  or serves (``VolumeRules.protected``: the state, smolvm data and control socket directories,
  the TLS files, ``--config``, the install), compared by device and inode up the
  descriptor's own parents.
* **Only what the requester could do itself** (the uid at the other end of the control
  socket, its groups as ``SO_PEERGROUPS`` gave them): a read-only volume must be a directory
  it may read and search, a read-write one a directory it may write, by the kernel's own rule
  on the directory's mode and ACL (``posixacl.permits``). A scoped peer's read-write volumes
  must moreover lie under a ``--volume-root``, and a TLS launcher's (no local uid) every
  volume; the daemon has none by default, so those are refused.
* **Reachable** (per-VM uids): every parent lets another uid pass (``o+x``), or the VM could
  not reach it; refused naming every closed parent.

Each refusal is one INVALID_ARGUMENT line naming the volume and the rule.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from enum import StrEnum

from attrs import frozen

from bottlenet.bottles import posixacl
from bottlenet.bottles.posixacl import Credentials
from bottlenet.errors import InvalidArgument, safe_repr
from bottlenet.paths import SymlinkInPath, fd_path, open_dir_nofollow
from vmctl.spec import Volume

#: Others may pass through a directory with this bit.
_TRAVERSE = 0o001
#: The most parents a walk up from a volume climbs (a path is at most 4096 bytes).
_MAX_DEPTH = 2048
_UP_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


#: How much of a path a message shows as it is (a user's own path; longer ones are hashed).
SHOWN_PATH = 512


def shown(path: str) -> str:
    """A volume's path for a message: quoted as it is when short and harmless."""
    return safe_repr(path, SHOWN_PATH)


class RequesterKind(StrEnum):
    """Who asks for a bottle's volumes, as the control socket knows it."""

    LOCAL = "local"  # a UNIX peer with full control (its uid from SO_PEERCRED)
    SCOPED = "scoped"  # a UNIX peer of --allow-uid UID:scoped
    REMOTE = "remote"  # a TLS launcher: a certificate, no local uid


@frozen
class Requester:
    """The party a create's volumes are checked for."""

    kind: RequesterKind
    credentials: Credentials | None = None

    @classmethod
    def daemon(cls) -> Requester:
        """The daemon's own uid (its in-process callers: tests, tools)."""
        return cls(
            RequesterKind.LOCAL,
            Credentials(os.geteuid(), os.getegid(), frozenset(os.getgroups())),
        )

    @classmethod
    def local(cls, uid: int, gid: int, groups: Sequence[int], *, scoped: bool) -> Requester:
        kind = RequesterKind.SCOPED if scoped else RequesterKind.LOCAL
        return cls(kind, Credentials(uid, gid, frozenset(groups)))

    def describe(self) -> str:
        if self.credentials is None:
            return "a TLS launcher"
        scoped = " (a scoped peer)" if self.kind is RequesterKind.SCOPED else ""
        return f"uid {self.credentials.uid}{scoped}"


@frozen
class VolumeRules:
    """The daemon's side of the rules: its own paths, and where scoped peers' read-write
    volumes and TLS launchers' volumes may lie (``--volume-root``; none by default)."""

    protected: tuple[str, ...] = ()
    roots: tuple[str, ...] = ()


@frozen
class ResolvedVolume:
    """One volume as resolved at create: its descriptor (``O_PATH``, open until the create
    ends), what it was (device, inode) and the volume as smolvm gets it (the kernel's path)."""

    label: str
    volume: Volume
    fd: int
    dev: int
    ino: int


class ResolvedVolumes:
    """A create's resolved volumes; :meth:`close` (or the ``with`` block) closes them."""

    def __init__(self, items: Sequence[ResolvedVolume] = ()) -> None:
        self.items = list(items)

    def __iter__(self) -> Iterator[ResolvedVolume]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def volumes(self) -> list[Volume]:
        return [r.volume for r in self.items]

    def specs(self) -> tuple[str, ...]:
        """``HOST:GUEST:ro|rw`` of each, the host the resolved path (the gate's argument)."""
        return tuple(
            f"{r.volume.host}:{r.volume.guest}:{'ro' if r.volume.read_only else 'rw'}"
            for r in self.items
        )

    def close(self) -> None:
        items, self.items = self.items, []
        for r in items:
            os.close(r.fd)

    def __enter__(self) -> ResolvedVolumes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def resolve(
    volumes: Sequence[Volume],
    labels: Sequence[str],
    requester: Requester,
    rules: VolumeRules,
    *,
    reachable: bool,
) -> ResolvedVolumes:
    """Resolve and check each volume (the module's rules; ``reachable``: per-VM uids). Blocks
    on the filesystem: run it off the reactor thread. InvalidArgument for the first refused;
    nothing stays open then."""
    resolved = ResolvedVolumes()
    protected = [_Protected.of(p) for p in rules.protected]
    try:
        for volume, label in zip(volumes, labels, strict=True):
            resolved.items.append(
                _resolve_one(volume, label, requester, rules, protected, reachable)
            )
    except BaseException:
        resolved.close()
        raise
    return resolved


def _resolve_one(
    volume: Volume,
    label: str,
    requester: Requester,
    rules: VolumeRules,
    protected: Sequence[_Protected],
    reachable: bool,
) -> ResolvedVolume:
    where = f"{label} {shown(volume.host)}"
    try:
        fd = open_dir_nofollow(volume.host)
    except SymlinkInPath as e:
        raise InvalidArgument(
            f"{where}: {shown(e.filename)} is a symlink, and volumes are resolved without "
            "following links: name the directory itself"
        ) from None
    except (FileNotFoundError, NotADirectoryError):
        raise InvalidArgument(f"{where}: not an existing directory") from None
    except OSError as e:
        raise InvalidArgument(f"{where}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        chain = _parents(fd)
        path = fd_path(fd)
        _check_protected(where, path, st, chain, protected)
        _check_requester(where, fd, st, chain, volume.read_only, requester, rules.roots)
        if reachable:
            _check_reachable(where, chain)
    except OSError as e:
        os.close(fd)
        raise InvalidArgument(f"{where}: {e.strerror or e}") from None
    except BaseException:
        os.close(fd)
        raise
    return ResolvedVolume(
        label, Volume(path, volume.guest, read_only=volume.read_only), fd, st.st_dev, st.st_ino
    )


@frozen
class _Parent:
    path: str
    dev: int
    ino: int
    mode: int


def _parents(fd: int, *, paths: bool = True) -> list[_Parent]:
    """The directories above ``fd``'s, nearest first, up to ``/``, as the kernel walks ``..``
    from the descriptor itself (never a path); ``paths``: with the kernel's path of each."""
    found: list[_Parent] = []
    here = os.dup(fd)
    try:
        st = os.fstat(here)
        for _ in range(_MAX_DEPTH):
            up = os.open("..", _UP_FLAGS, dir_fd=here)
            os.close(here)
            here = up
            parent = os.fstat(here)
            if (parent.st_dev, parent.st_ino) == (st.st_dev, st.st_ino):
                return found  # "/" is its own parent
            where = fd_path(here) if paths else ""
            found.append(_Parent(where, parent.st_dev, parent.st_ino, parent.st_mode))
            st = parent
        raise InvalidArgument("a volume deeper than any path")
    finally:
        os.close(here)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


@frozen
class _Protected:
    """One of the daemon's own paths as it is now: its real path, its device and inode and
    those of the directories above it (none when it does not exist yet). Trusted: its links
    followed."""

    path: str
    real: str
    ident: tuple[int, int] | None
    above: frozenset[tuple[int, int]]

    @classmethod
    def of(cls, path: str) -> _Protected:
        real = os.path.realpath(path)
        ident = _identity(real)
        above: frozenset[tuple[int, int]] = frozenset()
        if ident is not None:
            try:
                fd = os.open(os.path.dirname(real), _UP_FLAGS)
            except OSError:
                pass
            else:
                try:
                    st = os.fstat(fd)
                    chain = _parents(fd, paths=False)
                    above = frozenset({(st.st_dev, st.st_ino), *((p.dev, p.ino) for p in chain)})
                finally:
                    os.close(fd)
        return cls(path, real, ident, above)


def _check_protected(
    where: str,
    path: str,
    st: os.stat_result,
    chain: Sequence[_Parent],
    protected: Sequence[_Protected],
) -> None:
    """Neither the volume (resolved at ``path``) nor a directory above it is a protected path,
    and no protected path lies below it: by device and inode, or for a protected path that does
    not exist (yet) by its real path."""
    own = (st.st_dev, st.st_ino)
    above = {(p.dev, p.ino) for p in chain}
    for mine in protected:
        if mine.ident is not None:
            overlaps = mine.ident == own or mine.ident in above or own in mine.above
        else:
            overlaps = _overlaps(path, mine.real)
        if overlaps:
            raise InvalidArgument(f"{where}: overlaps the daemon's own path {shown(mine.path)}")


def _overlaps(a: str, b: str) -> bool:
    """True when one path is the other or lies inside it."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def _under_root(chain_ids: set[tuple[int, int]], roots: Sequence[str]) -> bool:
    return any((ident := _identity(r)) is not None and ident in chain_ids for r in roots)


def _check_requester(
    where: str,
    fd: int,
    st: os.stat_result,
    chain: Sequence[_Parent],
    read_only: bool,
    requester: Requester,
    roots: Sequence[str],
) -> None:
    """The requester's own rights on the directory, and ``--volume-root`` where it applies."""
    rule_roots = (
        f"under {', '.join(shown(r) for r in roots)}" if roots else "and the daemon has none"
    )
    ids = {(st.st_dev, st.st_ino), *((p.dev, p.ino) for p in chain)}
    if requester.kind is RequesterKind.REMOTE or requester.credentials is None:
        if not _under_root(ids, roots):
            raise InvalidArgument(
                f"{where}: a TLS launcher's volumes must lie under a --volume-root ({rule_roots})"
            )
        return
    if requester.kind is RequesterKind.SCOPED and not read_only and not _under_root(ids, roots):
        raise InvalidArgument(
            f"{where}: a scoped peer's read-write volumes must lie under a --volume-root "
            f"({rule_roots})"
        )
    want = posixacl.R | posixacl.X if read_only else posixacl.R | posixacl.W | posixacl.X
    may = posixacl.permits(posixacl.read(fd), st, requester.credentials, want)
    if may and not read_only and os.statvfs(fd).f_flag & os.ST_RDONLY:
        may = False
    if not may:
        verb = "read" if read_only else "write"
        raise InvalidArgument(
            f"{where}: {requester.describe()} may not {verb} it itself, and a "
            f"{'read-only' if read_only else 'read-write'} volume must be a directory its "
            f"requester may {verb}"
        )


def _check_reachable(where: str, chain: Sequence[_Parent]) -> None:
    """Under per-VM uids, before any machine: each parent lets another uid pass."""
    closed = [p.path for p in reversed(chain) if not p.mode & _TRAVERSE]
    if closed:
        names = [shown(c) for c in closed]
        raise InvalidArgument(
            f"{where}: the agent VM's own uid (per-VM uids, 2000000 and up) cannot pass "
            f"{', '.join(names)} (no o+x), so smolvm cannot serve this volume; "
            f"chmod o+x {' '.join(names)} or use a directory outside"
        )
