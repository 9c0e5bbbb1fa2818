"""A create's volumes resolved once, without links, and checked for whoever asks
(``bottles/volumes.py``): real directories, symlinks and ACLs; the requester's uids are numbers
the kernel never sees here (``posixacl.permits`` is checked against the kernel in
``test_posixacl.py``)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from bottlenet.bottles.volumes import (
    Requester,
    RequesterKind,
    ResolvedVolumes,
    VolumeRules,
    resolve,
)
from bottlenet.errors import InvalidArgument
from vmctl.spec import Volume

ALICE = 4244
SCOPED = 4243
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def alice(*, scoped: bool = False) -> Requester:
    return Requester.local(ALICE, ALICE, (), scoped=scoped)


def check(
    host: Path | str,
    requester: Requester | None = None,
    rules: VolumeRules | None = None,
    *,
    read_only: bool = False,
    reachable: bool = False,
) -> ResolvedVolumes:
    return resolve(
        [Volume(str(host), "/w", read_only=read_only)],
        ["agent.volumes[0]"],
        requester or Requester.daemon(),
        rules or VolumeRules(),
        reachable=reachable,
    )


def refused(*args: object, **kw: object) -> str:
    with pytest.raises(InvalidArgument) as info:
        check(*args, **kw).close()  # type: ignore[arg-type]
    message = info.value.message
    assert "\n" not in message
    return message


def test_the_kernels_path_of_the_directory_is_what_smolvm_gets(tmp_path: Path) -> None:
    """A plain directory: one descriptor of it, its device and inode, the path as given."""
    work = tmp_path / "work"
    work.mkdir()
    with check(work) as r:
        (one,) = r
        st = os.stat(work)
        assert (one.dev, one.ino) == (st.st_dev, st.st_ino)
        assert stat.S_ISDIR(os.fstat(one.fd).st_mode)
        assert r.volumes == [Volume(str(work), "/w")]
        assert r.specs() == (f"{work}:/w:rw",)
    with pytest.raises(OSError):
        os.fstat(one.fd)  # closed with the block


def test_a_symlink_anywhere_in_the_path_is_refused_naming_it(tmp_path: Path) -> None:
    """The last component or any parent: refused, the link named, nothing followed (N1
    ``symlink``)."""
    real = tmp_path / "real"
    (real / "etc").mkdir(parents=True)
    (tmp_path / "proj").symlink_to(real)
    (tmp_path / "last").symlink_to(real / "etc")
    message = refused(tmp_path / "proj" / "etc")
    assert f"{str(tmp_path / 'proj')!r} is a symlink" in message
    assert message.startswith(f"agent.volumes[0] {str(tmp_path / 'proj' / 'etc')!r}: ")
    assert f"{str(tmp_path / 'last')!r} is a symlink" in refused(tmp_path / "last")


def test_a_missing_directory_or_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert "not an existing directory" in refused(tmp_path / "nope")
    assert "not an existing directory" in refused(tmp_path / "f")
    assert "not an existing directory" in refused(tmp_path / "f" / "below")


def test_the_daemons_own_paths_are_refused_by_identity(tmp_path: Path) -> None:
    """A protected path itself, one inside it, one holding it (``/`` too), one holding a
    protected file: refused; a sibling is fine."""
    state = tmp_path / "state"
    (state / "bottles").mkdir(parents=True)
    tls = tmp_path / "tls"
    tls.mkdir()
    (tls / "daemon.key").write_text("k")
    work = tmp_path / "work"
    work.mkdir()
    rules = VolumeRules(protected=(str(state), str(tls / "daemon.key")))
    for host in (state, state / "bottles", tmp_path, Path("/"), tls):
        assert "overlaps the daemon's own path" in refused(host, rules=rules)
    check(work, rules=rules).close()


def test_a_protected_path_not_made_yet_is_compared_by_its_real_path(tmp_path: Path) -> None:
    """smolvm's data dir before its first use: a volume that would hold it is refused."""
    rules = VolumeRules(protected=(str(tmp_path / "data" / "smolvm"),))
    (tmp_path / "data").mkdir()
    assert "overlaps the daemon's own path" in refused(tmp_path / "data", rules=rules)


@as_root
def test_a_local_peer_may_use_only_what_its_own_uid_may(tmp_path: Path) -> None:
    """A read-write volume must be a directory the requester's uid may write, a read-only one
    one it may read: root's 0755 directory is refused to alice for rw, not for ro; her own
    directory is hers either way (N1: checked with her rights, not the daemon's)."""
    roots = tmp_path / "root-owned"
    roots.mkdir(mode=0o755)
    os.chmod(roots, 0o755)
    message = refused(roots, alice())
    assert message == (
        f"agent.volumes[0] {str(roots)!r}: uid {ALICE} may not write it itself, and a "
        "read-write volume must be a directory its requester may write"
    )
    check(roots, alice(), read_only=True).close()
    os.chmod(roots, 0o750)
    assert "may not read it itself" in refused(roots, alice(), read_only=True)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    os.chown(mine, ALICE, ALICE)
    check(mine, alice()).close()


@as_root
def test_a_group_the_peer_is_in_counts(tmp_path: Path) -> None:
    """A 0770 directory of group 4300: alice with 4300 among her groups may use it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 0, 4300)
    os.chmod(shared, 0o770)
    refused(shared, alice())
    check(shared, Requester.local(ALICE, ALICE, (4300,), scoped=False)).close()


@as_root
def test_a_scoped_peers_rw_volume_needs_a_volume_root(tmp_path: Path) -> None:
    """A scoped peer: a read-write volume refused without ``--volume-root`` (one line naming
    the rule), even on its own directory; under a root, one it may write is fine; a read-only
    one needs no root."""
    top = tmp_path / "scratch"
    own = top / "job"
    own.mkdir(parents=True)
    os.chown(own, SCOPED, SCOPED)
    peer = Requester.local(SCOPED, SCOPED, (), scoped=True)
    assert refused(own, peer) == (
        f"agent.volumes[0] {str(own)!r}: a scoped peer's read-write volumes must lie under a "
        "--volume-root (and the daemon has none)"
    )
    check(own, peer, read_only=True).close()
    rules = VolumeRules(roots=(str(top),))
    check(own, peer, rules).close()
    os.chown(own, 0, 0)
    assert "may not write it itself" in refused(own, peer, rules)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chown(elsewhere, SCOPED, SCOPED)
    assert f"--volume-root (under {str(top)!r})" in refused(elsewhere, peer, rules)


def test_a_tls_launchers_volumes_need_a_volume_root(tmp_path: Path) -> None:
    """No local uid: every volume must lie under a ``--volume-root``."""
    work = tmp_path / "work"
    work.mkdir()
    remote = Requester(RequesterKind.REMOTE)
    assert "a TLS launcher's volumes must lie under a --volume-root" in refused(
        work, remote, read_only=True
    )
    check(work, remote, VolumeRules(roots=(str(tmp_path),))).close()


def test_every_closed_parent_is_named(tmp_path: Path) -> None:
    """Per-VM uids: each parent without ``o+x`` is named, outermost first, with the fix
    (tests-4 A02: one closed parent pinned neither reading)."""
    for p in (tmp_path, *tmp_path.parents):
        if p != Path("/"):
            os.chmod(p, os.stat(p).st_mode | 0o001)
    outer = tmp_path / "a"
    inner = outer / "b"
    work = inner / "work"
    work.mkdir(parents=True)
    os.chmod(outer, 0o700)
    os.chmod(inner, 0o700)
    message = refused(work, reachable=True)
    assert f"cannot pass {str(outer)!r}, {str(inner)!r} (no o+x)" in message
    assert f"chmod o+x {str(outer)!r} {str(inner)!r} or" in message
    os.chmod(outer, 0o701)
    os.chmod(inner, 0o701)
    check(work, reachable=True).close()


def test_a_refusal_closes_what_was_opened(tmp_path: Path) -> None:
    """The second volume refused: the first one's descriptor is closed too."""
    good = tmp_path / "good"
    good.mkdir()
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(InvalidArgument):
        resolve(
            [Volume(str(good), "/a"), Volume(str(tmp_path / "missing"), "/b")],
            ["agent.volumes[0]", "agent.volumes[1]"],
            Requester.daemon(),
            VolumeRules(),
            reachable=False,
        )
    assert len(os.listdir("/proc/self/fd")) == before
