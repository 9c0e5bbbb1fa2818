"""The fake smolvm's uid registry is smolvm's: two fresh data dirs both start at 2000000
(as root); bottlenet's reservations keep them apart (each data dir a block of its own).

The fake once seeded each data dir at a block of its own, which hid exactly the collision a
second smolvm data dir on a host makes (security-4 N2)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes import FAKE_SMOLVM, FAST_PATH, FakeSmolvm
from vmctl.uids import FIRST_VM_UID, LAST_VM_UID, UidPool

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-VM uids are root's")


@pytest.fixture
def two_fakes() -> Iterator[tuple[FakeSmolvm, FakeSmolvm]]:
    fakes = [FakeSmolvm(tempfile.mkdtemp(prefix="fake-smolvm-")) for _ in range(2)]
    for fake in fakes:
        fake.set_faults("uid-drop")
    yield fakes[0], fakes[1]
    survivors = [p for fake in fakes for p in fake.cleanup()]
    for fake in fakes:
        shutil.rmtree(fake.path, ignore_errors=True)
    assert not survivors, survivors


def machine(fake: FakeSmolvm, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": FAST_PATH, "SMOLVM_DATA_DIR": fake.path, "HOME": fake.path}
    return subprocess.run(
        [FAKE_SMOLVM, "machine", *args], env=env, capture_output=True, timeout=120, check=True
    )


def started_uid(fake: FakeSmolvm, name: str) -> int:
    machine(fake, "create", "--name", name)
    machine(fake, "start", "--name", name)
    uid = int(Path(fake.vm_dir(name), ".vm-uid").read_text())
    machine(fake, "stop", "--name", name)
    return uid


def test_two_fresh_fake_data_dirs_both_start_at_smolvms_first_uid(
    two_fakes: tuple[FakeSmolvm, FakeSmolvm],
) -> None:
    """Left to itself each registry hands out its lowest free uid from 2000000: the same
    uid twice on one host (what the real smolvm does; nothing seeded)."""
    assert [started_uid(fake, "m1") for fake in two_fakes] == [FIRST_VM_UID, FIRST_VM_UID]


def test_reserved_by_bottlenet_the_two_data_dirs_share_no_uid(
    two_fakes: tuple[FakeSmolvm, FakeSmolvm], tmp_path: Path
) -> None:
    """One ledger, two data dirs: each start runs as the uid its own block reserved."""
    uids = []
    for fake in two_fakes:
        pool = UidPool(fake.path, ledger=str(tmp_path / "ledger"))
        machine(fake, "create", "--name", "m1")
        uids.append(pool.reserve(fake.vm_dir("m1")))
        machine(fake, "start", "--name", "m1")
        assert int(Path(fake.vm_dir("m1"), ".vm-uid").read_text()) == uids[-1]
    assert uids[0] != uids[1]
    assert all(uid > LAST_VM_UID for uid in uids), uids  # never smolvm's own block
