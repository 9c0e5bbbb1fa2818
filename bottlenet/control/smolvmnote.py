"""smolvm's packed-assets note, dropped from the head of an exec's output stream.

The ``smolmachines`` wheel's binary (``smol/smol-vmm``, what ``bottlenet[vm]`` installs)
prints ``note: no packed assets found for 'smol-vmm' (...)`` as the first line of its stderr
on every call, before anything else (1.32.2, run here). vmctl drops it from captured calls
(``vmctl.errors.strip_notes``); an attached exec streams, so the stream's head is checked
here instead: the daemon's exec session for framed output (stderr, or the terminal's one
stream with ``-t``, where it ends ``\\r\\n``), the client's exec session for the stderr pipe
it takes over. Only the first line of a stream can be the note, and at most
:data:`MAX_NOTE` bytes are held while that is undecided: a stream whose first bytes are not
the note passes unchanged, with no delay once they differ.
"""

from __future__ import annotations

#: How the note starts (the rest names the executable and where it looked).
PREFIX = b"note: no packed assets found for "
#: The longest first line that may be the note (the 1.32.2 one is about 230 bytes).
MAX_NOTE = 1024


class NoteFilter:
    """One output stream: :meth:`feed` each chunk, :meth:`flush` at its end."""

    def __init__(self) -> None:
        self._held = bytearray()
        self.decided = False

    def feed(self, data: bytes) -> bytes:
        """The bytes to pass on now (the note, once whole, is dropped)."""
        if self.decided:
            return data
        self._held += data
        head = bytes(self._held)
        size = min(len(head), len(PREFIX))
        if head[:size] != PREFIX[:size]:
            return self.flush()
        end = head.find(b"\n")
        if end >= 0:
            self._held.clear()
            self.decided = True
            return head[end + 1 :]
        if len(head) > MAX_NOTE:
            return self.flush()
        return b""

    def flush(self) -> bytes:
        """Whatever is held, as it came (not the note after all, or the stream ended)."""
        self.decided = True
        held = bytes(self._held)
        self._held.clear()
        return held
