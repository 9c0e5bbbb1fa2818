"""``posixacl``: a directory's access ACL read and written through a descriptor, and
``permits``, the kernel's rule, checked against the kernel's own ``access(2)`` as real uids
(``setpriv``) on a few hundred directories of random modes and ACLs."""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
from pathlib import Path

import pytest

from bottlenet.bottles import posixacl
from bottlenet.bottles.posixacl import (
    GROUP,
    GROUP_OBJ,
    MASK,
    NO_ID,
    OTHER,
    USER,
    USER_OBJ,
    Acl,
    Credentials,
    Entry,
)
from bottlenet.paths import open_dir_nofollow

OWNER, GRP = 4300, 4400
UIDS = (4301, 4302)
GIDS = (4401, 4402)
#: Who asks: the owner, a named user, a member of the owning group, of a named group, of both
#: named groups, and someone else.
WHO = (
    Credentials(OWNER, 5000),
    Credentials(UIDS[0], 5000),
    Credentials(UIDS[1], 5000, frozenset({GRP})),
    Credentials(4303, GIDS[0]),
    Credentials(4304, 5000, frozenset(GIDS)),
    Credentials(4305, 5000),
)
CHECK = r"""
import json, os, sys
out = []
modes = (os.R_OK, os.W_OK, os.X_OK, os.R_OK | os.W_OK | os.X_OK)
for path in sys.argv[1:]:
    out.append([os.access(path, m) for m in modes])
print(json.dumps(out))
"""
WANTS = (posixacl.R, posixacl.W, posixacl.X, posixacl.RWX)


def random_acl(rng: random.Random) -> Acl:
    """A valid access ACL: minimal, or with named users and groups and a mask."""
    base = [
        Entry(USER_OBJ, rng.randrange(8)),
        Entry(GROUP_OBJ, rng.randrange(8)),
        Entry(OTHER, rng.randrange(8)),
    ]
    if rng.random() < 0.25:
        return Acl(tuple(base))
    named = [Entry(USER, rng.randrange(8), u) for u in UIDS if rng.random() < 0.6]
    named += [Entry(GROUP, rng.randrange(8), g) for g in GIDS if rng.random() < 0.6]
    return Acl((*base, *named, Entry(MASK, rng.randrange(8))))


def kernel_says(who: Credentials, paths: list[str]) -> list[list[bool]]:
    groups = ",".join(str(g) for g in sorted(who.groups)) or None
    argv = ["setpriv", f"--reuid={who.uid}", f"--regid={who.gid}"]
    argv += [f"--groups={groups}"] if groups else ["--clear-groups"]
    r = subprocess.run(
        [*argv, "/usr/bin/python3", "-c", CHECK, *paths],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    result: list[list[bool]] = json.loads(r.stdout)
    return result


@pytest.mark.skipif(os.geteuid() != 0, reason="other uids are one setpriv away as root")
def test_permits_agrees_with_the_kernel(tmp_path: Path) -> None:
    """300 directories, six requesters, four wants: ``permits`` says exactly what
    ``access(2)`` says as that uid with those groups."""
    for p in (tmp_path, *tmp_path.parents):
        if p != Path("/"):
            os.chmod(p, os.stat(p).st_mode | 0o001)
    rng = random.Random(40)
    dirs: list[tuple[str, Acl]] = []
    for i in range(300):
        d = tmp_path / f"d{i}"
        d.mkdir()
        os.chown(d, OWNER, GRP)
        acl = random_acl(rng)
        fd = open_dir_nofollow(str(d))
        try:
            posixacl.write(fd, acl)
            dirs.append((str(d), posixacl.read(fd)))
        finally:
            os.close(fd)
    disagreements = []
    for who in WHO:
        said = kernel_says(who, [p for p, _ in dirs])
        for (path, acl), kernel in zip(dirs, said, strict=True):
            st = os.stat(path)
            ours = [posixacl.permits(acl, st, who, want) for want in WANTS]
            if ours != kernel:
                disagreements.append((path, acl, who, ours, kernel))
    assert disagreements == []


def test_a_minimal_acl_written_is_the_mode_again(tmp_path: Path) -> None:
    """Writing an ACL without named entries leaves no attribute: the mode's permission bits
    come from it and setgid and sticky stay (the revoke's one call, no ``chmod``)."""
    d = tmp_path / "d"
    d.mkdir()
    os.chmod(d, 0o3755)
    fd = open_dir_nofollow(str(d))
    try:
        acl = posixacl.read(fd)
        posixacl.write(fd, acl.with_user(2_000_001, posixacl.RWX))
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o3775  # the group bits show the mask
        posixacl.write(fd, posixacl.read(fd).without_user(2_000_001))
    finally:
        os.close(fd)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o3755
    with pytest.raises(OSError):
        os.getxattr(d, posixacl.XATTR)


def test_with_user_keeps_an_existing_mask_and_without_user_drops_a_lone_one() -> None:
    """A mask already there is kept (never recomputed); a mask made for the one entry goes
    with it."""
    acl = Acl(
        (Entry(USER_OBJ, 7), Entry(GROUP_OBJ, 5), Entry(GROUP, 5, 9), Entry(MASK, 7),
         Entry(OTHER, 5))
    )  # fmt: skip
    granted = acl.with_user(7, posixacl.RWX)
    assert granted.mask == 7 and granted.user(7) == Entry(USER, 7, 7)
    assert sorted(granted.without_user(7).entries, key=lambda e: e.tag) == sorted(
        acl.entries, key=lambda e: e.tag
    )
    plain = Acl.of_mode(0o750)
    assert plain.with_user(7, posixacl.RWX).mask == 0o7
    assert plain.with_user(7, posixacl.RWX).without_user(7) == Acl(
        (Entry(USER_OBJ, 7), Entry(GROUP_OBJ, 5), Entry(OTHER, 0))
    )
    assert NO_ID == 0xFFFFFFFF
