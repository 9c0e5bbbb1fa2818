"""Which uids a smolvm data dir may give its VMs: blocks of its own, recorded host-wide.

smolvm's per-VM uid registry is per data dir, and every data dir starts at 2000000: a second
daemon, or root's own smolvm (``/var/lib/smolvm`` for ``serve``, ``~/.cache`` for the CLI),
hands out the same uids. A uid is all the kernel checks, so a destroy that ends a uid's
processes, or an endpoint that admits a uid, would reach the other registry's VMs too
(``docs/security.md``, V2). bottlenet never lets smolvm pick: it writes each VM's entry before
the start, and smolvm honours the uid an entry names wherever it lies (1.32.2 and 1.37.3; an
entry for 3000000 ran the VMM as 3000000, ``tests/vmctl/test_contract.py``).

So each data dir takes blocks of 65,536 uids from a **host-wide ledger**: a directory (root's,
``/var/lib/bottlenet/uid-ranges`` by default: it must outlive a reboot, as the files those
uids own do) holding one file per block, named by its number, that names the data dir owning
it. Block 0 (2000000-2065535) is never taken: it is where any smolvm bottlenet does not drive
hands out its uids. A block is taken only when it holds no uid or gid the system knows
(``getpwent``/``getgrent``, once each), no ``/etc/subuid`` or ``/etc/subgid`` range, and no
entry of root's own smolvm registries. Blocking file calls: at start, or off the reactor thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import json
import os
import pwd
import stat
from collections.abc import Callable, Iterator, Sequence

from attrs import frozen

#: smolvm's first per-VM uid (``VM_UID_BASE``); it hands out the lowest free one from here.
SMOLVM_FIRST_UID = 2_000_000
BLOCK_SIZE = 65_536
#: Block 0 is smolvm's own (any data dir bottlenet does not drive); bottlenet's start at 1.
FIRST_BLOCK = 1
#: The last block whose uids stay below 2**31 (some programs read a uid as signed).
LAST_BLOCK = (2**31 - SMOLVM_FIRST_UID) // BLOCK_SIZE - 1
DEFAULT_LEDGER = "/var/lib/bottlenet/uid-ranges"
LEDGER_LOCK = ".lock"
#: The registries of root's own smolvm: ``smolvm serve`` (``/var/lib/smolvm``), the CLI as
#: root (``~/.cache``). Their entries are looked at; nothing else of theirs is touched.
OWN_REGISTRIES = ("/var/lib/smolvm/.cache/smolvm/uids", "/root/.cache/smolvm/uids")
#: A ledger file is a few hundred bytes; more is not one of ours.
MAX_RECORD = 4096
#: The most blocks of gone data dirs looked at in one claim (one look at the host for all).
MAX_STALE = 64


class UidRangeError(Exception):
    """A uid block could not be claimed or checked (the message is one line saying why)."""


@frozen
class Block:
    """One block of 65,536 uids."""

    index: int

    @property
    def first(self) -> int:
        return SMOLVM_FIRST_UID + self.index * BLOCK_SIZE

    @property
    def last(self) -> int:
        return self.first + BLOCK_SIZE - 1

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.first <= uid <= self.last

    def describe(self) -> str:
        return f"uids {self.first}-{self.last}"


def block_of(uid: int) -> Block:
    """The block ``uid`` lies in."""
    return Block((uid - SMOLVM_FIRST_UID) // BLOCK_SIZE)


# -- what the host already uses -------------------------------------------------------------


@frozen
class HostIds:
    """The ids the host already gives out: subordinate ranges and known users and groups."""

    #: (first, last, who) of every ``/etc/subuid`` and ``/etc/subgid`` line.
    ranges: tuple[tuple[int, int, str], ...]
    #: (id, who), sorted, of every user and group the system knows.
    known: tuple[tuple[int, str], ...]

    def conflict(self, block: Block) -> str | None:
        """The first thing of the host's inside ``block`` (None: nothing)."""
        for first, last, who in self.ranges:
            if first <= block.last and block.first <= last:
                return f"{who} ({first}-{last})"
        for uid, who in self.known:
            if uid in block:
                return f"{who} ({uid})"
        return None


def _subordinate(path: str) -> list[tuple[int, int, str]]:
    """``name:first:count`` lines (a malformed one is skipped, as shadow-utils does)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 20).splitlines()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise UidRangeError(f"cannot read {path}: {e.strerror}") from None
    out = []
    for line in lines:
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() and int(parts[2]):
            first = int(parts[1])
            out.append((first, first + int(parts[2]) - 1, f"{path} range of {parts[0][:64]}"))
    return out


def host_ids(etc: str = "/etc") -> HostIds:
    """What the host gives out now: one pass over every user and every group (``getpwent``,
    ``getgrent``: also what NSS enumerates), and the subordinate id files."""
    ranges = _subordinate(os.path.join(etc, "subuid")) + _subordinate(os.path.join(etc, "subgid"))
    known = {(p.pw_uid, f"user {p.pw_name[:64]}") for p in pwd.getpwall()}
    known |= {(g.gr_gid, f"group {g.gr_name[:64]}") for g in grp.getgrall()}
    return HostIds(tuple(ranges), tuple(sorted(known)))


def registry_conflict(block: Block, registries: Sequence[str]) -> str | None:
    """An entry of another smolvm registry inside ``block`` (None: none)."""
    for reg in registries:
        try:
            names = os.listdir(reg)
        except OSError:
            continue
        for name in names:
            if name.isdigit() and int(name) in block:
                return f"smolvm registry {reg} (uid {name})"
    return None


# -- the ledger -------------------------------------------------------------------------------


@frozen
class Owner:
    """A data dir's uid registry, by path and by identity (a moved data dir is still itself)."""

    registry: str
    dev: int
    ino: int

    @classmethod
    def of(cls, registry: str) -> Owner:
        st = os.stat(registry)
        return cls(os.path.realpath(registry), st.st_dev, st.st_ino)

    def same(self, other: Owner) -> bool:
        return (self.dev, self.ino) == (other.dev, other.ino)

    def gone(self) -> bool:
        """Its registry no longer exists (another directory at its path is not it)."""
        try:
            st = os.stat(self.registry)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return (st.st_dev, st.st_ino) != (self.dev, self.ino)


@frozen
class InBlocks:
    """Membership in some blocks (what :mod:`vmctl.residue` looks for, 65,536 uids each)."""

    indices: frozenset[int]

    def __contains__(self, uid: object) -> bool:
        return (
            isinstance(uid, int)
            and uid >= SMOLVM_FIRST_UID
            and (uid - SMOLVM_FIRST_UID) // BLOCK_SIZE in self.indices
        )


def _read_small(dir_fd: int, name: str) -> bytes | None:
    """A regular file's bytes (at most MAX_RECORD), never through a link; None otherwise."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)  # fmt: skip
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, MAX_RECORD)
    finally:
        os.close(fd)


def write_atomically(dir_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """``name`` in the directory replaced by ``data`` in one rename, synced first."""
    tmp = f".{name}.new"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode, dir_fd=dir_fd)  # fmt: skip
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


class Ledger:
    """The host's record of which data dir owns which uid block (one file per block)."""

    def __init__(self, path: str = DEFAULT_LEDGER) -> None:
        self.path = os.path.abspath(path)

    def _open(self) -> int:
        """The ledger directory, made 0755 if missing; refused unless it is root's (or the
        daemon's) and nobody else may write it: a forged entry would hand uids around."""
        try:
            os.makedirs(self.path, mode=0o755, exist_ok=True)
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise UidRangeError(f"uid ledger {self.path}: {e.strerror or e}") from None
        st = os.fstat(fd)
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            os.close(fd)
            raise UidRangeError(
                f"uid ledger {self.path}: must be root's and writable by nobody else "
                f"(owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
            )
        return fd

    @contextlib.contextmanager
    def locked(self) -> Iterator[int]:
        """The ledger held by this process (``flock`` on its ``.lock``); yields its fd."""
        fd = self._open()
        try:
            lock = os.open(LEDGER_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                           0o600, dir_fd=fd)  # fmt: skip
        except OSError as e:
            os.close(fd)
            raise UidRangeError(f"uid ledger {self.path}: {e.strerror or e}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(lock)
            os.close(fd)

    def owners(self, fd: int) -> dict[int, Owner | None]:
        """Block -> the registry owning it (None: a file that is not a ledger record)."""
        out: dict[int, Owner | None] = {}
        for name in os.listdir(fd):
            if not name.isdigit():
                continue
            raw = _read_small(fd, name)
            try:
                d = json.loads(raw or b"")
                out[int(name)] = Owner(str(d["registry"]), int(d["dev"]), int(d["ino"]))
            except (ValueError, KeyError, TypeError):
                out[int(name)] = None
        return out

    def record(self, fd: int, block: Block, owner: Owner) -> None:
        data = {"registry": owner.registry, "dev": owner.dev, "ino": owner.ino,
                "uids": block.describe()}  # fmt: skip
        write_atomically(fd, str(block.index), json.dumps(data).encode())

    def release(self, registry: str) -> list[int]:
        """Drop every block recorded for ``registry`` (by path); the blocks released. For a
        data dir that is gone for good and whose uids own nothing any more."""
        real = os.path.realpath(registry)
        with self.locked() as fd:
            gone = [k for k, o in self.owners(fd).items() if o is not None and o.registry == real]
            for k in gone:
                os.unlink(str(k), dir_fd=fd)
            return gone


def claim_block(
    ledger: Ledger,
    owner: Owner,
    ids: HostIds,
    *,
    registries: Sequence[str] = OWN_REGISTRIES,
    prove: Callable[[Sequence[Block]], set[int]] | None = None,
) -> Block:
    """The lowest block the host does not use and no data dir owns, recorded for ``owner``;
    UidRangeError when none is left. A block whose data dir is gone (its registry removed)
    counts as owned by no one once ``prove`` shows nothing of its uids is left (a process,
    an IPC object, a socket, a file in the shared places)."""

    def usable(block: Block) -> bool:
        return not ids.conflict(block) and not registry_conflict(block, registries)

    with ledger.locked() as fd:
        taken = ledger.owners(fd)
        new = next(
            (Block(k) for k in range(FIRST_BLOCK, LAST_BLOCK + 1)
             if k not in taken and usable(Block(k))),
            None,
        )  # fmt: skip
        limit = LAST_BLOCK + 1 if new is None else new.index
        stale = [
            Block(k)
            for k, o in sorted(taken.items())
            if k < limit and o is not None and not o.same(owner) and o.gone()
        ][:MAX_STALE]
        stale = [b for b in stale if usable(b)]
        clean = prove(stale) if stale and prove is not None else set()
        block = next((b for b in stale if b.index in clean), new)
        if block is None:
            raise UidRangeError(
                f"uid ledger {ledger.path}: no block of {BLOCK_SIZE} uids is free on this host"
            )
        ledger.record(fd, block, owner)
        return block


def check_blocks(
    ledger: Ledger,
    owner: Owner,
    blocks: Sequence[int],
    ids: HostIds,
    *,
    registries: Sequence[str] = OWN_REGISTRIES,
) -> None:
    """The blocks a data dir recorded are still its alone; UidRangeError (one line naming the
    conflict) otherwise. A block the ledger lost is recorded again; a moved data dir (same
    directory, new path) keeps its blocks."""
    with ledger.locked() as fd:
        taken = ledger.owners(fd)
        for index in blocks:
            block = Block(index)
            where = f"{owner.registry}: its {block.describe()}"
            recorded = taken.get(index, "missing")
            if recorded is None:
                raise UidRangeError(f"{where}: {ledger.path}/{index} is not a ledger record")
            if isinstance(recorded, Owner) and not recorded.same(owner):
                raise UidRangeError(
                    f"{where} are given to another smolvm data dir, {recorded.registry} "
                    f"({ledger.path}/{index}); one data dir per block"
                )
            why = ids.conflict(block) or registry_conflict(block, registries)
            if why is not None:
                raise UidRangeError(f"{where} overlap {why}; VM uids must be no one else's")
            if recorded != owner:
                ledger.record(fd, block, owner)
