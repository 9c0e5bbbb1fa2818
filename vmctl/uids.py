"""smolvm 1.32's per-VM uid registry: reserve a VM's uid before its start, look it up after.

As root, ``machine start`` runs each VMM under a uid from ``<data>/.cache/smolvm/uids/``: a
file ``<uid>`` whose content is the VM's id (the last part of ``machine data-dir``), made under
``uids/.allocation.lock``. An entry that already names the VM is honoured (pinned against the
real binary in ``tests/vmctl/test_contract.py``), so writing it first tells the daemon the
VMM's uid before the VMM exists: it can hand that uid a directory of its own and let it, and
only it, reach the bottle's endpoints.

The registry is root's (0755): no VMM uid can write it, unlike the VM's own directory and its
``.vm-uid``, which belong to the VMM's uid. So the registry (and the daemon's own record of
what it reserved) is where a uid is looked up; ``.vm-uid`` is never trusted.

A uid is never handed out twice from one registry: smolvm would give a deleted VM's uid to the
next VM (the lowest free), and whatever the old VMM left running or owning (a process, a file
in ``/tmp``, an IPC object) would then act as the new VM (``docs/security.md``, R2). Every
reservation takes a number above every number handed out before, kept in ``.last-reserved``
(written before the entry, so a crash never lets a number go back).

``machine delete`` frees the entry (smolvm's own doing). Blocking file calls: run them off
the reactor thread (the lock is smolvm's too).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal

from attrs import frozen

from vmctl.residue import processes_of, read_entry

#: The first uid smolvm 1.32.2 hands out.
FIRST_VM_UID = 2_000_000
#: Our bound (65536 VMs per data dir, over its whole life); past it a reservation is refused.
LAST_VM_UID = FIRST_VM_UID + 65_535
LOCK_NAME = ".allocation.lock"
#: The highest uid ever reserved from this registry (bottlenet's; smolvm reads only numbers).
LAST_RESERVED = ".last-reserved"
VM_UID_FILE = ".vm-uid"
#: Entries and the high-water mark are root's, readable by all (as smolvm makes them).
ENTRY_MODE = 0o644


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


def registry_of(vm_dir: str) -> str:
    """The uid registry next to smolvm's VM dirs (``<data>/.cache/smolvm/{vms/<id>,uids}``)."""
    return os.path.join(os.path.dirname(os.path.dirname(vm_dir)), "uids")


def in_range(uid: int) -> bool:
    """A uid smolvm's registry may hold (the range this module reserves from)."""
    return FIRST_VM_UID <= uid <= LAST_VM_UID


def _entries(reg: str) -> list[int]:
    """The uids the registry holds, in order."""
    return sorted(int(e) for e in os.listdir(reg) if e.isdigit())


def _last_reserved(reg: str) -> int:
    text = read_entry(os.path.join(reg, LAST_RESERVED))
    return int(text) if text.isdigit() else FIRST_VM_UID - 1


def _write_last(reg: str, uid: int) -> None:
    """The new high-water mark, replaced atomically and synced before the entry exists."""
    tmp = os.path.join(reg, LAST_RESERVED + ".new")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, ENTRY_MODE)
    with os.fdopen(fd, "w") as fh:
        fh.write(str(uid))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(reg, LAST_RESERVED))


def _new_entry(reg: str, vm_id: str, floor: int) -> int | None:
    """Write the first free entry above ``floor`` (the high-water mark first); None: full."""
    for uid in range(floor + 1, LAST_VM_UID + 1):
        _write_last(reg, uid)
        try:
            new = os.open(
                os.path.join(reg, str(uid)),
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                ENTRY_MODE,
            )
        except FileExistsError:
            continue
        os.fchmod(new, ENTRY_MODE)  # whatever the umask: root's, readable, nobody else's
        with os.fdopen(new, "w") as fh:
            fh.write(vm_id)
        return uid
    return None


def reserve_vm_uid(vm_dir: str) -> int:
    """The uid ``machine start`` will drop the VM of ``vm_dir`` to: its entry, else a new one
    above every uid this registry ever held (never a freed one)."""
    reg, vm_id = registry_of(vm_dir), os.path.basename(vm_dir)
    try:
        os.makedirs(reg, mode=0o755, exist_ok=True)
        fd = os.open(os.path.join(reg, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "r+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken = _entries(reg)
            for uid in taken:
                if read_entry(os.path.join(reg, str(uid))) == vm_id:
                    return uid
            floor = max([_last_reserved(reg), *(u for u in taken if in_range(u))])
            uid_or_none = _new_entry(reg, vm_id, floor)
    except OSError as e:
        raise UidRegistryError(f"smolvm's uid registry {reg}: {e.strerror or e}") from None
    if uid_or_none is None:
        raise UidRegistryError(
            f"smolvm's uid registry {reg} is used up: its {LAST_VM_UID - FIRST_VM_UID + 1} "
            "uids are never handed out twice; give the daemon a new --smolvm-data-dir"
        )
    return uid_or_none


def registered_vm_uid(vm_dir: str) -> int | None:
    """The uid smolvm's (root-owned) registry holds for the VM of ``vm_dir``, or None."""
    reg, vm_id = registry_of(vm_dir), os.path.basename(vm_dir)
    try:
        taken = _entries(reg)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UidRegistryError(f"smolvm's uid registry {reg}: {e.strerror or e}") from None
    for uid in taken:
        if in_range(uid) and read_entry(os.path.join(reg, str(uid))) == vm_id:
            return uid
    return None


def end_processes_of(uid: int, proc: str = "/proc") -> list[int]:
    """Kill every process of a per-VM uid (what its VMM left behind: a ``setsid`` child), then
    look again: the pids still alive (empty: none is left). Root only; blocking.

    The kill is ``kill(-1, SIGKILL)`` from a child that has become ``uid``: the kernel
    signals every process of that uid in one pass (no fork escapes it, unlike a kill per pid
    found by a scan). Refuses root and the daemon's own uid."""
    if uid in (0, os.geteuid()) or not in_range(uid):
        raise UidRegistryError(f"refusing to end the processes of uid {uid}")
    if processes_of({uid}, proc):
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
    return sorted(processes_of({uid}, proc))
