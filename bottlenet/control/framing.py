"""A bounded, sans-IO parser for AMP boxes.

Stock AMP (``BinaryBoxProtocol``) keeps adding keys to a box until the peer sends the
terminator, so an unterminated box grows memory without bound. This parser enforces our
own caps *before* buffering the bytes a length prefix announces, so the memory held per
connection stays below ``MAX_BOX_BYTES`` plus one read. The server protocol and both
blocking clients share it, so there is one implementation of the framing; it imports no
Twisted unless asked for ``AmpBox``es (the light client takes plain dicts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from twisted.protocols import amp

MAX_KEY_LENGTH = 255
MAX_VALUE_LENGTH = 0xFFFF
MAX_KEYS_PER_BOX = 64
MAX_BOX_BYTES = 256 * 1024


class FramingError(Exception):
    """The peer broke the framing rules; the connection must be closed.

    The message only names the rule, never the peer's bytes.
    """


def encode_box(box: Mapping[bytes, bytes]) -> bytes:
    """One box on the wire: sorted keys, each key and value behind a 2-byte length, then
    an empty key (the bytes ``AmpBox.serialize`` writes)."""
    out = bytearray()
    for key, value in sorted(box.items()):
        if len(key) > MAX_KEY_LENGTH or len(value) > MAX_VALUE_LENGTH:
            raise ValueError("key or value too long for a box")
        out += len(key).to_bytes(2, "big") + key + len(value).to_bytes(2, "big") + value
    return bytes(out + b"\0\0")


class BoxParser:
    """Turn a byte stream into AMP boxes, one at a time, under fixed caps.

    Boxes are ``amp.AmpBox`` unless ``box_type`` says otherwise (``dict``: no Twisted).
    """

    def __init__(
        self,
        max_keys: int = MAX_KEYS_PER_BOX,
        max_box_bytes: int = MAX_BOX_BYTES,
        box_type: Callable[[dict[bytes, bytes]], Any] | None = None,
    ) -> None:
        if box_type is None:
            from twisted.protocols.amp import AmpBox

            box_type = AmpBox
        self._box_type = box_type
        self._max_keys = max_keys
        self._max_box_bytes = max_box_bytes
        self._buf = bytearray()
        self._pos = 0
        self._box: dict[bytes, bytes] = {}
        self._box_bytes = 0
        self._key: bytes | None = None
        self.failed: FramingError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed (for tests and accounting)."""
        return len(self._buf) - self._pos

    @property
    def mid_box(self) -> bool:
        """True when a box has started but is not finished (a truncated frame at EOF)."""
        return bool(self._box) or self._key is not None or self.buffered > 0

    def take_rest(self) -> bytes:
        """Everything received after the last complete box (the connection switched away
        from AMP); the parser is empty afterwards."""
        rest = bytes(self._buf[self._pos :])
        self._buf = bytearray()
        self._pos = 0
        return rest

    def feed(self, data: bytes) -> None:
        if self.failed is not None:
            return
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def _fail(self, why: str) -> FramingError:
        self.failed = FramingError(why)
        self._buf = bytearray()
        self._pos = 0
        self._box = {}
        return self.failed

    def next_box(self) -> amp.AmpBox | None:
        """Return the next complete box, None if more bytes are needed.

        Raises FramingError (and stays failed) when the peer breaks a rule.
        """
        if self.failed is not None:
            raise self.failed
        buf = self._buf
        while True:
            avail = len(buf) - self._pos
            if avail < 2:
                return None
            length = int.from_bytes(buf[self._pos : self._pos + 2], "big")
            if self._key is None:
                if length == 0:
                    self._pos += 2
                    if not self._box:
                        raise self._fail("empty box")
                    box = self._box_type(self._box)
                    self._box = {}
                    self._box_bytes = 0
                    return box
                if length > MAX_KEY_LENGTH:
                    raise self._fail("key longer than 255 bytes")
                if len(self._box) >= self._max_keys:
                    raise self._fail(f"box has more than {self._max_keys} keys")
            if self._box_bytes + 2 + length > self._max_box_bytes:
                raise self._fail(f"box larger than {self._max_box_bytes} bytes")
            if avail < 2 + length:
                return None
            start = self._pos + 2
            chunk = bytes(buf[start : start + length])
            self._pos = start + length
            self._box_bytes += 2 + length
            if self._key is None:
                if chunk in self._box:
                    raise self._fail("duplicate key in box")
                self._key = chunk
            else:
                self._box[self._key] = chunk
                self._key = None
