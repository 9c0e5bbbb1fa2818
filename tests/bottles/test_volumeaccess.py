"""The agent VMM's access to read-write volumes under per-VM uids (``volumeaccess``): one ACL
entry for its uid, nothing else of the user's directory changed, removed again; parents it
cannot pass refused in one line. Real files, a real second uid (``setpriv``), as root."""

from __future__ import annotations

import os
import stat
import struct
import subprocess
from pathlib import Path

import pytest

from bottlenet.bottles import volumeaccess
from bottlenet.errors import InvalidArgument, IsolationUnavailable
from vmctl.spec import Volume

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="another uid is one setpriv away as root")

VM_UID = 2_000_017
LABEL = ["agent.volumes[0]"]


def writes_as(uid: int, path: Path) -> bool:
    """Whether ``uid`` (gid the same, no groups: smolvm's VMM) can create a file in ``path``."""
    r = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
         "/bin/sh", "-c", f'echo x > "{path}/.probe-$$" && rm -f "{path}/.probe-$$"'],
        capture_output=True,
    )  # fmt: skip
    return r.returncode == 0


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


def test_grant_lets_only_that_uid_write_and_revoke_restores_everything(volume: Path) -> None:
    """The root 0755 directory: the VM's uid cannot write it, then can (and another uid still
    cannot); owner, group, the owner's and others' bits and the files are unchanged; revoke
    leaves the directory as it was (no ACL, 0755)."""
    before = os.stat(volume)
    assert not writes_as(VM_UID, volume)
    granted = volumeaccess.grant([Volume(str(volume), "/work")], LABEL, VM_UID)
    assert granted == [str(volume)]
    assert writes_as(VM_UID, volume)
    assert not writes_as(VM_UID + 1, volume)
    now = os.stat(volume)
    assert (now.st_uid, now.st_gid) == (before.st_uid, before.st_gid)
    assert stat.S_IMODE(now.st_mode) & 0o707 == 0o705
    assert (volume / "file").read_text() == "mine\n"
    volumeaccess.revoke(granted, VM_UID)
    assert not writes_as(VM_UID, volume)
    assert stat.S_IMODE(os.stat(volume).st_mode) == 0o755
    with pytest.raises(OSError):
        os.getxattr(volume, "system.posix_acl_access")


def test_read_only_and_already_writable_volumes_are_left_alone(volume: Path) -> None:
    """A ``:ro`` volume, or one every uid may write, gets no entry."""
    assert volumeaccess.grant([Volume(str(volume), "/w", read_only=True)], LABEL, VM_UID) == []
    os.chmod(volume, 0o777)
    assert volumeaccess.grant([Volume(str(volume), "/w")], LABEL, VM_UID) == []
    with pytest.raises(OSError):
        os.getxattr(volume, "system.posix_acl_access")


def test_revoke_keeps_the_users_own_acl_entries(volume: Path) -> None:
    """An ACL the user had (a named user of theirs) survives the grant and its revoke."""
    own = struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", *e)
        for e in ((1, 7, 0xFFFFFFFF), (2, 5, 4242), (4, 5, 0xFFFFFFFF), (0x10, 5, 0xFFFFFFFF),
                  (0x20, 5, 0xFFFFFFFF))
    )  # fmt: skip
    os.setxattr(volume, "system.posix_acl_access", own)
    granted = volumeaccess.grant([Volume(str(volume), "/w")], LABEL, VM_UID)
    assert writes_as(VM_UID, volume)
    volumeaccess.revoke(granted, VM_UID)
    assert os.getxattr(volume, "system.posix_acl_access") == own
    assert not writes_as(VM_UID, volume)


def test_a_parent_no_vm_uid_can_pass_is_refused_in_one_line(volume: Path) -> None:
    """Under a 0700 parent: InvalidArgument naming the volume, that parent and the fix."""
    os.chmod(volume.parent, 0o700)
    with pytest.raises(InvalidArgument) as info:
        volumeaccess.check_reachable([Volume(str(volume), "/w")], LABEL)
    message = info.value.message
    assert "\n" not in message
    assert message.startswith(f"agent.volumes[0] {str(volume)!r}: the agent VM's own uid")
    assert f"chmod o+x {str(volume.parent)!r}" in message
    os.chmod(volume.parent, 0o701)
    volumeaccess.check_reachable([Volume(str(volume), "/w")], LABEL)


def test_a_filesystem_without_acls_fails_naming_the_volume_and_uid(
    volume: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No POSIX ACLs (EOPNOTSUPP): IsolationUnavailable naming the volume, the uid and what
    to do; nothing granted is left."""
    import errno

    def no_acls(*args: object, **kw: object) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(volumeaccess.os, "setxattr", no_acls)
    with pytest.raises(IsolationUnavailable) as info:
        volumeaccess.grant([Volume(str(volume), "/w")], LABEL, VM_UID)
    assert f"uid {VM_UID} cannot write it" in info.value.message
    assert str(volume) in info.value.message and "':ro'" in info.value.message
