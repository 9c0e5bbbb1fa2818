"""The packed-assets note filter (``bottlenet.control.smolvmnote``): the first line of a stream
is dropped only when it is smolvm's note, whatever the chunks; nothing else is held or lost."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bottlenet.control.smolvmnote import MAX_NOTE, NoteFilter

NOTE = (
    b"note: no packed assets found for 'smol-vmm' (looked for a 'smol-vmm.smolmachine' sidecar "
    b"next to the executable); running as the plain smolvm CLI. If this is a packed binary, "
    b"keep its .smolmachine file alongside it."
)


def through(chunks: list[bytes]) -> bytes:
    f = NoteFilter()
    return b"".join(f.feed(c) for c in chunks) + f.flush()


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@given(st.binary(max_size=300), st.lists(st.integers(min_value=0), max_size=8))
def test_note_first_is_dropped_in_any_chunks(rest: bytes, cuts: list[int]) -> None:
    """The note's line (``\\n`` or a terminal's ``\\r\\n``) goes, what follows stays whole."""
    for end in (b"\n", b"\r\n"):
        assert through(split(NOTE + end + rest, cuts)) == rest


@given(st.binary(max_size=300), st.lists(st.integers(min_value=0), max_size=8))
def test_other_streams_pass_unchanged(data: bytes, cuts: list[int]) -> None:
    """A stream that does not start with the note passes byte for byte (a note later on is
    the guest's own output and stays)."""
    if not data or data.startswith(b"note: no packed"):
        data = b"x" + data
    assert through(split(data, cuts)) == data
    assert through(split(data + NOTE + b"\n", cuts)) == data + NOTE + b"\n"


def test_nothing_is_held_once_the_head_differs() -> None:
    """The first differing byte releases the head at once (no delay for ordinary output)."""
    f = NoteFilter()
    assert f.feed(b"note: no") == b""
    assert f.feed(b"w then") == b"note: now then"
    assert f.feed(b" more") == b" more"


def test_a_head_that_never_ends_is_bounded() -> None:
    """A first line that looks like the note but never ends is released past MAX_NOTE."""
    f = NoteFilter()
    long = NOTE + b"x" * MAX_NOTE
    assert f.feed(long) == long
    g = NoteFilter()
    assert g.feed(NOTE) == b"" and g.flush() == NOTE  # the stream ended: nothing lost


def test_the_hold_is_exactly_max_note_bytes() -> None:
    """A head of exactly MAX_NOTE bytes that may still be the note is held; one more byte
    releases it."""
    head = NOTE + b"x" * (MAX_NOTE - len(NOTE))
    f = NoteFilter()
    assert f.feed(head) == b""
    assert f.feed(b"y") == head + b"y"


def test_after_the_note_a_chunk_that_looks_like_it_passes_at_once() -> None:
    """Once the note is dropped every later chunk passes as it comes: one that starts like
    the note (or is its whole line again) is the command's own output."""
    f = NoteFilter()
    assert f.feed(NOTE + b"\n") == b""
    assert f.feed(b"n") == b"n"
    assert f.feed(NOTE + b"\n") == NOTE + b"\n"
