"""``vmctl.residue``: what a uid still holds, read from ``/proc`` as hostile ground (a fake
``/proc`` tree here; the real one in ``tests/vmctl/test_uids.py``)."""

from __future__ import annotations

import os
from pathlib import Path

from vmctl.residue import file_holders, ipc_holders, process_holders, socket_holders

U = 2_065_600


def test_a_process_holds_a_uid_as_any_of_its_user_or_group_ids(tmp_path: Path) -> None:
    """Real, effective, saved or filesystem uid, or any gid; a zombie holds nothing."""
    for pid, status in (
        (10, f"Name:\tx\nState:\tS\nUid:\t0\t0\t{U}\t0\nGid:\t0\t0\t0\t0\n"),
        (11, f"Name:\ty\nState:\tS\nUid:\t0\t0\t0\t0\nGid:\t0\t{U + 1}\t0\t0\n"),
        (12, f"Name:\tz\nState:\tZ (zombie)\nUid:\t{U + 2}\t{U + 2}\t{U + 2}\t{U + 2}\n"),
    ):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "status").write_text(status)
    found = process_holders({U, U + 1, U + 2}, str(tmp_path))
    assert found == {U: "process 10", U + 1: "process 11"}


def test_ipc_objects_and_ip_sockets_are_found_by_their_owner_columns(tmp_path: Path) -> None:
    """System V tables by their header (``uid``, ``cuid``, ...); socket tables by the 8th
    field, also for a socket no process holds any more."""
    (tmp_path / "sysvipc").mkdir()
    (tmp_path / "sysvipc" / "shm").write_text(
        "       key      shmid perms       size  cpid  lpid nattch   uid   gid  cuid  cgid\n"
        f"         0          7   600       4096     1     1      0     0     0  {U}     0\n"
    )
    (tmp_path / "sysvipc" / "sem").write_text("key semid perms nsems uid gid cuid cgid\n")
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp6").write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
        f"   0: 0000:1F90 0000:0000 06 00000000:00000000 03:00001234 00000000 {U + 1} 0 0\n"
    )
    assert ipc_holders({U, U + 1}, str(tmp_path)) == {U: "System V shm 7"}
    assert socket_holders({U, U + 1}, str(tmp_path)) == {U + 1: "tcp6 socket"}


def test_files_are_found_by_owner_or_group_and_nothing_is_followed(tmp_path: Path) -> None:
    """A symlink at a root proves nothing (incomplete); one inside is looked at, not
    through; a root that is gone holds nothing; the budget bounds the walk."""
    shared, other = tmp_path / "shared", tmp_path / "other"
    (shared / "deep").mkdir(parents=True)
    other.mkdir()
    (other / "theirs").write_text("")
    os.chown(other / "theirs", U + 5, U + 5)
    (shared / "deep" / "f").write_text("")
    os.chown(shared / "deep" / "f", 0, U)
    (shared / "link").symlink_to(other)
    (tmp_path / "vol").symlink_to(other)
    walked = file_holders({U, U + 5}, [str(shared), str(tmp_path / "vol"), str(tmp_path / "gone")])
    assert walked.owners == {U: str(shared / "deep" / "f")}
    assert walked.incomplete == (str(tmp_path / "vol"),)
    assert file_holders({U}, [str(shared)], budget=2).incomplete == (str(shared),)
