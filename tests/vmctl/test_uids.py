"""``vmctl.uids``: reserving a VM's uid in smolvm's registry before its start (no smolvm)."""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from vmctl.residue import processes_of
from vmctl.uids import (
    FIRST_VM_UID,
    LAST_RESERVED,
    LAST_VM_UID,
    LOCK_NAME,
    UidRegistryError,
    end_processes_of,
    registered_vm_uid,
    registry_of,
    reserve_vm_uid,
)


def _vm_dir(data: Path, vm_id: str) -> str:
    d = data / ".cache" / "smolvm" / "vms" / vm_id
    d.mkdir(parents=True)
    return str(d)


def _numbers(reg: Path) -> list[int]:
    return sorted(int(n) for n in os.listdir(reg) if n.isdigit())


def test_a_new_uid_is_above_every_uid_the_registry_holds(tmp_path: Path) -> None:
    """Not the lowest free (a gap may be a deleted VM's uid): above all, with the VM's id."""
    vm = _vm_dir(tmp_path, "abc")
    reg = Path(registry_of(vm))
    assert reg == tmp_path / ".cache" / "smolvm" / "uids"
    reg.mkdir()
    (reg / str(FIRST_VM_UID)).write_text("other")
    (reg / str(FIRST_VM_UID + 2)).write_text("third")
    assert reserve_vm_uid(vm) == FIRST_VM_UID + 3
    assert (reg / str(FIRST_VM_UID + 3)).read_text() == "abc"
    assert (reg / LAST_RESERVED).read_text() == str(FIRST_VM_UID + 3)


def test_a_freed_uid_is_never_handed_out_again(tmp_path: Path) -> None:
    """R2: smolvm's delete frees a VM's entry; the next VM still gets a new number, also
    when the freed one was the highest (the high-water mark remembers it)."""
    reg = Path(registry_of(_vm_dir(tmp_path, "first")))
    first = reserve_vm_uid(str(tmp_path / ".cache/smolvm/vms/first"))
    (reg / str(first)).unlink()  # machine delete
    second = reserve_vm_uid(_vm_dir(tmp_path, "second"))
    (reg / str(second)).unlink()
    third = reserve_vm_uid(_vm_dir(tmp_path, "third"))
    assert (first, second, third) == (FIRST_VM_UID, FIRST_VM_UID + 1, FIRST_VM_UID + 2)
    assert _numbers(reg) == [third]


def test_an_entry_naming_the_vm_is_its_uid(tmp_path: Path) -> None:
    """Honoured as smolvm honours it: no second entry, whatever its number."""
    vm = _vm_dir(tmp_path, "abc")
    reg = Path(registry_of(vm))
    reg.mkdir()
    (reg / str(FIRST_VM_UID + 40)).write_text("abc\n")
    assert reserve_vm_uid(vm) == FIRST_VM_UID + 40
    assert reserve_vm_uid(vm) == FIRST_VM_UID + 40
    assert _numbers(reg) == [FIRST_VM_UID + 40]


def test_concurrent_reservations_never_share_a_uid(tmp_path: Path) -> None:
    """Eight VMs reserved at once (the allocation lock and O_EXCL): eight distinct uids."""
    vms = [_vm_dir(tmp_path, f"vm{i}") for i in range(8)]
    got: list[int] = []
    threads = [threading.Thread(target=lambda v=v: got.append(reserve_vm_uid(v))) for v in vms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(FIRST_VM_UID, FIRST_VM_UID + 8))


def test_a_reservation_waits_for_smolvms_allocation_lock(tmp_path: Path) -> None:
    """U04: while smolvm holds ``.allocation.lock`` (its own start allocating) no entry is
    written; the reservation goes on once the lock is released."""
    vm = _vm_dir(tmp_path, "abc")
    reg = Path(registry_of(vm))
    reg.mkdir()
    got: list[int] = []
    with open(reg / LOCK_NAME, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        worker = threading.Thread(target=lambda: got.append(reserve_vm_uid(vm)))
        worker.start()
        worker.join(0.5)  # a bounded look: it must still be waiting on the lock
        assert worker.is_alive() and got == [] and _numbers(reg) == []
    worker.join()
    assert got == [FIRST_VM_UID]


def test_entries_are_root_readable_and_nobody_elses_to_write_whatever_the_umask(
    tmp_path: Path,
) -> None:
    """U06: under umask 0 the entry and the high-water mark are 0644, the registry 0755."""
    vm = _vm_dir(tmp_path, "abc")
    old = os.umask(0)
    try:
        uid = reserve_vm_uid(vm)
    finally:
        os.umask(old)
    reg = Path(registry_of(vm))
    assert stat.S_IMODE(os.stat(reg).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(reg / str(uid)).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(reg / LAST_RESERVED).st_mode) == 0o644


def test_the_last_uid_of_the_range_is_handed_out_and_then_none(tmp_path: Path) -> None:
    """U09: the range ends at LAST_VM_UID exactly: its last uid is given, then a typed
    refusal that writes no entry past it."""
    reg = Path(registry_of(_vm_dir(tmp_path, "last")))
    reg.mkdir()
    (reg / LAST_RESERVED).write_text(str(LAST_VM_UID - 1))
    assert reserve_vm_uid(str(tmp_path / ".cache/smolvm/vms/last")) == LAST_VM_UID
    with pytest.raises(UidRegistryError, match="used up"):
        reserve_vm_uid(_vm_dir(tmp_path, "past"))
    assert _numbers(reg) == [LAST_VM_UID]


def test_unwritable_registry_is_a_typed_error(tmp_path: Path) -> None:
    """A registry path that is a file: UidRegistryError naming it, not a traceback."""
    vm = _vm_dir(tmp_path, "abc")
    Path(registry_of(vm)).write_text("not a directory")
    with pytest.raises(UidRegistryError, match="uid registry"):
        reserve_vm_uid(vm)


def test_the_registered_uid_comes_from_the_registry_not_the_vm_dir(tmp_path: Path) -> None:
    """R1: the entry naming the VM is its uid; the VM dir's ``.vm-uid`` (its VMM's own
    file) is never read, and a FIFO among the entries does not block the scan."""
    vm = _vm_dir(tmp_path, "abc")
    assert registered_vm_uid(vm) is None  # no registry yet
    reg = Path(registry_of(vm))
    reg.mkdir()
    os.mkfifo(reg / str(FIRST_VM_UID))
    (reg / str(FIRST_VM_UID + 5)).write_text("abc")
    Path(vm, ".vm-uid").write_text("65534")
    assert registered_vm_uid(vm) == FIRST_VM_UID + 5
    (reg / str(FIRST_VM_UID + 5)).unlink()
    assert registered_vm_uid(vm) is None
    (reg / "0").write_text("abc")  # outside smolvm's range: never a VMM's uid (root's here)
    assert registered_vm_uid(vm) is None


def test_ending_a_uid_refuses_root_the_daemon_and_uids_outside_the_range() -> None:
    """Never ``kill(-1)`` as a uid that is not a per-VM one."""
    for uid in (0, os.geteuid(), 65534, LAST_VM_UID + 1):
        with pytest.raises(UidRegistryError, match="refusing"):
            end_processes_of(uid)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs processes as another uid")
def test_every_process_of_a_vm_uid_is_ended_and_checked_gone() -> None:
    """R2: what a VMM left running (a ``setsid`` child, and its own child) ends; a process of
    another VM uid is untouched."""
    uid, other = LAST_VM_UID - 7, LAST_VM_UID - 8

    def as_uid(u: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            ["setpriv", f"--reuid={u}", f"--regid={u}", "--clear-groups", "sh", "-c",
             "sleep 300 & exec sleep 300"],
            start_new_session=True,
        )  # fmt: skip

    left, keep = as_uid(uid), as_uid(other)
    try:
        for _ in range(500):  # wait until both children run as their uids (setpriv's exec)
            if len(processes_of({uid})) == 2 and len(processes_of({other})) == 2:
                break
            time.sleep(0.01)
        assert len(processes_of({uid})) == 2
        assert end_processes_of(uid) == []
        assert left.wait(10) == -9
        assert len(processes_of({other})) == 2
    finally:
        for p in (left, keep):
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
