"""What smolvm's per-VM uid model can leave behind: reservations and processes without a VM.

A teardown is complete only when no uid entry in smolvm's registry names a VM whose directory
is gone, and no process runs as such a uid (it could reach what the next VM under that uid is
given). Only this data dir's registry is read: another smolvm data dir on the host hands out
the same uids for its own VMs, so a per-VM uid seen in ``/proc`` alone proves nothing.
``bottlenetctl selftest`` asks for this after its throwaway bottle is destroyed. Blocking
file calls: run them off the reactor thread.

Every file here may be written by a VMM uid, so nothing is followed or read whole: entries are
opened ``O_NOFOLLOW|O_NONBLOCK`` (a FIFO never blocks), only regular files are read, and at most
64 bytes of each.
"""

from __future__ import annotations

import os
import stat

#: Where smolvm keeps its VM dirs and its uid registry, under its data dir.
SMOLVM_TREE = (".cache", "smolvm")
#: The most entries of a directory looked at (a registry holds at most 65,536 uids).
MAX_ENTRIES = 70_000


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
