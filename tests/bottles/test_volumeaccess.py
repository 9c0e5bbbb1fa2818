"""The agent VMM's access to read-write volumes under per-VM uids (``volumeaccess``): one ACL
entry for its uid on the directory resolved at create, nothing else of the user's directory
changed, recorded before it is made, removed again from that very directory. Real files, a
real second uid (``setpriv``), as root."""

from __future__ import annotations

import errno
import os
import stat
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bottlenet.bottles import posixacl, volumeaccess
from bottlenet.bottles.volumegrants import Grant, GrantBook
from bottlenet.bottles.volumes import Requester, ResolvedVolumes, VolumeRules, resolve
from bottlenet.errors import InvalidArgument, IsolationUnavailable
from vmctl.spec import Volume

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="another uid is one setpriv away as root")

VM_UID = 2_000_017
BOB = 4246
ACL = "system.posix_acl_access"
N = 0xFFFFFFFF


def writes_as(uid: int, path: Path) -> bool:
    """Whether ``uid`` (gid the same, no groups: smolvm's VMM) can create a file in ``path``."""
    r = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
         "/bin/sh", "-c", f'echo x > "{path}/.probe-$$" && rm -f "{path}/.probe-$$"'],
        capture_output=True,
    )  # fmt: skip
    return r.returncode == 0


def acl_bytes(*entries: tuple[int, int, int]) -> bytes:
    return struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", *e) for e in sorted(entries, key=lambda e: (e[0], e[2]))
    )


def named_users(path: str | Path) -> list[int]:
    try:
        acl = posixacl.Acl.decode(os.getxattr(path, ACL))
    except OSError:
        return []
    return [e.id for e in acl.entries if e.tag == posixacl.USER]


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    """A root-owned 0755 directory whose parents any uid may pass."""
    for p in (tmp_path, *tmp_path.parents):
        if p == Path("/"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o001)
    d = tmp_path / "work"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    (d / "file").write_text("mine\n")
    return d


@pytest.fixture
def book(tmp_path: Path) -> GrantBook:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return GrantBook(str(state))


def resolved(*paths: Path, read_only: bool = False) -> ResolvedVolumes:
    """The volumes as a create by root resolves them."""
    volumes = [Volume(str(p), f"/w{i}", read_only=read_only) for i, p in enumerate(paths)]
    labels = [f"agent.volumes[{i}]" for i in range(len(paths))]
    return resolve(volumes, labels, Requester.daemon(), VolumeRules(), reachable=True)


@pytest.fixture
def grant_on(book: GrantBook) -> Iterator[object]:
    """``grant_on(path, ...)``: grant ``VM_UID`` on those directories (closed after)."""
    opened: list[ResolvedVolumes] = []

    def run(*paths: Path) -> list[Grant]:
        r = resolved(*paths)
        opened.append(r)
        return volumeaccess.grant(r, VM_UID, book, "b1")

    yield run
    for r in opened:
        r.close()


def test_grant_lets_only_that_uid_write_and_revoke_restores_everything(
    volume: Path, book: GrantBook, grant_on
) -> None:
    """The root 0755 directory: the VM's uid cannot write it, then can (and another uid still
    cannot); owner, group, the owner's and others' bits and the files are unchanged; revoke
    leaves the directory as it was (no ACL, 0755) and its record gone."""
    before = os.stat(volume)
    assert not writes_as(VM_UID, volume)
    granted = grant_on(volume)
    assert [g.path for g in granted] == [str(volume)]
    assert book.grants(VM_UID) == granted
    assert writes_as(VM_UID, volume)
    assert not writes_as(VM_UID + 1, volume)
    now = os.stat(volume)
    assert (now.st_uid, now.st_gid) == (before.st_uid, before.st_gid)
    assert stat.S_IMODE(now.st_mode) & 0o707 == 0o705
    assert (volume / "file").read_text() == "mine\n"
    assert volumeaccess.revoke(granted, book) == []
    assert not writes_as(VM_UID, volume)
    assert stat.S_IMODE(os.stat(volume).st_mode) == 0o755
    with pytest.raises(OSError):
        os.getxattr(volume, ACL)
    assert book.grants() == []


def test_read_only_and_already_writable_volumes_are_left_alone(
    volume: Path, book: GrantBook
) -> None:
    """A ``:ro`` volume, or one the VM's uid may already write (by its mode for others, or
    as the directory's owner), gets no entry."""
    with resolved(volume, read_only=True) as r:
        assert volumeaccess.grant(r, VM_UID, book, "b1") == []
    os.chmod(volume, 0o777)
    with resolved(volume) as r:
        assert volumeaccess.grant(r, VM_UID, book, "b1") == []
    os.chmod(volume, 0o755)
    os.chown(volume, VM_UID, VM_UID)
    with resolved(volume) as r:
        assert volumeaccess.grant(r, VM_UID, book, "b1") == []
    with pytest.raises(OSError):
        os.getxattr(volume, ACL)


def test_others_write_without_search_still_needs_the_grant(volume: Path, grant_on) -> None:
    """``o+w`` without ``o+x`` does not let the VM's uid create a file: it gets the entry
    (tests-4 A03: the old rule took ``o+w`` alone for writable)."""
    os.chmod(volume, 0o756)
    assert not writes_as(VM_UID, volume)
    assert [g.uid for g in grant_on(volume)] == [VM_UID]
    assert writes_as(VM_UID, volume)


def test_revoke_keeps_the_users_own_acl_entries(volume: Path, book: GrantBook, grant_on) -> None:
    """An ACL the user had (a named user of theirs, the mask rwx) survives the grant and its
    revoke byte for byte."""
    own = acl_bytes((1, 7, N), (2, 5, 4242), (4, 5, N), (0x10, 7, N), (0x20, 5, N))
    os.setxattr(volume, ACL, own)
    granted = grant_on(volume)
    assert writes_as(VM_UID, volume)
    volumeaccess.revoke(granted, book)
    assert os.getxattr(volume, ACL) == own
    assert not writes_as(VM_UID, volume)


def test_a_mask_the_grant_would_widen_refuses_it(volume: Path, book: GrantBook) -> None:
    """``user:bob:rwx`` held to ``r-x`` by the mask (N5): the grant would widen the mask, so
    bob could write; refused naming the directory, the ACL untouched, no record left."""
    own = acl_bytes((1, 7, N), (2, 7, BOB), (4, 5, N), (0x10, 5, N), (0x20, 5, N))
    os.setxattr(volume, ACL, own)
    assert not writes_as(BOB, volume)
    with resolved(volume) as r, pytest.raises(InvalidArgument) as info:
        volumeaccess.grant(r, VM_UID, book, "b1")
    assert f"agent.volumes[0] {str(volume)!r}: its ACL mask (r-x)" in info.value.message
    assert "\n" not in info.value.message
    assert os.getxattr(volume, ACL) == own
    assert not writes_as(BOB, volume)
    assert book.grants() == []


def test_a_users_own_entry_for_that_uid_is_replaced_not_doubled(
    volume: Path, book: GrantBook, grant_on
) -> None:
    """An entry for the VM's uid already there (``r-x``): one entry, ``rwx``, not a second
    one the kernel refuses (tests-4 A06)."""
    os.setxattr(
        volume, ACL, acl_bytes((1, 7, N), (2, 5, VM_UID), (4, 5, N), (0x10, 7, N), (0x20, 5, N))
    )
    grant_on(volume)
    assert named_users(volume) == [VM_UID]
    assert writes_as(VM_UID, volume)


def test_setgid_and_sticky_bits_come_back_after_the_revoke(
    volume: Path, book: GrantBook, grant_on
) -> None:
    """A shared ``2775``-style directory (setgid, sticky): its exact mode after the revoke
    (tests-4 A10)."""
    os.chmod(volume, 0o3750)
    granted = grant_on(volume)
    volumeaccess.revoke(granted, book)
    assert stat.S_IMODE(os.stat(volume).st_mode) == 0o3750


def test_a_failure_on_a_later_volume_takes_the_earlier_grants_back(
    tmp_path: Path, volume: Path, book: GrantBook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rw volumes, the second on a filesystem without ACLs: IsolationUnavailable, and
    the first volume's entry and record are gone again (tests-4 A07)."""
    second = tmp_path / "second"
    second.mkdir(mode=0o755)
    real_write = posixacl.write
    calls = []

    def write(fd: int, acl: posixacl.Acl) -> None:
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        real_write(fd, acl)

    monkeypatch.setattr(posixacl, "write", write)
    with resolved(volume, second) as r, pytest.raises(IsolationUnavailable):
        volumeaccess.grant(r, VM_UID, book, "b1")
    assert named_users(volume) == []
    assert stat.S_IMODE(os.stat(volume).st_mode) == 0o755
    assert book.grants() == []


def test_a_filesystem_without_acls_fails_naming_the_volume_and_uid(
    volume: Path, book: GrantBook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No POSIX ACLs (EOPNOTSUPP): IsolationUnavailable naming the volume, the uid and what
    to do; nothing granted or recorded is left."""

    def no_acls(*args: object, **kw: object) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(posixacl.os, "setxattr", no_acls)
    with resolved(volume) as r, pytest.raises(IsolationUnavailable) as info:
        volumeaccess.grant(r, VM_UID, book, "b1")
    assert f"uid {VM_UID} cannot write it" in info.value.message
    assert str(volume) in info.value.message and "':ro'" in info.value.message
    assert book.grants() == []


def test_the_grant_is_recorded_before_it_is_made(
    volume: Path, book: GrantBook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the ACL is written its record is already on disk (a crash in between leaves a
    record recovery takes back, never an entry nothing knows of)."""
    seen: list[list[Grant]] = []
    real_write = posixacl.write

    def write(fd: int, acl: posixacl.Acl) -> None:
        seen.append(GrantBook(os.path.dirname(book.dir)).grants())
        real_write(fd, acl)

    monkeypatch.setattr(posixacl, "write", write)
    with resolved(volume) as r:
        granted = volumeaccess.grant(r, VM_UID, book, "b1")
    assert seen == [granted]


def test_the_revoke_finds_the_granted_directory_after_a_rename(
    tmp_path: Path, volume: Path, book: GrantBook, grant_on
) -> None:
    """The volume's owner renames it away and puts another directory at its path (N3
    ``keep``): the revoke takes the entry off the directory it was made on, wherever it is
    now, and leaves the new one alone."""
    granted = grant_on(volume)
    moved = tmp_path / "moved"
    volume.rename(moved)
    volume.mkdir(mode=0o755)
    os.setxattr(
        volume, ACL, acl_bytes((1, 7, N), (2, 7, VM_UID), (4, 5, N), (0x10, 7, N), (0x20, 5, N))
    )
    assert volumeaccess.revoke(granted, book) == []
    assert named_users(moved) == []
    assert named_users(volume) == [VM_UID]  # not the one granted: untouched
    assert book.grants() == []


def test_the_revoke_without_a_handle_never_acts_on_another_directory(
    tmp_path: Path, volume: Path, book: GrantBook, grant_on
) -> None:
    """A record without a file handle (a filesystem that has none) re-opens the path without
    links: another directory there (another inode) is logged and left alone."""
    (granted,) = grant_on(volume)
    granted = Grant(granted.bottle, granted.label, granted.path, granted.dev, granted.ino, VM_UID)
    volume.rename(tmp_path / "moved")
    volume.mkdir(mode=0o755)
    os.setxattr(
        volume, ACL, acl_bytes((1, 7, N), (2, 7, VM_UID), (4, 5, N), (0x10, 7, N), (0x20, 5, N))
    )
    assert volumeaccess.revoke([granted], book) == []
    assert named_users(volume) == [VM_UID]


def test_the_revoke_never_follows_a_symlink_swapped_in(
    tmp_path: Path, volume: Path, book: GrantBook, grant_on
) -> None:
    """The volume swapped for a symlink to a root 0600 file after the grant (N3 ``unit``):
    the revoke works on the directory granted (moved aside), the file keeps its mode, and
    nothing is raised."""
    victim = tmp_path / "shadow"
    victim.write_text("root:$6$x:19000:0:99999:7:::\n")
    os.chmod(victim, 0o600)
    granted = grant_on(volume)
    os.chmod(volume, 0o777)  # the owner's own change after the grant
    aside = tmp_path / "aside"
    volume.rename(aside)
    volume.symlink_to(victim)
    assert volumeaccess.revoke(granted, book) == []
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o600
    assert named_users(aside) == []


def test_a_revoke_that_fails_is_returned_and_the_others_still_go(
    tmp_path: Path, volume: Path, book: GrantBook, grant_on, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first directory's ACL cannot be written back: the revoke returns why (it never
    raises), keeps that grant's record for the next try, and still takes the second back."""
    second = tmp_path / "second"
    second.mkdir(mode=0o755)
    granted = grant_on(volume, second)
    real_write = posixacl.write
    first_ino = os.stat(volume).st_ino

    def write(fd: int, acl: posixacl.Acl) -> None:
        if os.fstat(fd).st_ino == first_ino:
            raise OSError(errno.EIO, "Input/output error")
        real_write(fd, acl)

    monkeypatch.setattr(posixacl, "write", write)
    assert volumeaccess.revoke(granted, book) == ["Input/output error"]
    assert named_users(volume) == [VM_UID]
    assert named_users(second) == []
    assert book.grants() == [granted[0]]
