"""What smolvm's per-VM uid model can leave behind: reservations and processes without a VM.

A teardown is complete only when no uid entry in smolvm's registry names a VM whose directory
is gone, and no process runs as such a uid (it could reach what the next VM under that uid is
given). Only this data dir's registry is read: a smolvm data dir bottlenet does not drive hands
out uids of its own from 2000000, so a per-VM uid seen in ``/proc`` alone proves nothing.
``bottlenetctl selftest`` asks for this after its throwaway bottle is destroyed.

What else a uid may still hold (a process with it as any of its ids, a System V IPC object,
an IP socket, a file under the shared places or a volume) is what ``vmctl.uids`` asks before
it gives a retired uid out again. Blocking file calls: run them off the reactor thread.

Every file here may be written by a VMM uid, so nothing is followed or read whole: entries are
opened ``O_NOFOLLOW|O_NONBLOCK`` (a FIFO never blocks), only regular files are read, and at most
64 bytes of each.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Container, Iterable

from attrs import frozen

#: Where smolvm keeps its VM dirs and its uid registry, under its data dir.
SMOLVM_TREE = (".cache", "smolvm")
#: The most entries of a directory looked at (a registry holds at most 65,536 uids).
MAX_ENTRIES = 70_000
#: The places every uid may leave a file in (a per-VM uid has no home of its own).
SHARED_PLACES = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock")
#: The most directory entries one look at files walks, every root together.
MAX_WALK = 1_000_000
#: The System V IPC tables (objects outlive their creator) and the columns naming owners.
SYSV_IPC = ("shm", "sem", "msg")
_IPC_OWNERS = ("uid", "gid", "cuid", "cgid")
#: The socket tables whose lines carry the owner's uid (the 8th field; the daemon's network
#: namespace only). A UNIX socket lives only as long as a process holds it, or as a file.
SOCKET_TABLES = ("tcp", "tcp6", "udp", "udp6", "raw", "raw6", "udplite", "udplite6")


def read_entry(path: str) -> str:
    """A registry file's first bytes; '' when it is missing, unreadable or not a regular file
    (never follows a link nor blocks on a FIFO). A VMM uid may have written it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as fh:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return ""
            return fh.read(64).decode("ascii", "replace").strip()
        except OSError:
            return ""


def _entries(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [e.name for _, e in zip(range(MAX_ENTRIES), it, strict=False)]
    except OSError:
        return []


def stale_reservations(data_dir: str) -> dict[int, str]:
    """Registry entries (uid -> VM id) whose VM directory no longer exists."""
    tree = os.path.join(data_dir, *SMOLVM_TREE)
    registry, vms = os.path.join(tree, "uids"), os.path.join(tree, "vms")
    stale: dict[int, str] = {}
    for entry in _entries(registry):
        if not entry.isdigit():
            continue
        vm_id = read_entry(os.path.join(registry, entry))
        if "/" in vm_id or vm_id in ("", ".", ".."):
            stale[int(entry)] = vm_id or "?"
        elif not os.path.isdir(os.path.join(vms, vm_id)):
            stale[int(entry)] = vm_id
    return stale


def _ids(status_text: str, key: str) -> tuple[int, ...]:
    """The four ids (real, effective, saved, filesystem) of a ``Uid:`` or ``Gid:`` line."""
    for line in status_text.splitlines():
        if line.startswith(key):
            return tuple(int(f) for f in line.split()[1:5] if f.isdigit())
    return ()


def _real_uid(status_text: str) -> int | None:
    """The real uid of a live process (None: unreadable, or a zombie: it holds nothing)."""
    uid = None
    for line in status_text.splitlines():
        if line.startswith("State:") and line.split()[1:2] in (["Z"], ["X"]):
            return None
        if line.startswith("Uid:"):
            fields = line.split()
            uid = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
    return uid


def processes_of(uids: set[int], proc_root: str = "/proc") -> dict[int, int]:
    """The live processes (pid -> uid) whose real uid is one of ``uids`` (a VMM uid cannot
    take another uid, so the real one is enough; zombies are not counted)."""
    found: dict[int, int] = {}
    if not uids:
        return found
    for entry in _entries(proc_root):
        if not entry.isdigit():
            continue
        path = os.path.join(proc_root, entry, "status")
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                uid = _real_uid(f.read(4096))
        except OSError:
            continue  # gone meanwhile
        if uid is not None and uid in uids:
            found[int(entry)] = uid
    return found


@frozen
class ProcessFacts:
    """What ``/proc`` shows of one live process, for telling whose it is."""

    pid: int
    ppid: int
    uids: tuple[int, ...]
    start: int  # clock ticks after boot (``/proc/PID/stat`` field 22)
    argv: tuple[str, ...]
    cwd: str | None


def process_facts(pid: int, proc_root: str = "/proc") -> ProcessFacts | None:
    """The facts of ``pid``, or None when it is gone or a zombie (every read is bounded)."""
    base = os.path.join(proc_root, str(pid))
    try:
        with open(os.path.join(base, "status"), encoding="ascii", errors="replace") as f:
            status = f.read(4096)
        with open(os.path.join(base, "stat"), encoding="ascii", errors="replace") as f:
            fields = f.read(4096).rpartition(")")[2].split()
        with open(os.path.join(base, "cmdline"), "rb") as fb:
            argv = fb.read(8192).split(b"\0")
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X") or not fields[1].isdigit():
        return None
    try:
        cwd: str | None = os.readlink(os.path.join(base, "cwd"))
    except OSError:
        cwd = None
    return ProcessFacts(
        pid=pid,
        ppid=int(fields[1]),
        uids=_ids(status, "Uid:"),
        start=int(fields[19]) if fields[19].isdigit() else 0,
        argv=tuple(a.decode("utf-8", "replace") for a in argv if a),
        cwd=cwd,
    )


def process_holders(uids: Container[int], proc_root: str = "/proc") -> dict[int, str]:
    """uid -> one live process that runs with it as any of its user or group ids."""
    found: dict[int, str] = {}
    for entry in _entries(proc_root):
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc_root, entry, "status"), encoding="ascii",
                      errors="replace") as f:  # fmt: skip
                text = f.read(4096)
        except OSError:
            continue
        if _real_uid(text) is None and "Uid:" in text:
            continue  # a zombie holds nothing
        for uid in {*_ids(text, "Uid:"), *_ids(text, "Gid:")}:
            if uid in uids:
                found.setdefault(uid, f"process {entry}")
    return found


def ipc_holders(uids: Container[int], proc_root: str = "/proc") -> dict[int, str]:
    """uid -> one System V IPC object (shared memory, semaphores, message queue) it owns or
    made; such an object outlives every process."""
    found: dict[int, str] = {}
    for table in SYSV_IPC:
        try:
            with open(os.path.join(proc_root, "sysvipc", table), encoding="ascii") as f:
                lines = f.read(1 << 22).splitlines()
        except OSError:
            continue
        if not lines:
            continue
        header = lines[0].split()
        cols = [header.index(c) for c in _IPC_OWNERS if c in header]
        for line in lines[1:]:
            fields = line.split()
            for i in cols:
                if i < len(fields) and fields[i].isdigit() and int(fields[i]) in uids:
                    found.setdefault(int(fields[i]), f"System V {table} {fields[1]}")
    return found


def socket_holders(uids: Container[int], proc_root: str = "/proc") -> dict[int, str]:
    """uid -> one IP socket it owns (``/proc/net/*``: also one no process holds any more)."""
    found: dict[int, str] = {}
    for table in SOCKET_TABLES:
        try:
            with open(os.path.join(proc_root, "net", table), encoding="ascii") as f:
                lines = f.read(1 << 24).splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 7 and fields[7].isdigit() and int(fields[7]) in uids:
                found.setdefault(int(fields[7]), f"{table} socket")
    return found


@frozen
class Walked:
    """The owners met under some roots: uid or gid -> one path; ``incomplete`` names each
    root that could not be read whole (then nothing is proven absent under it)."""

    owners: dict[int, str]
    incomplete: tuple[str, ...]


def file_holders(uids: Container[int], roots: Iterable[str], budget: int = MAX_WALK) -> Walked:
    """uid -> one file, directory, socket or FIFO under ``roots`` it owns (as user or group).

    Nothing is followed: a symlink is looked at, never through; a root that is not a
    directory is skipped. At most ``budget`` entries are looked at, every root together."""
    found: dict[int, str] = {}
    incomplete: list[str] = []
    left = budget
    for root in dict.fromkeys(roots):
        try:
            mode = os.lstat(root).st_mode
        except FileNotFoundError:
            continue  # a volume deleted since: nothing of anyone's is left in it
        except OSError:
            incomplete.append(root)
            continue
        if stat.S_ISLNK(mode):
            incomplete.append(root)  # not followed: what it stands for is not known
            continue
        if not stat.S_ISDIR(mode):
            continue
        stack, whole = [root], True
        while stack:
            top = stack.pop()
            try:
                with os.scandir(top) as it:
                    for entry in it:
                        left -= 1
                        if left < 0:
                            break
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue  # gone meanwhile
                        for owner in (st.st_uid, st.st_gid):
                            if owner in uids:
                                found.setdefault(owner, entry.path)
                        if stat.S_ISDIR(st.st_mode):
                            stack.append(entry.path)
            except FileNotFoundError:
                continue
            except OSError:
                whole = False
            if left < 0:
                whole = False
                break
        if not whole:
            incomplete.append(root)
    return Walked(found, tuple(incomplete))


def uid_leftovers(data_dir: str, proc_root: str = "/proc") -> list[str]:
    """Each leftover of the per-VM uid model, said in one line (empty: none)."""
    stale = stale_reservations(data_dir)
    lines = [
        f"uid {uid} is still reserved for VM {vm_id}, whose directory is gone"
        for uid, vm_id in sorted(stale.items())
    ]
    lines += [
        f"pid {pid} still runs as VM uid {uid}, whose machine is gone"
        for pid, uid in sorted(processes_of(set(stale), proc_root).items())
    ]
    return lines
