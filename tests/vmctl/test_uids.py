"""``vmctl.uids``: a VM's uid reserved in smolvm's registry from the data dir's own block, its
processes ended, and the uid given back once nothing of it is left (no smolvm)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vmctl.uidpools import make_pool
from vmctl import uids as uids_module
from vmctl.residue import process_facts, processes_of
from vmctl.uidranges import Block, HostIds
from vmctl.uids import (
    EXTEND_BELOW,
    FIRST_VM_UID,
    HELD,
    LAST_RESERVED,
    LOCK_NAME,
    RETIRED,
    SWEEP_BELOW,
    UidPool,
    UidRegistryError,
    registered_vm_uid,
    registry_of,
    reserve_vm_uid,
)

B1, B2 = Block(1), Block(2)
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="only root runs processes as another uid")


def vm(pool: UidPool, vm_id: str) -> str:
    d = Path(pool.vms) / vm_id
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


def numbers(path: str | Path) -> list[int]:
    return sorted(int(n) for n in os.listdir(path) if n.isdigit())


def delete(pool: UidPool, uid: int) -> None:
    """What ``machine delete`` does to the registry: the entry goes."""
    os.unlink(os.path.join(pool.registry, str(uid)))


def set_mark(pool: UidPool, uid: int) -> None:
    Path(pool.registry, LAST_RESERVED).write_text(str(uid))


def retire_many(pool: UidPool, uids: range | list[int]) -> None:
    """Retired records as a long history leaves them (each VM deleted, its uid waiting)."""
    with open(Path(pool.registry, RETIRED), "a") as log:
        for uid in uids:
            log.write(json.dumps({"uid": uid, "vm": "old", "volumes": []}) + "\n")


def free_uids(pool: UidPool) -> list[int]:
    return [u for first, last in pool._free() for u in range(first, last + 1)]


@contextlib.contextmanager
def as_uid(uid: int, *argv: str) -> Iterator[subprocess.Popen[bytes]]:
    """A process group running ``argv`` as ``uid`` (gid the same), killed after."""
    p = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv],
        start_new_session=True,
    )
    try:
        yield p
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()


def wait_until(check: Any, what: str) -> None:
    for _ in range(1000):
        if check():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# -- reserving ----------------------------------------------------------------------------------


def test_a_data_dir_reserves_from_a_block_of_its_own(tmp_path: Path) -> None:
    """N2: not smolvm's 2000000 (where any other data dir starts) but the first free block
    of the ledger, recorded there under the registry's name."""
    pool = make_pool(tmp_path)
    uid = pool.reserve(vm(pool, "abc"))
    assert uid == B1.first and uid > FIRST_VM_UID + 65_535
    assert Path(pool.registry, str(uid)).read_text() == "abc"
    assert Path(pool.registry, LAST_RESERVED).read_text() == str(uid)
    record = json.loads((tmp_path / "ledger" / "1").read_text())
    assert record["registry"] == os.path.realpath(pool.registry)
    assert pool.supply().blocks == (1,) and pool.supply().left == 65_535


def test_two_data_dirs_reserve_from_two_blocks(tmp_path: Path) -> None:
    """Two fresh data dirs (both would start at 2000000 in smolvm) share no uid."""
    a, b = make_pool(tmp_path, "a"), make_pool(tmp_path, "b")
    first = [a.reserve(vm(a, "x")), b.reserve(vm(b, "x"))]
    assert first == [B1.first, B2.first]
    assert a.reserve(vm(a, "y")) == B1.first + 1


def test_a_new_uid_is_above_every_uid_the_block_gave_out(tmp_path: Path) -> None:
    """Not the lowest free: the next above the mark, skipping an entry already there."""
    pool = make_pool(tmp_path)
    first = pool.reserve(vm(pool, "a"))
    Path(pool.registry, str(first + 1)).write_text("other")
    Path(pool.registry, str(first + 3)).write_text("third")
    assert pool.reserve(vm(pool, "b")) == first + 2
    assert pool.reserve(vm(pool, "c")) == first + 4
    assert Path(pool.registry, LAST_RESERVED).read_text() == str(first + 4)


def test_a_freed_uid_waits_while_fresh_ones_remain(tmp_path: Path) -> None:
    """R2: a deleted VM's uid, even proven unused, is not the next one (fresh ones are)."""
    pool = make_pool(tmp_path)
    first = pool.reserve(vm(pool, "first"))
    delete(pool, first)
    assert pool.retire(first, prove=True)  # nothing of it is left: free again
    assert free_uids(pool) == [first]
    assert pool.reserve(vm(pool, "second")) == first + 1


def test_an_entry_naming_the_vm_is_its_uid(tmp_path: Path) -> None:
    """Honoured as smolvm honours it (also one of smolvm's own block): no second entry."""
    pool = make_pool(tmp_path)
    Path(pool.registry).mkdir(parents=True)
    Path(pool.registry, str(FIRST_VM_UID + 40)).write_text("abc\n")
    assert pool.reserve(vm(pool, "abc")) == FIRST_VM_UID + 40
    assert pool.reserve(vm(pool, "abc")) == FIRST_VM_UID + 40
    assert numbers(pool.registry) == [FIRST_VM_UID + 40]


def test_concurrent_reservations_never_share_a_uid(tmp_path: Path) -> None:
    """Eight VMs reserved at once (the allocation lock and O_EXCL): eight distinct uids."""
    pool = make_pool(tmp_path)
    vms = [vm(pool, f"vm{i}") for i in range(8)]
    got: list[int] = []
    threads = [threading.Thread(target=lambda v=v: got.append(pool.reserve(v))) for v in vms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(B1.first, B1.first + 8))


def test_a_reservation_waits_for_smolvms_allocation_lock(tmp_path: Path) -> None:
    """U04: while smolvm holds ``.allocation.lock`` (its own start allocating) no entry is
    written; the reservation goes on once the lock is released."""
    pool = make_pool(tmp_path)
    v = vm(pool, "abc")
    Path(pool.registry).mkdir()
    got: list[int] = []
    with open(Path(pool.registry, LOCK_NAME), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        worker = threading.Thread(target=lambda: got.append(pool.reserve(v)))
        worker.start()
        worker.join(0.5)  # a bounded look: it must still be waiting on the lock
        assert worker.is_alive() and got == [] and numbers(pool.registry) == []
    worker.join()
    assert got == [B1.first]


def test_registry_files_are_root_readable_whatever_the_umask(tmp_path: Path) -> None:
    """U05: under umask 077 (and 000) the entry, the mark and the held record are 0644."""
    for mask, name in ((0o077, "strict"), (0, "open")):
        pool = make_pool(tmp_path, name)
        old = os.umask(mask)
        try:
            uid = pool.reserve(vm(pool, "abc"))
        finally:
            os.umask(old)
        reg = Path(pool.registry)
        assert stat.S_IMODE(os.stat(reg).st_mode) == 0o755 or mask
        for path in (reg / str(uid), reg / LAST_RESERVED, reg / HELD / str(uid)):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o644, (mask, path)


def test_the_mark_is_synced_before_the_entry_exists(tmp_path: Path, monkeypatch: Any) -> None:
    """U03: after a power loss the mark must not be older than an entry (a freed uid would
    be handed out again): it is fsynced, then renamed, before the entry is created."""
    pool = make_pool(tmp_path)
    v = vm(pool, "abc")
    pool.reserve(vm(pool, "warm-up"))  # the block is claimed: only this reservation is seen
    events: list[str] = []
    real_fsync, real_open, real_replace = os.fsync, os.open, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def opened(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if flags & os.O_CREAT:
            events.append("create " + os.path.basename(str(path)))
        return real_open(path, flags, *a, **kw)

    def replaced(src: Any, dst: Any, **kw: Any) -> None:
        events.append("rename " + os.path.basename(str(dst)))
        real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(os, "replace", replaced)
    uid = pool.reserve(v)
    synced = events.index(f"fsync {LAST_RESERVED}.new")
    assert synced < events.index(f"rename {LAST_RESERVED}") < events.index(f"create {uid}")


def test_unwritable_registry_is_a_typed_error(tmp_path: Path) -> None:
    """A registry path that is a file: UidRegistryError naming it, not a traceback."""
    pool = make_pool(tmp_path)
    v = vm(pool, "abc")
    Path(pool.registry).write_text("not a directory")
    with pytest.raises(UidRegistryError, match="uid registry"):
        pool.reserve(v)


def test_the_registered_uid_comes_from_the_registry_not_the_vm_dir(tmp_path: Path) -> None:
    """R1: the entry naming the VM is its uid; the VM dir's ``.vm-uid`` (its VMM's own
    file) is never read, and a FIFO among the entries does not block the scan."""
    pool = make_pool(tmp_path)
    v = vm(pool, "abc")
    assert registered_vm_uid(v) is None  # no registry yet
    reg = Path(registry_of(v))
    reg.mkdir()
    os.mkfifo(reg / str(B1.first))
    (reg / str(B1.first + 5)).write_text("abc")
    Path(v, ".vm-uid").write_text("65534")
    assert registered_vm_uid(v) == B1.first + 5
    (reg / str(B1.first + 5)).unlink()
    assert registered_vm_uid(v) is None
    (reg / "0").write_text("abc")  # never a VMM's uid (root's here)
    assert registered_vm_uid(v) is None


def test_reserve_vm_uid_takes_the_ledger_it_is_given(tmp_path: Path) -> None:
    """The one-call form (contract tests) claims its block in the ledger named."""
    pool = make_pool(tmp_path)
    assert reserve_vm_uid(vm(pool, "abc"), ledger=str(tmp_path / "ledger")) >= B1.first
    assert numbers(tmp_path / "ledger") == [1]


# -- running out, reclaiming, claiming more ----------------------------------------------------


def test_uids_proven_unused_are_reused_once_the_block_is_used_up(tmp_path: Path) -> None:
    """N8: the block's last fresh uid is given, then the lowest retired uid that holds
    nothing (a sweep proves it), never one that still owns a file in a shared place."""
    pool = make_pool(tmp_path)
    pool.reserve(vm(pool, "first"))
    set_mark(pool, B1.last - 1)
    history = range(B1.first + 1, B1.first + 1 + EXTEND_BELOW + 8)  # enough: no new block
    retire_many(pool, history)
    shared = tmp_path / "shared"
    shared.mkdir()
    kept = history[0]
    (shared / "left-behind").write_text("x")
    os.chown(shared / "left-behind", kept, kept)
    assert pool.reserve(vm(pool, "last")) == B1.last
    assert pool.reserve(vm(pool, "reused")) == history[1]
    supply = pool.supply()
    assert supply.blocks == (1,)  # reclaiming sufficed: no block claimed
    assert supply.retired == 1 and list(pool._retired()) == [kept]
    assert pool.sweep().kept == {kept: f"file {shared / 'left-behind'}"}
    assert pool.supply().example == f"uid {kept}: file {shared / 'left-behind'}"
    (shared / "left-behind").unlink()
    assert pool.sweep().freed == 1


def test_a_data_dir_claims_another_block_when_too_few_uids_can_be_reclaimed(
    tmp_path: Path,
) -> None:
    """When fewer than EXTEND_BELOW are left after a sweep, the next block is claimed and
    gives fresh uids; what the old block never gave out stays usable."""
    pool = make_pool(tmp_path)
    pool.reserve(vm(pool, "first"))
    set_mark(pool, B1.last - 3)
    assert pool.reserve(vm(pool, "next")) == B2.first
    assert pool.supply().blocks == (1, 2)
    assert free_uids(pool) == [B1.last - 2, B1.last - 1, B1.last]
    assert Path(pool.registry, LAST_RESERVED).read_text() == str(B2.first)


def test_when_no_block_can_be_claimed_the_supply_says_short_then_used_up(
    tmp_path: Path,
) -> None:
    """Every other block overlaps the host's ids: the last uids are still given (the
    supply is ``short``: the daemon warns), then a typed refusal naming the cause."""
    everything_else = HostIds(((B2.first, 2**31, "/etc/subuid range of tester"),), ())
    pool = make_pool(tmp_path, ids=lambda: everything_else)
    pool.reserve(vm(pool, "first"))
    set_mark(pool, B1.last - 2)
    assert pool.reserve(vm(pool, "a")) == B1.last - 1
    assert pool.supply().short and pool.supply().left == 1
    assert pool.reserve(vm(pool, "b")) == B1.last
    with pytest.raises(UidRegistryError, match="used up"):
        pool.reserve(vm(pool, "c"))


def test_seventy_thousand_cycles_of_history_still_create(tmp_path: Path) -> None:
    """A data dir whose block has long been used up (the mark at its end, every other uid
    of it retired by a deleted VM, as 70,000 create/destroy cycles leave it) goes on: the
    sweep frees them, and real cycles then reuse them without claiming a block."""
    pool = make_pool(tmp_path)
    pool.reserve(vm(pool, "first"))
    set_mark(pool, B1.last)
    retire_many(pool, range(B1.first + 1, B1.last + 1))
    seen = []
    for cycle in range(20):  # real cycles: reserve, delete, end, retire
        uid = pool.reserve(vm(pool, f"c{cycle}"))
        seen.append(uid)
        delete(pool, uid)
        pool.end(uid)
        pool.retire(uid)
    assert seen == list(range(B1.first + 1, B1.first + 21))
    supply = pool.supply()
    assert supply.blocks == (1,) and supply.left > SWEEP_BELOW


def test_a_held_uid_whose_entry_smolvm_removed_is_retired_by_a_sweep(tmp_path: Path) -> None:
    """A delete the daemon never saw through (a crash before ``retire``): the sweep finds
    the held record without its entry and frees the uid once nothing is left."""
    pool = make_pool(tmp_path)
    uid = pool.reserve(vm(pool, "crashed"))
    delete(pool, uid)
    assert pool.sweep().freed == 1
    assert free_uids(pool) == [uid]
    assert numbers(Path(pool.registry, HELD)) == []


def test_a_uid_with_a_file_in_its_volume_is_kept(tmp_path: Path) -> None:
    """The VM's read-write volumes (recorded at reserve) are looked at too."""
    pool = make_pool(tmp_path)
    vol = tmp_path / "vol"
    (vol / "deep").mkdir(parents=True)
    uid = pool.reserve(vm(pool, "agent"), volumes=[str(vol)])
    (vol / "deep" / "out.txt").write_text("written by the guest")
    os.chown(vol / "deep" / "out.txt", 0, uid)  # its group is enough
    delete(pool, uid)
    assert not pool.retire(uid, prove=True)
    assert pool.sweep().kept == {uid: f"file {vol / 'deep' / 'out.txt'}"}
    (vol / "deep" / "out.txt").unlink()
    assert pool.sweep().freed == 1


def test_a_volume_replaced_by_a_symlink_proves_nothing(tmp_path: Path) -> None:
    """A volume path that is now a symlink is not followed: its uid stays retired."""
    pool = make_pool(tmp_path)
    vol = tmp_path / "vol"
    uid = pool.reserve(vm(pool, "agent"), volumes=[str(vol)])
    vol.symlink_to(tmp_path)
    delete(pool, uid)
    assert not pool.retire(uid, prove=True)
    assert "could not be read whole" in pool.sweep().kept[uid]


@root_only
def test_a_uid_that_owns_a_sysv_ipc_object_is_kept(tmp_path: Path) -> None:
    """An IPC object outlives its maker: the uid waits until it is removed."""
    pool = make_pool(tmp_path)
    uid = pool.reserve(vm(pool, "ipc"))
    made = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "ipcmk", "-M", "4096"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    shmid = made.stdout.split()[-1]
    try:
        delete(pool, uid)
        assert not pool.retire(uid, prove=True)
        assert pool.sweep().kept[uid] == f"System V shm {shmid}"
    finally:
        subprocess.run(["ipcrm", "-m", shmid], check=True)
    assert pool.sweep().freed == 1


# -- ending a uid's processes -------------------------------------------------------------------


def test_ending_a_uid_refuses_root_the_daemon_and_uids_no_vm_gets(tmp_path: Path) -> None:
    """Never ``kill(-1)`` as a uid that is not a per-VM one."""
    pool = make_pool(tmp_path)
    for uid in (0, os.geteuid(), 65534, FIRST_VM_UID - 1, 2**31):
        with pytest.raises(UidRegistryError, match="refusing"):
            pool.end(uid)


@root_only
def test_every_process_of_the_machine_is_ended_and_checked_gone(tmp_path: Path) -> None:
    """R2: what a VMM left running (a ``setsid`` child and its own child, started after the
    reservation) ends; a process of another VM uid is untouched."""
    pool = make_pool(tmp_path)
    uid, other = pool.reserve(vm(pool, "a")), pool.reserve(vm(pool, "b"))
    reserved = uids_module._ticks_now()
    wait_until(lambda: uids_module._ticks_now() > reserved, "the next clock tick")
    script = "sleep 300 & exec sleep 300"
    with as_uid(uid, "sh", "-c", script) as left, as_uid(other, "sh", "-c", script):
        wait_until(lambda: len(processes_of({uid, other})) == 4, "both pairs to run")
        assert pool.end(uid).left == ()
        assert left.wait(10) == -9
        assert len(processes_of({other})) == 2


@root_only
def test_a_process_of_the_uid_that_is_not_the_machines_is_never_killed(tmp_path: Path) -> None:
    """N2: a process that ran as the uid before it was reserved here and names none of this
    data dir's VMs (another registry's VMM) is spared; the machine's own process, which
    names its VM dir, is killed."""
    pool = make_pool(tmp_path)
    uid = B1.first  # what this fresh data dir will reserve first
    with as_uid(uid, "sleep", "300") as foreign:
        wait_until(lambda: foreign.pid in processes_of({uid}), "the foreign process")
        facts = process_facts(foreign.pid)
        assert facts is not None
        wait_until(lambda: uids_module._ticks_now() > facts.start, "the next clock tick")
        assert pool.reserve(vm(pool, "a")) == uid
        vmm_args = ["sh", "-c", "sleep 300; :", "vmm", os.path.join(pool.vms, "a", "boot.json")]
        with as_uid(uid, *vmm_args) as vmm:
            wait_until(lambda: len(processes_of({uid})) == 3, "the machine's processes")
            ended = pool.end(uid)
            assert ended.spared == (foreign.pid,) and ended.left == ()
            assert vmm.wait(10) == -9
            assert foreign.poll() is None


@root_only
def test_a_uid_of_smolvms_own_block_is_killed_only_where_it_names_a_vm(tmp_path: Path) -> None:
    """A uid from before blocks (smolvm's own range, shared with root's own smolvm): only
    a process that names one of this data dir's VMs, or has a parent that does, is ended."""
    pool = make_pool(tmp_path)
    uid = FIRST_VM_UID + 77
    vmm_args = ["sh", "-c", "sleep 300 & wait", "vmm", os.path.join(pool.vms, "old", "boot")]
    with as_uid(uid, "sleep", "300") as other, as_uid(uid, *vmm_args) as vmm:
        wait_until(lambda: len(processes_of({uid})) == 3, "the processes")
        ended = pool.end(uid)
        assert ended.spared == (other.pid,)
        assert vmm.wait(10) == -9
        assert other.poll() is None
