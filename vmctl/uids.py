"""smolvm 1.32's per-VM uid registry: reserve a VM's uid before its start, read it after.

As root, ``machine start`` runs each VMM under a uid from ``<data>/.cache/smolvm/uids/``: a
file ``<uid>`` whose content is the VM's id (the last part of ``machine data-dir``), the
lowest free from 2000000, made under ``uids/.allocation.lock``. An entry that already names
the VM is honoured (pinned against the real binary in ``tests/vmctl/test_contract.py``), so
writing it first tells the daemon the VMM's uid before the VMM exists: it can hand that uid
a directory of its own and let it, and only it, reach the bottle's endpoints.

``machine delete`` frees the entry (smolvm's own doing). Blocking file calls: run them off
the reactor thread (the lock is smolvm's too).
"""

from __future__ import annotations

import contextlib
import fcntl
import os

#: The first uid smolvm 1.32.2 hands out.
FIRST_VM_UID = 2_000_000
#: Our bound on the scan (65536 VMs per data dir); past it a reservation is refused.
LAST_VM_UID = FIRST_VM_UID + 65_535
LOCK_NAME = ".allocation.lock"
VM_UID_FILE = ".vm-uid"


class UidRegistryError(Exception):
    """The registry could not be read or written (the message says what and why)."""


def registry_of(vm_dir: str) -> str:
    """The uid registry next to smolvm's VM dirs (``<data>/.cache/smolvm/{vms/<id>,uids}``)."""
    return os.path.join(os.path.dirname(os.path.dirname(vm_dir)), "uids")


def _read(path: str) -> str:
    with contextlib.suppress(OSError), open(path, encoding="ascii", errors="replace") as fh:
        return fh.read(64).strip()
    return ""


def reserve_vm_uid(vm_dir: str) -> int:
    """The uid ``machine start`` will drop the VM of ``vm_dir`` to: its entry, else a new one."""
    reg, vm_id = registry_of(vm_dir), os.path.basename(vm_dir)
    try:
        os.makedirs(reg, mode=0o755, exist_ok=True)
        fd = os.open(os.path.join(reg, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "r+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken = {e for e in os.listdir(reg) if e.isdigit()}
            for entry in sorted(taken, key=int):
                if _read(os.path.join(reg, entry)) == vm_id:
                    return int(entry)
            for uid in range(FIRST_VM_UID, LAST_VM_UID + 1):
                if str(uid) in taken:
                    continue
                try:
                    new = os.open(
                        os.path.join(reg, str(uid)),
                        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                        0o644,
                    )
                except FileExistsError:
                    continue
                with os.fdopen(new, "w") as fh:
                    fh.write(vm_id)
                return uid
    except OSError as e:
        raise UidRegistryError(f"smolvm's uid registry {reg}: {e.strerror or e}") from None
    raise UidRegistryError(f"smolvm's uid registry {reg} is full")


def started_vm_uid(vm_dir: str) -> int | None:
    """The uid the started VM runs under (its ``.vm-uid``), or None: no drop happened."""
    text = _read(os.path.join(vm_dir, VM_UID_FILE))
    return int(text) if text.isdigit() else None
