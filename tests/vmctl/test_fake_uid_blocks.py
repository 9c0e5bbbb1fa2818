"""Two fake smolvm data dirs used at once never hand their VMs the same per-VM uid (as root).

A daemon's teardown ends every process of a deleted VM's uid; with both registries starting at
2000000, one test's (or one suite's) teardown ended another's VMMs under parallel runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fakes import FakeSmolvm
from vmctl.uids import FIRST_VM_UID, LAST_VM_UID, reserve_vm_uid

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-VM uids are root's")


def test_two_live_fakes_reserve_disjoint_uids(tmp_path: Path) -> None:
    """The same VM name in two fake data dirs gets two different uids, both in vmctl's range."""
    first, second = FakeSmolvm(str(tmp_path / "a")), FakeSmolvm(str(tmp_path / "b"))
    uids = [reserve_vm_uid(fake.vm_dir("bn-b1-agent")) for fake in (first, second)]
    assert uids[0] != uids[1], uids
    assert all(FIRST_VM_UID <= uid <= LAST_VM_UID for uid in uids), uids


def test_a_registry_in_use_keeps_its_mark(tmp_path: Path) -> None:
    """Opening a fake data dir again does not move its registry's high-water mark."""
    fake = FakeSmolvm(str(tmp_path / "a"))
    uid = reserve_vm_uid(fake.vm_dir("bn-b1-agent"))
    FakeSmolvm(fake.path)
    assert reserve_vm_uid(fake.vm_dir("bn-b2-agent")) == uid + 1
