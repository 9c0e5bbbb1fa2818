"""``vmctl.uidranges``: one host, one uid block per smolvm data dir, checked against what the
host already gives out (the ledger, ``/etc/subuid``/``subgid``, users and groups, root's own
smolvm registries)."""

from __future__ import annotations

import os
import pwd
import shutil
from pathlib import Path

import pytest

from tests.vmctl.uidpools import NO_HOST, make_pool
from vmctl.uidranges import (
    FIRST_BLOCK,
    LAST_BLOCK,
    Block,
    HostIds,
    Ledger,
    Owner,
    UidRangeError,
    block_of,
    claim_block,
    host_ids,
)
from vmctl.uids import UidPool, UidRegistryError

B1, B2, B3 = Block(1), Block(2), Block(3)


def first_uid(pool: UidPool, vm_id: str = "v") -> int:
    d = Path(pool.vms) / vm_id
    d.mkdir(parents=True, exist_ok=True)
    return pool.reserve(str(d))


def test_blocks_lie_above_smolvms_own_and_below_two_to_the_31() -> None:
    """Block 0 (2000000-2065535) is never bottlenet's; the last block ends below 2**31."""
    assert FIRST_BLOCK == 1 and B1.first == 2_065_536 and B1.last == 2_131_071
    assert Block(LAST_BLOCK).last < 2**31 <= Block(LAST_BLOCK + 1).last
    assert block_of(B2.first) == B2 and block_of(B2.last) == B2 and B2.last + 1 not in B2


def test_host_ids_reads_subordinate_ranges_users_and_groups(tmp_path: Path) -> None:
    """``/etc/subuid`` and ``/etc/subgid`` lines (a malformed one skipped), every user and
    group NSS lists."""
    (tmp_path / "subuid").write_text("alice:2100000:65536\nbroken\nbob:x:5\nzero:1:0\n")
    (tmp_path / "subgid").write_text("alice:2200000:10\n")
    ids = host_ids(str(tmp_path))
    assert [r[:2] for r in ids.ranges] == [(2_100_000, 2_165_535), (2_200_000, 2_200_009)]
    assert (0, f"user {pwd.getpwuid(0).pw_name}") in ids.known
    assert ids.conflict(B1) == f"{tmp_path}/subuid range of alice (2100000-2165535)"
    assert ids.conflict(B3) == f"{tmp_path}/subgid range of alice (2200000-2200009)"
    assert ids.conflict(Block(5)) is None


def test_a_claim_skips_blocks_the_host_uses(tmp_path: Path) -> None:
    """N2: a block overlapping a subuid range, holding a known user, or an entry of root's
    own smolvm registry is never claimed."""
    theirs = tmp_path / "root-smolvm" / "uids"
    theirs.mkdir(parents=True)
    (theirs / str(B3.first + 9)).write_text("their-vm")
    ids = HostIds(((B1.first + 100, B1.first + 200, "subuid of alice"),), ((B2.last, "user x"),))
    pool = make_pool(tmp_path, ids=lambda: ids, registries=(str(theirs),))
    assert first_uid(pool) == Block(4).first


def test_a_recorded_block_given_to_another_data_dir_refuses_the_start(tmp_path: Path) -> None:
    """One line naming the other data dir: two registries never share a block."""
    pool = make_pool(tmp_path, "a")
    first_uid(pool)
    other = make_pool(tmp_path, "b")
    first_uid(other)
    (tmp_path / "ledger" / "1").write_bytes((tmp_path / "ledger" / "2").read_bytes())
    with pytest.raises(UidRangeError) as e:
        pool.check()
    assert str(e.value) == (
        f"{os.path.realpath(pool.registry)}: its uids {B1.first}-{B1.last} are given to another "
        f"smolvm data dir, {os.path.realpath(other.registry)} ({tmp_path}/ledger/1); "
        "one data dir per block"
    )


def test_a_recorded_block_the_host_now_uses_refuses_the_start(tmp_path: Path) -> None:
    """A user added (or a subuid range given) inside the data dir's block since its claim."""
    ids = NO_HOST
    pool = make_pool(tmp_path, ids=lambda: ids)
    first_uid(pool)
    assert pool.check().blocks == (1,)
    ids = HostIds(((B1.first + 5, B1.first + 5, "/etc/subgid range of carol"),), ())
    with pytest.raises(UidRangeError, match="overlap /etc/subgid range of carol"):
        pool.check()
    ids = HostIds((), ((B1.first + 7, "user dave"),))
    with pytest.raises(UidRangeError, match=rf"overlap user dave \({B1.first + 7}\)"):
        pool.check()


def test_a_lost_ledger_entry_is_written_again_and_a_moved_data_dir_keeps_its_block(
    tmp_path: Path,
) -> None:
    """The ledger is the host's memory of the blocks; the data dir remembers its own too."""
    pool = make_pool(tmp_path, "a")
    first_uid(pool)
    (tmp_path / "ledger" / "1").unlink()
    pool.check()
    assert (tmp_path / "ledger" / "1").exists()
    os.rename(tmp_path / "a", tmp_path / "moved")
    moved = make_pool(tmp_path, "moved")
    assert moved.check().blocks == (1,)
    assert os.path.realpath(moved.registry) in (tmp_path / "ledger" / "1").read_text()


def test_a_gone_data_dirs_block_comes_back_once_nothing_of_it_is_left(tmp_path: Path) -> None:
    """A data dir deleted for good: its block is claimed again, but only once no file in
    the shared places (nor a process, an IPC object or a socket) is one of its uids'."""
    old = make_pool(tmp_path, "old")
    uid = first_uid(old)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "left").write_text("")
    os.chown(shared / "left", uid, uid)
    shutil.rmtree(tmp_path / "old")
    assert first_uid(make_pool(tmp_path, "new")) == B2.first  # B1 still holds a file
    (shared / "left").unlink()
    assert first_uid(make_pool(tmp_path, "newer")) == B1.first


def test_a_ledger_others_may_write_is_refused(tmp_path: Path) -> None:
    """A forged ledger entry would hand uids around: the ledger must be root's (or the
    daemon's) and writable by nobody else."""
    path = tmp_path / "ledger"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o775)
    with pytest.raises(UidRangeError, match="writable by nobody else"):
        claim_block(Ledger(str(path)), Owner("r", 1, 1), NO_HOST)
    with pytest.raises(UidRegistryError, match="writable by nobody else"):
        first_uid(make_pool(tmp_path))  # the same, as a reservation says it
    os.chmod(path, 0o755)
    if os.geteuid() == 0:
        os.chown(path, 4242, 4242)
        with pytest.raises(UidRangeError, match="owner 4242"):
            claim_block(Ledger(str(path)), Owner("r", 1, 1), NO_HOST)


def test_a_ledger_file_that_is_not_a_record_refuses_the_start(tmp_path: Path) -> None:
    """Garbage (or a symlink) where a block's record should be: the block is not the data
    dir's to use, and the start says which file."""
    pool = make_pool(tmp_path)
    first_uid(pool)
    (tmp_path / "ledger" / "1").unlink()
    (tmp_path / "ledger" / "1").symlink_to("/etc/passwd")
    with pytest.raises(UidRangeError, match=r"ledger/1 is not a ledger record"):
        pool.check()


def test_release_gives_a_data_dirs_blocks_back(tmp_path: Path) -> None:
    """What a test's cleanup (or an operator, for a data dir gone for good) does."""
    pool = make_pool(tmp_path)
    first_uid(pool)
    assert Ledger(str(tmp_path / "ledger")).release(pool.registry) == [1]
    assert sorted(os.listdir(tmp_path / "ledger")) == [".lock"]
