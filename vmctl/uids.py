"""smolvm's per-VM uid registry: reserve a VM's uid before its start, end it, give it back.

As root, ``machine start`` runs each VMM under a uid from ``<data>/.cache/smolvm/uids/``: a
file ``<uid>`` whose content is the VM's id (the last part of ``machine data-dir``), made under
``uids/.allocation.lock``. An entry that already names the VM is honoured, whatever uid it
names (pinned against the real binaries in ``tests/vmctl/test_contract.py``), so writing it
first tells the daemon the VMM's uid before the VMM exists, and lets the daemon choose it:
from blocks this data dir owns alone on the host (:mod:`vmctl.uidranges`).

The registry is root's (0755): no VMM uid can write it, unlike the VM's own directory and its
``.vm-uid``. So the registry (and the daemon's own records beside it) is where a uid is looked
up; ``.vm-uid`` is never trusted.

A uid goes through four states, each a directory of files named by uid beside smolvm's
entries (smolvm reads only numeric names):

- **fresh**: above the high-water mark ``.last-reserved`` in the newest block: never given out;
- **held** (``.held/<uid>``): reserved for one VM, with when (for telling its processes from
  anyone else's) and the VM's read-write volumes (where its files may stay);
- **retired** (a line of ``.retired``): its VM is deleted; what it left may still run or lie
  about;
- **free** (a range of ``.free``): proven unused (:meth:`UidPool.sweep`: no process, no
  System V IPC object, no IP socket, no file under the shared places, the daemon's bottles or
  its volumes), so it may be given out again.

A reservation takes a fresh uid first, then a free one: a uid comes back only once nothing of
its last VM is left (docs/security.md, V2). When fewer than EXTEND_BELOW are left the data
dir claims another block. ``machine delete`` frees smolvm's entry (its own doing). Blocking file
calls: run them off the reactor thread (the lock is smolvm's too).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import stat
import time
from collections.abc import Callable, Iterator, Sequence

from attrs import field, frozen

from vmctl.residue import (
    SHARED_PLACES,
    SMOLVM_TREE,
    ProcessFacts,
    file_holders,
    ipc_holders,
    process_facts,
    process_holders,
    processes_of,
    read_entry,
    socket_holders,
)
from vmctl.uidranges import (
    BLOCK_SIZE,
    DEFAULT_LEDGER,
    OWN_REGISTRIES,
    SMOLVM_FIRST_UID,
    Block,
    HostIds,
    InBlocks,
    Ledger,
    Owner,
    UidRangeError,
    block_of,
    check_blocks,
    claim_block,
    host_ids,
    write_atomically,
)

#: The first uid smolvm hands out itself, and the last of its own block (block 0: never
#: bottlenet's, see vmctl.uidranges).
FIRST_VM_UID = SMOLVM_FIRST_UID
LAST_VM_UID = FIRST_VM_UID + BLOCK_SIZE - 1
#: Above every uid a VMM may run as (some programs read a uid as signed).
MAX_VM_UID = 2**31 - 1
LOCK_NAME = ".allocation.lock"
#: The highest uid ever reserved from the newest block (bottlenet's; smolvm reads only numbers).
LAST_RESERVED = ".last-reserved"
#: The blocks this data dir owns, oldest first (``{"blocks": [1, 7]}``).
BLOCKS_FILE = ".uid-blocks"
#: One file per held uid (a VM exists for it: a few at a time).
HELD = ".held"
#: The retired uids, one JSON line each (appended at retire, rewritten by a sweep).
RETIRED = ".retired"
#: The free uids as ranges (``{"ranges": [[first, last], ...]}``), rewritten whole.
FREE = ".free"
VM_UID_FILE = ".vm-uid"
#: Entries and the high-water mark are root's, readable by all (as smolvm makes them).
ENTRY_MODE = 0o644
#: Fewer uids left than this (fresh and free): retired ones are looked at again.
SWEEP_BELOW = 8_192
#: Fewer left than this after a sweep: another block is claimed; if none can be, the daemon
#: warns (about 2,048 bottles before the end).
EXTEND_BELOW = 4_096
#: At most one sweep per this many seconds while uids are short (each walks the shared places).
SWEEP_EVERY = 60.0
#: A held record's size bound (its volumes included).
MAX_RECORD = 1 << 16
#: The retired log's size bound (a line per uid of a data dir's blocks, volumes included).
MAX_RETIRED = 1 << 26
#: How far up a process's parents are looked at for this data dir's VMM.
MAX_ANCESTORS = 16


class UidRegistryError(Exception):
    """The registry could not be read or written (the message says what and why)."""


@frozen
class UidReservation:
    """A VM's uid as written in smolvm's registry, and where its VM keeps its files."""

    uid: int
    registry: str
    vm_dir: str

    @property
    def started_file(self) -> str:
        """The ``.vm-uid`` smolvm writes at start (the VMM's uid owns it: never trust it)."""
        return os.path.join(self.vm_dir, VM_UID_FILE)


@frozen
class UidSupply:
    """How many uids this data dir can still give out (fresh and free), and where from."""

    left: int
    retired: int
    held: int
    blocks: tuple[int, ...]
    #: One thing a retired uid still held at the last sweep (for the daemon's log only: it
    #: may name a path of anyone's).
    example: str | None = None

    @property
    def short(self) -> bool:
        """So few left that the daemon warns (claiming another block failed)."""
        return bool(self.blocks) and self.left < EXTEND_BELOW

    def describe(self) -> str:
        if not self.blocks:
            return f"{self.left} VM uids left (no block claimed yet: the first VM claims one)"
        ranges = ", ".join(Block(b).describe().removeprefix("uids ") for b in self.blocks)
        return (
            f"{self.left} VM uids left (uids {ranges}; "
            f"{self.held} in use, {self.retired} waiting until nothing of theirs is left)"
        )


@frozen
class UidEnd:
    """What ending a uid's processes did: pids still alive after SIGKILL, and the processes
    left alone because nothing shows they are this data dir's machine's."""

    left: tuple[int, ...] = ()
    spared: tuple[int, ...] = ()


@frozen
class Sweep:
    """One look at the retired uids: how many became free, and why some did not (uid ->
    one thing it still holds)."""

    freed: int
    kept: dict[int, str] = field(factory=dict)


def registry_of(vm_dir: str) -> str:
    """The uid registry next to smolvm's VM dirs (``<data>/.cache/smolvm/{vms/<id>,uids}``)."""
    return os.path.join(os.path.dirname(os.path.dirname(vm_dir)), "uids")


def is_vm_uid(uid: int) -> bool:
    """A uid smolvm may run a VMM as at all (never root's, a user's or ``nobody``)."""
    return FIRST_VM_UID <= uid < MAX_VM_UID


def _boot_id() -> str:
    return read_entry("/proc/sys/kernel/random/boot_id")


def _ticks_now() -> int:
    """Now, in the clock ticks ``/proc/PID/stat`` counts process starts in."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def _numbers(path: str) -> list[int]:
    try:
        return sorted(int(e) for e in os.listdir(path) if e.isdigit())
    except FileNotFoundError:
        return []


def _read_record(path: str, limit: int = MAX_RECORD) -> dict[str, object] | None:
    """A held or retired record (root's; read as any registry file: no link, no FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        d = json.loads(os.read(fd, limit) or b"{}")
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return d if isinstance(d, dict) else None


def _new_file(path: str, text: str) -> None:
    """A new root-owned 0644 file (O_EXCL: never through a planted one), whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 ENTRY_MODE)  # fmt: skip
    os.fchmod(fd, ENTRY_MODE)  # whatever the umask: root's, readable, nobody else's
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _write_last(reg: str, uid: int) -> None:
    """The new high-water mark, replaced atomically and synced before the entry exists."""
    tmp = os.path.join(reg, LAST_RESERVED + ".new")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, ENTRY_MODE)
    os.fchmod(fd, ENTRY_MODE)
    with os.fdopen(fd, "w") as fh:
        fh.write(str(uid))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(reg, LAST_RESERVED))


class UidPool:
    """The uids one smolvm data dir gives its VMs (see the module's docstring).

    ``roots``: directories the daemon keeps files of VM uids in besides the VM dirs (its
    state dir's ``bottles/``, where a removal that could not finish moves a tree aside);
    ``shared``: the places every uid may write. ``ids`` reads what the host gives out."""

    def __init__(
        self,
        data_dir: str,
        *,
        ledger: str = DEFAULT_LEDGER,
        roots: Sequence[str] = (),
        shared: Sequence[str] = SHARED_PLACES,
        registries: Sequence[str] = OWN_REGISTRIES,
        proc: str = "/proc",
        ids: Callable[[], HostIds] = host_ids,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.data_dir = os.path.abspath(data_dir)
        tree = os.path.join(self.data_dir, *SMOLVM_TREE)
        self.registry = os.path.join(tree, "uids")
        self.vms = os.path.join(tree, "vms")
        self.ledger = Ledger(ledger)
        self.roots = tuple(roots)
        self.shared = tuple(shared)
        own = os.path.realpath(self.registry)
        self.registries = tuple(r for r in registries if os.path.realpath(r) != own)
        self.proc = proc
        self._ids = ids
        self._clock = clock
        self._last_sweep: float | None = None
        self._example: str | None = None

    @classmethod
    def of_vm_dir(cls, vm_dir: str, **kw: object) -> UidPool:
        """The pool of the data dir ``vm_dir`` (``<data>/.cache/smolvm/vms/<id>``) is in."""
        data = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(vm_dir))))
        return cls(data, **kw)  # type: ignore[arg-type]

    def _path(self, *parts: str) -> str:
        return os.path.join(self.registry, *parts)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """smolvm's allocation lock over the registry (made 0755, and its state dirs)."""
        try:
            os.makedirs(self.registry, mode=0o755, exist_ok=True)
            os.makedirs(self._path(HELD), mode=0o755, exist_ok=True)
            fd = os.open(self._path(LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise UidRegistryError(
                f"smolvm's uid registry {self.registry}: {e.strerror or e}"
            ) from None
        with os.fdopen(fd, "r+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    # -- the blocks ---------------------------------------------------------------------

    def blocks(self) -> tuple[int, ...]:
        """The blocks this data dir owns, oldest first (empty: none claimed yet)."""
        d = _read_record(self._path(BLOCKS_FILE)) or {}
        blocks = d.get("blocks")
        if not isinstance(blocks, list):
            return ()
        return tuple(b for b in blocks if isinstance(b, int) and b > 0)

    def _replace(self, name: str, data: object) -> None:
        """One of the registry's own files replaced whole (synced, then renamed)."""
        fd = os.open(self.registry, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            write_atomically(fd, name, json.dumps(data).encode())
        finally:
            os.close(fd)

    def _write_blocks(self, blocks: Sequence[int]) -> None:
        self._replace(BLOCKS_FILE, {"blocks": list(blocks)})

    def _free(self) -> list[tuple[int, int]]:
        """The free uids, as sorted ranges (an unreadable file: none)."""
        d = _read_record(self._path(FREE), 1 << 22) or {}
        ranges = d.get("ranges")
        if not isinstance(ranges, list):
            return []
        out = [
            (r[0], r[1]) for r in ranges
            if isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r)
            and is_vm_uid(r[0]) and r[0] <= r[1] < MAX_VM_UID
        ]  # fmt: skip
        return sorted(out)

    def _add_free(self, uids: Sequence[int]) -> None:
        merged: list[list[int]] = []
        for first, last in sorted([*self._free(), *((u, u) for u in uids)]):
            if merged and first <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], last)
            else:
                merged.append([first, last])
        self._replace(FREE, {"ranges": merged})

    def _retired(self) -> dict[int, tuple[str, ...] | None]:
        """Retired uid -> its VM's volumes (None: not known); the last line of a uid wins."""
        out: dict[int, tuple[str, ...] | None] = {}
        try:
            fd = os.open(self._path(RETIRED), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return out
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return out
            for line in f.read(MAX_RETIRED).splitlines():
                try:
                    d = json.loads(line)
                    uid = d["uid"]
                except (ValueError, KeyError, TypeError):
                    continue
                if isinstance(uid, int) and is_vm_uid(uid):
                    out[uid] = _volumes(d)
        return out

    def _append_retired(self, records: Sequence[dict[str, object]]) -> None:
        fd = os.open(
            self._path(RETIRED),
            os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
            ENTRY_MODE,
        )
        try:
            os.fchmod(fd, ENTRY_MODE)
            os.write(fd, b"".join(json.dumps(r).encode() + b"\n" for r in records))
            os.fsync(fd)
        finally:
            os.close(fd)

    def _retire_held(self, uids: Sequence[int]) -> None:
        """Held uids become retired: their records appended, then their files removed."""
        records = []
        for uid in uids:
            record = _read_record(self._path(HELD, str(uid)))
            if record is not None:
                records.append({**record, "uid": uid})
        if records:
            self._append_retired(records)
        for uid in uids:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(HELD, str(uid)))

    def check(self) -> UidSupply:
        """At start: the blocks this data dir recorded are still its alone on the host (the
        ledger, ``/etc/subuid``, ``/etc/subgid``, the system's users and groups, root's own
        smolvm); UidRangeError, one line naming the conflict, otherwise."""
        blocks = self.blocks()
        if blocks:
            check_blocks(
                self.ledger, Owner.of(self.registry), blocks, self._ids(),
                registries=self.registries,
            )  # fmt: skip
        return self.supply()

    def _extend(self) -> int:
        """Claim one more block (the registry lock held); its index."""
        blocks = self.blocks()
        block = claim_block(
            self.ledger, Owner.of(self.registry), self._ids(),
            registries=self.registries, prove=self._unused_blocks,
        )  # fmt: skip
        if blocks:  # what the old block never gave out stays this data dir's
            old = Block(blocks[-1])
            self._add_free(range(max(self._mark(old), old.first - 1) + 1, old.last + 1))
        self._write_blocks([*blocks, block.index])
        _write_last(self.registry, block.first - 1)
        return block.index

    def _unused_blocks(self, blocks: Sequence[Block]) -> set[int]:
        """The blocks (of data dirs that are gone) none of whose uids holds anything."""
        within = InBlocks(frozenset(b.index for b in blocks))
        walked = file_holders(within, [*self.shared, *self.roots])
        if walked.incomplete:
            return set()
        used = set(walked.owners)
        for holders in (process_holders, ipc_holders, socket_holders):
            used |= set(holders(within, self.proc))
        return {b.index for b in blocks} - {block_of(u).index for u in used}

    def _mark(self, block: Block) -> int:
        text = read_entry(self._path(LAST_RESERVED))
        return int(text) if text.isdigit() else block.first - 1

    # -- counting -----------------------------------------------------------------------

    def _fresh(self, blocks: Sequence[int]) -> int:
        if not blocks:
            return 0
        block = Block(blocks[-1])
        return block.last - max(self._mark(block), block.first - 1)

    def supply(self) -> UidSupply:
        """How many uids are left, held and retired (reads the registry; no lock)."""
        blocks = self.blocks()
        fresh = self._fresh(blocks) if blocks else BLOCK_SIZE  # the first VM claims a block
        return UidSupply(
            left=fresh + sum(last - first + 1 for first, last in self._free()),
            retired=len(self._retired()),
            held=len(_numbers(self._path(HELD))),
            blocks=blocks,
            example=self._example,
        )

    # -- reserving ----------------------------------------------------------------------

    def reserve(self, vm_dir: str, volumes: Sequence[str] = ()) -> int:
        """The uid ``machine start`` will drop the VM of ``vm_dir`` to: its entry, else a
        fresh uid, else a free one. ``volumes``: the VM's read-write volumes (where files of
        its uid may stay after it is gone)."""
        vm_id = os.path.basename(vm_dir)
        try:
            return self._reserve(vm_id, tuple(volumes))
        except UidRangeError as e:
            raise UidRegistryError(str(e)) from None
        except OSError as e:
            raise UidRegistryError(
                f"smolvm's uid registry {self.registry}: {e.strerror or e}"
            ) from None

    def _reserve(self, vm_id: str, volumes: tuple[str, ...]) -> int:
        swept = False
        while True:
            with self._locked():
                for uid in _numbers(self.registry):
                    if read_entry(self._path(str(uid))) == vm_id:
                        return uid
                if not self.blocks():
                    self._extend()
                supply = self.supply()
                if not swept and self._sweep_due(supply):
                    pass  # sweep outside the lock (it walks the shared places), then again
                else:
                    return self._take(vm_id, volumes, supply)
            self.sweep()
            swept = True

    def _sweep_due(self, supply: UidSupply) -> bool:
        if supply.left >= SWEEP_BELOW or not supply.retired:
            return False
        last = self._last_sweep
        return supply.left == 0 or last is None or self._clock() - last >= SWEEP_EVERY

    def _take(self, vm_id: str, volumes: tuple[str, ...], supply: UidSupply) -> int:
        """A fresh uid, else the lowest free one, written held then entered (lock held)."""
        why = "no block was needed"
        if supply.left < EXTEND_BELOW:
            try:
                self._extend()
            except UidRangeError as e:
                why = str(e)
        uid = self._fresh_uid() or self._free_uid()
        if uid is None:
            raise UidRegistryError(
                f"smolvm's uid registry {self.registry} is used up: "
                f"{len(self._retired())} retired uids still hold something of "
                f"their VMs, and no further block could be claimed ({why}); "
                "docs/operations.md, VM uids"
            )
        record = {"vm": vm_id, "boot": _boot_id(), "at": _ticks_now(), "volumes": volumes}
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(HELD, str(uid)))  # a crash between two earlier steps
        _new_file(self._path(HELD, str(uid)), json.dumps(record))
        try:
            _new_file(self._path(str(uid)), vm_id)
        except FileExistsError:  # pragma: no cover - only smolvm itself writes entries too
            os.unlink(self._path(HELD, str(uid)))
            raise UidRegistryError(f"uid {uid} appeared in {self.registry} meanwhile") from None
        return uid

    def _fresh_uid(self) -> int | None:
        """Above every uid the newest block gave out (the mark written first, synced)."""
        blocks = self.blocks()
        if not blocks:
            return None
        block = Block(blocks[-1])
        for uid in range(max(self._mark(block), block.first - 1) + 1, block.last + 1):
            _write_last(self.registry, uid)
            if not os.path.lexists(self._path(str(uid))):
                return uid
        return None

    def _free_uid(self) -> int | None:
        """The lowest free uid, taken out of ``.free`` (rewritten first)."""
        ranges = self._free()
        while ranges:
            first, last = ranges[0]
            ranges[0:1] = [(first + 1, last)] if first < last else []
            self._replace(FREE, {"ranges": [list(r) for r in ranges]})
            if not os.path.lexists(self._path(str(first))):
                return first
        return None

    def registered(self, vm_dir: str) -> int | None:
        """The uid smolvm's (root-owned) registry holds for the VM of ``vm_dir``, or None."""
        vm_id = os.path.basename(vm_dir)
        try:
            taken = sorted(int(e) for e in os.listdir(self.registry) if e.isdigit())
        except FileNotFoundError:
            return None
        except OSError as e:
            raise UidRegistryError(
                f"smolvm's uid registry {self.registry}: {e.strerror or e}"
            ) from None
        for uid in taken:
            if is_vm_uid(uid) and read_entry(self._path(str(uid))) == vm_id:
                return uid
        return None

    # -- ending and giving back ---------------------------------------------------------

    def _record(self, uid: int) -> dict[str, object] | None:
        return _read_record(self._path(HELD, str(uid)))

    def _owned(self, uid: int) -> bool:
        return any(uid in Block(b) for b in self.blocks())

    def _names_a_vm(self, facts: ProcessFacts) -> bool:
        """The process shows one of this data dir's VMs: an argument or its working
        directory below its VM dirs (the VMM: ``_boot-vm <vm-dir>/...``)."""
        roots = {self.vms + os.sep, os.path.realpath(self.vms) + os.sep}
        paths = [*facts.argv, facts.cwd or ""]
        return any(p.startswith(r) for p in paths for r in roots)

    def _ours(self, facts: ProcessFacts, born_after: int | None) -> bool:
        """Whether a process of the uid is this data dir's machine's: it or a parent names
        one of its VMs, or (a uid of this data dir's own blocks) it started after the
        uid was reserved, since when no one else may have been given it."""
        if born_after is not None and facts.start > born_after:
            return True
        seen: ProcessFacts | None = facts
        for _ in range(MAX_ANCESTORS):
            if seen is None:
                return False
            if self._names_a_vm(seen):
                return True
            if seen.ppid <= 1:
                return False
            seen = process_facts(seen.ppid, self.proc)
        return False

    def end(self, uid: int) -> UidEnd:
        """Kill every process of a per-VM uid this data dir's machine left (a ``setsid``
        child of its VMM, say), then look again. Root only; blocking.

        When every process of the uid is the machine's, the kill is ``kill(-1, SIGKILL)``
        from a child that has become ``uid``: the kernel signals them all in one pass (no
        fork escapes it). A process that shows no sign of this data dir is never signalled
        (``spared``): another registry's VM, or a user's, may run as that uid."""
        if uid in (0, os.geteuid()) or not is_vm_uid(uid):
            raise UidRegistryError(f"refusing to end the processes of uid {uid}")
        pids = set(processes_of({uid}, self.proc))
        if not pids:
            return UidEnd()
        born_after = self._reserved_at(uid)
        spared: set[int] = set()
        for _ in range(3):  # a process forked meanwhile is looked at in the next round
            facts = [f for p in sorted(pids) if (f := process_facts(p, self.proc)) is not None]
            spared |= {f.pid for f in facts if not self._ours(f, born_after)}
            if not spared:
                _kill_all_as(uid)
            else:
                for f in facts:
                    if f.pid not in spared:
                        _kill_one(f, self.proc)
            pids = set(processes_of({uid}, self.proc)) - spared
            if not pids:
                break
        left = tuple(sorted(set(processes_of({uid}, self.proc)) - spared))
        return UidEnd(left=left, spared=tuple(sorted(spared)))

    def _reserved_at(self, uid: int) -> int | None:
        """When ``uid`` was reserved, in ``/proc`` start ticks (-1: in an earlier boot), for
        a uid of this data dir's own blocks with a record; else None. A process that started
        in the very tick of the reservation does not count as after it."""
        record = self._record(uid) or {}
        at = record.get("at")
        if not self._owned(uid) or not isinstance(at, int):
            return None
        return at if record.get("boot") == _boot_id() else -1

    def retire(self, uid: int, prove: bool = False) -> bool:
        """The VM of ``uid`` is deleted: its uid waits until nothing of it is left. With
        ``prove`` (a create that failed gives its reservation back) it is looked at at once;
        whether it is free again."""
        try:
            with self._locked():
                self._retire_held([uid])
            if not prove:
                return False
            return uid in self._sweep({uid}).freed_uids
        except OSError as e:
            raise UidRegistryError(
                f"smolvm's uid registry {self.registry}: {e.strerror or e}"
            ) from None

    def sweep(self) -> Sweep:
        """Look at every retired uid (and a held one whose entry smolvm removed: a delete
        the daemon did not see through); the ones proven unused become free."""
        try:
            return self._sweep(None).result
        except OSError as e:
            raise UidRegistryError(
                f"smolvm's uid registry {self.registry}: {e.strerror or e}"
            ) from None

    def _sweep(self, only: set[int] | None) -> _SweepRun:
        with self._locked():
            entries = set(_numbers(self.registry))
            # A held uid without its entry: smolvm's delete removed it, the retire never came.
            self._retire_held([u for u in _numbers(self._path(HELD)) if u not in entries])
            volumes = {u: v for u, v in self._retired().items() if only is None or u in only}
        if only is None:
            self._last_sweep = self._clock()
        if not volumes:
            return _SweepRun(Sweep(0), set())
        kept = self._holdings(set(volumes), volumes, entries)
        if only is None:
            self._example = next((f"uid {u}: {w}" for u, w in sorted(kept.items())), None)
        with self._locked():
            entries = set(_numbers(self.registry))
            retired = self._retired()
            freed = {u for u in volumes if u not in kept and u in retired and u not in entries}
            if freed:
                self._add_free(sorted(freed))  # a crash here: a uid both free and retired
                self._replace_retired({u: v for u, v in retired.items() if u not in freed})
        return _SweepRun(Sweep(len(freed), kept), freed)

    def _replace_retired(self, retired: dict[int, tuple[str, ...] | None]) -> None:
        fd = os.open(self.registry, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        lines = b"".join(
            json.dumps({"uid": u, "volumes": None if v is None else list(v)}).encode() + b"\n"
            for u, v in sorted(retired.items())
        )
        try:
            write_atomically(fd, RETIRED, lines)
        finally:
            os.close(fd)

    def _holdings(
        self, uids: set[int], volumes: dict[int, tuple[str, ...] | None], entries: set[int]
    ) -> dict[int, str]:
        """uid -> one thing it still holds, or why that cannot be known."""
        kept = {u: "still in smolvm's registry" for u in uids & entries}
        kept.update({u: w for u, w in process_holders(uids, self.proc).items() if u not in kept})
        for holders in (ipc_holders(uids, self.proc), socket_holders(uids, self.proc)):
            kept.update({u: w for u, w in holders.items() if u not in kept})
        own = [v for vs in volumes.values() if vs for v in vs]
        walked = file_holders(uids, [*self.shared, *self.roots, *own])
        for uid in sorted(uids - set(kept)):
            mine = volumes[uid]
            if mine is None:
                kept[uid] = "its record is unreadable (its volumes are not known)"
            elif uid in walked.owners:
                kept[uid] = f"file {walked.owners[uid]}"
            elif any(r in walked.incomplete for r in (*self.shared, *self.roots, *mine)):
                kept[uid] = "a place it may have written could not be read whole"
        return kept


@frozen
class _SweepRun:
    result: Sweep
    freed_uids: set[int]


def _volumes(d: dict[str, object]) -> tuple[str, ...] | None:
    """A record's volumes (None: not known)."""
    vols = d.get("volumes", [])
    if not isinstance(vols, list) or not all(isinstance(v, str) for v in vols):
        return None
    return tuple(v for v in vols if os.path.isabs(v))


def _kill_all_as(uid: int) -> None:
    """``kill(-1, SIGKILL)`` from a child that has become ``uid`` (every process of it)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: drop to the uid, signal, exit
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _kill_one(facts: ProcessFacts, proc: str) -> None:
    """SIGKILL one process through a pidfd, once it is checked to be the same process."""
    try:
        fd = os.pidfd_open(facts.pid)
    except OSError:
        return  # gone
    try:
        now = process_facts(facts.pid, proc)
        if now is not None and now.start == facts.start:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)


def reserve_vm_uid(vm_dir: str, ledger: str = DEFAULT_LEDGER) -> int:
    """:meth:`UidPool.reserve` for the data dir ``vm_dir`` is in (no volumes)."""
    return UidPool.of_vm_dir(vm_dir, ledger=ledger).reserve(vm_dir)


def registered_vm_uid(vm_dir: str) -> int | None:
    """The uid smolvm's (root-owned) registry holds for the VM of ``vm_dir``, or None."""
    return UidPool.of_vm_dir(vm_dir).registered(vm_dir)


__all__ = [
    "FIRST_VM_UID",
    "LAST_VM_UID",
    "UidEnd",
    "UidPool",
    "UidRangeError",
    "UidRegistryError",
    "UidReservation",
    "UidSupply",
    "registered_vm_uid",
    "registry_of",
    "reserve_vm_uid",
]
