"""Files a guest can write are never opened in a way that blocks the daemon (security T1)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from bottlenet.bottles.probe import collect_rw
from bottlenet.paths import NotRegularFile, open_regular
from vmctl.spec import Volume

NONCE = "n0nce"


def _collect_in_thread(
    nonce: str, volumes: list[Volume]
) -> tuple[threading.Thread, list[set[str]]]:
    out: list[set[str]] = []
    t = threading.Thread(target=lambda: out.append(collect_rw(nonce, volumes)), daemon=True)
    t.start()
    return t, out


def test_t1_collect_rw_does_not_block_on_a_fifo(tmp_path: Path) -> None:
    """T1: the guest's round-trip file swapped for a FIFO is refused at once, never opened
    for a blocking read (before the fix, open() waited for a writer: the reactor hung)."""
    vol = tmp_path / "vol"
    vol.mkdir()
    fifo = vol / f".bottlenet-gate-{NONCE}"
    os.mkfifo(fifo)
    t, out = _collect_in_thread(NONCE, [Volume(str(vol), "/work", read_only=False)])
    t.join(timeout=10)
    if t.is_alive():  # the broken tree: unblock the thread so the run ends, then fail
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join()
        pytest.fail("collect_rw blocked in open() on a FIFO")
    assert out == [set()]  # not seen: the gate fails closed on this volume
    assert not fifo.exists()  # the guest's FIFO is removed like the file would be


def test_t1_collect_rw_refuses_a_symlink_to_the_right_content(tmp_path: Path) -> None:
    """A symlink to a file holding the nonce does not count as the guest's file."""
    vol = tmp_path / "vol"
    vol.mkdir()
    real = tmp_path / "elsewhere"
    real.write_text(f"{NONCE}\n")
    (vol / f".bottlenet-gate-{NONCE}").symlink_to(real)
    assert collect_rw(NONCE, [Volume(str(vol), "/work", read_only=False)]) == set()
    assert real.exists()  # the link is removed, never its target


def test_collect_rw_still_sees_a_regular_file(tmp_path: Path) -> None:
    """The honest round trip still passes: a regular file with the nonce line."""
    vol = tmp_path / "vol"
    vol.mkdir()
    (vol / f".bottlenet-gate-{NONCE}").write_text(f"{NONCE}\n")
    assert collect_rw(NONCE, [Volume(str(vol), "/work", read_only=False)]) == {"/work"}
    assert not (vol / f".bottlenet-gate-{NONCE}").exists()


def test_collect_rw_looks_in_the_directory_resolved_at_create(tmp_path: Path) -> None:
    """A create's round trip is looked for in the volume's resolved directory: its path
    re-pointed since (the directory moved aside, a symlink to another in its place) finds the
    guest's file where the directory went, and a file in the other one does not count."""
    vol = tmp_path / "vol"
    vol.mkdir()
    fd = os.open(vol, os.O_PATH | os.O_DIRECTORY)
    try:
        vol.rename(tmp_path / "aside")
        other = tmp_path / "other"
        other.mkdir()
        vol.symlink_to(other)
        (other / f".bottlenet-gate-{NONCE}").write_text(f"{NONCE}\n")
        volume = Volume(str(vol), "/work", read_only=False)
        assert collect_rw(NONCE, [volume], {"/work": fd}) == set()
        assert (other / f".bottlenet-gate-{NONCE}").exists()  # not ours to remove
        (tmp_path / "aside" / f".bottlenet-gate-{NONCE}").write_text(f"{NONCE}\n")
        assert collect_rw(NONCE, [volume], {"/work": fd}) == {"/work"}
        assert not (tmp_path / "aside" / f".bottlenet-gate-{NONCE}").exists()
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory", "socket"])
def test_open_regular_refuses_what_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    """FIFOs, symlinks, directories and sockets are refused without being opened."""
    import socket

    p = tmp_path / "x"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "symlink":
        (tmp_path / "t").write_text("x")
        p.symlink_to(tmp_path / "t")
    elif kind == "directory":
        p.mkdir()
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        s.close()
    with pytest.raises(NotRegularFile):
        open_regular(str(p))
