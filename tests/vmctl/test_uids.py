"""``vmctl.uids``: reserving a VM's uid in smolvm's registry before its start (no smolvm)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from vmctl.uids import (
    FIRST_VM_UID,
    UidRegistryError,
    registry_of,
    reserve_vm_uid,
    started_vm_uid,
)


def _vm_dir(data: Path, vm_id: str) -> str:
    d = data / ".cache" / "smolvm" / "vms" / vm_id
    d.mkdir(parents=True)
    return str(d)


def test_lowest_free_uid_is_written_with_the_vm_id(tmp_path: Path) -> None:
    """The first free number from 2000000 (gaps filled), its content the VM's id."""
    vm = _vm_dir(tmp_path, "abc")
    reg = Path(registry_of(vm))
    assert reg == tmp_path / ".cache" / "smolvm" / "uids"
    reg.mkdir()
    (reg / str(FIRST_VM_UID)).write_text("other")
    (reg / str(FIRST_VM_UID + 2)).write_text("third")
    assert reserve_vm_uid(vm) == FIRST_VM_UID + 1
    assert (reg / str(FIRST_VM_UID + 1)).read_text() == "abc"


def test_an_entry_naming_the_vm_is_its_uid(tmp_path: Path) -> None:
    """Honoured as smolvm honours it: no second entry, whatever its number."""
    vm = _vm_dir(tmp_path, "abc")
    reg = Path(registry_of(vm))
    reg.mkdir()
    (reg / str(FIRST_VM_UID + 40)).write_text("abc\n")
    assert reserve_vm_uid(vm) == FIRST_VM_UID + 40
    assert reserve_vm_uid(vm) == FIRST_VM_UID + 40
    assert sorted(n for n in os.listdir(reg) if n.isdigit()) == [str(FIRST_VM_UID + 40)]


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


def test_unwritable_registry_is_a_typed_error(tmp_path: Path) -> None:
    """A registry path that is a file: UidRegistryError naming it, not a traceback."""
    vm = _vm_dir(tmp_path, "abc")
    Path(registry_of(vm)).write_text("not a directory")
    with pytest.raises(UidRegistryError, match="uid registry"):
        reserve_vm_uid(vm)


def test_started_vm_uid_reads_vm_uid(tmp_path: Path) -> None:
    """``.vm-uid`` after a start; None before (or with no drop)."""
    vm = _vm_dir(tmp_path, "abc")
    assert started_vm_uid(vm) is None
    Path(vm, ".vm-uid").write_text("2000007\n")
    assert started_vm_uid(vm) == 2000007
    Path(vm, ".vm-uid").write_text("garbage")
    assert started_vm_uid(vm) is None
