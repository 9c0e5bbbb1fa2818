"""The launch gate's marker files (security-3 audit): a name planted where a marker goes is
never followed nor written through; the gate just has no marker there."""

from __future__ import annotations

import os
from pathlib import Path

from bottlenet.bottles.probe import MARKER_PREFIX, Markers


def test_a_planted_symlink_or_fifo_at_a_marker_path_is_never_followed(tmp_path: Path) -> None:
    """O_EXCL|O_NOFOLLOW: a symlink (to a file elsewhere) or a FIFO at the marker's name makes
    no marker, the target is untouched, nothing blocks; a clean directory gets its marker."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    linked, fifo, clean = (tmp_path / n for n in ("linked", "fifo", "clean"))
    for d in (linked, fifo, clean):
        d.mkdir()
    (linked / f"{MARKER_PREFIX}n1").symlink_to(victim)
    os.mkfifo(fifo / f"{MARKER_PREFIX}n1")
    markers = Markers("n1", [str(linked), str(fifo), str(clean)])
    assert markers.paths == [str(clean / f"{MARKER_PREFIX}n1")]
    assert victim.read_text() == "keep"
    markers.remove()
    assert os.listdir(clean) == []
    assert (linked / f"{MARKER_PREFIX}n1").is_symlink()
