"""``paths.remove_tree_at``: a tree another uid writes is removed fd-relative, bounded (R3)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from bottlenet.paths import MAX_TREE_DEPTH, TreeTooLarge, _remove_subdir, remove_tree_at


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _dir_fd(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def _nest(top: Path, levels: int) -> None:
    """``levels`` nested ``sidecar/`` dirs, made fd-relative (deeper than PATH_MAX)."""
    fd = _dir_fd(top)
    for _ in range(levels):
        os.mkdir("sidecar", dir_fd=fd)
        nxt = os.open("sidecar", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    with open(os.open("notes.txt", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as fh:
        fh.write("x")
    os.close(fd)


def test_a_tree_deeper_than_path_max_is_removed_with_few_fds(tmp_path: Path) -> None:
    """600 nested directories (security-3 R3 'deep'): gone, no ENAMETOOLONG, no fd left."""
    (tmp_path / "s1").mkdir()
    _nest(tmp_path / "s1", 600)
    before = _fds()
    parent = _dir_fd(tmp_path)
    try:
        remove_tree_at(parent, "s1")
    finally:
        os.close(parent)
    assert os.listdir(tmp_path) == []
    assert _fds() == before


def test_every_kind_of_entry_goes_and_nothing_outside_is_touched(tmp_path: Path) -> None:
    """Files, a FIFO (never opened), a socket, symlinks to outside files and directories: the
    links go, what they point at stays."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    keep_sock = socket.socket(socket.AF_UNIX)
    keep_sock.bind(str(outside / "control.sock"))
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "notes.txt").write_text("x")
    os.mkfifo(tree / "sub" / "fifo")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tree / "sub" / "egress.sock"))
    (tree / "to-dir").symlink_to(outside)
    (tree / "sub" / "to-file").symlink_to(outside / "keep.txt")
    (tree / "sub" / "to-sock").symlink_to(outside / "control.sock")
    parent = _dir_fd(tmp_path)
    try:
        remove_tree_at(parent, "tree")
    finally:
        os.close(parent)
        s.close()
        keep_sock.close()
    assert sorted(os.listdir(tmp_path)) == ["outside"]
    assert sorted(os.listdir(outside)) == ["control.sock", "keep.txt"]


def test_a_directory_swapped_for_a_symlink_is_only_unlinked(tmp_path: Path) -> None:
    """The rename race (a directory listed, then exchanged with a symlink before it is
    opened): the open refuses to follow, the link itself goes, the target stays whole."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.sock").write_text("")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "sidecar").symlink_to(outside)  # what the open finds after the swap
    fd = _dir_fd(tree)
    try:
        _remove_subdir(fd, fd, "sidecar", 0, [100])
    finally:
        os.close(fd)
    assert os.listdir(tree) == []
    assert os.listdir(outside) == ["victim.sock"]


def test_more_entries_than_the_bound_is_a_typed_error_after_progress(tmp_path: Path) -> None:
    """A bounded piece of work per call: TreeTooLarge, and what it touched is gone."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for i in range(50):
        (tree / f"f{i}").write_text("")
    parent = _dir_fd(tmp_path)
    try:
        with pytest.raises(TreeTooLarge):
            remove_tree_at(parent, "tree", max_entries=20)
        assert len(os.listdir(tree)) == 30
        remove_tree_at(parent, "tree", max_entries=40)
    finally:
        os.close(parent)
    assert not tree.exists()


def test_a_plain_file_or_a_symlink_at_the_name_is_unlinked_not_followed(tmp_path: Path) -> None:
    """The name itself may be a file or a link (never followed)."""
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "keep").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    (tmp_path / "file").write_text("")
    parent = _dir_fd(tmp_path)
    try:
        remove_tree_at(parent, "link")
        remove_tree_at(parent, "file")
        remove_tree_at(parent, "missing")
    finally:
        os.close(parent)
    assert os.listdir(tmp_path) == ["target"] and os.listdir(tmp_path / "target") == ["keep"]


def test_depth_beyond_the_bound_holds_at_most_that_many_directories_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Subtrees deeper than MAX_TREE_DEPTH are moved up: open directories stay bounded."""
    import bottlenet.paths as paths

    (tmp_path / "t").mkdir()
    _nest(tmp_path / "t", 5 * MAX_TREE_DEPTH)
    real_open, open_now, most = os.open, [0], [0]
    real_close = os.close

    def counting_open(*a: object, **kw: object) -> int:
        fd: int = real_open(*a, **kw)  # type: ignore[arg-type]
        open_now[0] += 1
        most[0] = max(most[0], open_now[0])
        return fd

    def counting_close(fd: int) -> None:
        open_now[0] -= 1
        real_close(fd)

    monkeypatch.setattr(paths.os, "open", counting_open)
    monkeypatch.setattr(paths.os, "close", counting_close)
    parent = real_open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        remove_tree_at(parent, "t")
    finally:
        real_close(parent)
    assert not (tmp_path / "t").exists()
    assert most[0] <= MAX_TREE_DEPTH


def _once(
    monkeypatch: pytest.MonkeyPatch, call: str, name: str, before: Callable[[int], None]
) -> list[str]:
    """Wrap ``os.<call>`` so that its first call on ``name`` runs ``before(dir_fd)`` first:
    another uid's rename landing exactly between the scan and the removal."""
    real = getattr(os, call)
    hit: list[str] = []

    def racing(path: str, *, dir_fd: int | None = None) -> None:
        if path == name and not hit and dir_fd is not None:
            hit.append(path)
            before(dir_fd)
        real(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, call, racing)
    return hit


def _remove_at(parent_dir: Path, name: str) -> None:
    parent = _dir_fd(parent_dir)
    try:
        remove_tree_at(parent, name)
    finally:
        os.close(parent)


def test_a_file_that_became_a_directory_before_its_unlink_is_removed_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scanned as a file, a directory by its unlink (EISDIR): left for the next pass, which
    removes it; the removal does not fail."""
    (tmp_path / "s1").mkdir()
    (tmp_path / "s1" / "f").write_text("x")

    def to_dir(fd: int) -> None:
        os.unlink("f", dir_fd=fd)
        os.mkdir("f", dir_fd=fd)
        os.mknod("f/inner", dir_fd=fd)

    hit = _once(monkeypatch, "unlink", "f", to_dir)
    _remove_at(tmp_path, "s1")
    assert hit == ["f"] and os.listdir(tmp_path) == []


def test_a_directory_refilled_before_its_rmdir_is_emptied_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subdirectory refilled between its emptying and its ``rmdir`` (ENOTEMPTY): the
    parent's next pass sees it again and removes it; the removal does not fail."""
    (tmp_path / "s1" / "d").mkdir(parents=True)

    def refill(fd: int) -> None:
        os.mknod("d/late", dir_fd=fd)

    hit = _once(monkeypatch, "rmdir", "d", refill)
    _remove_at(tmp_path, "s1")
    assert hit == ["d"] and os.listdir(tmp_path) == []
