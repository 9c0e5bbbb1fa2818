"""Request/answer boxes without a reactor, built from the same Command definitions.

The blocking client uses this; so do tests. The byte format comes only from
``Command.makeArguments`` / ``AmpBox.serialize`` and ``Command.parseResponse``, so there is
no second copy of the wire format.
"""

from __future__ import annotations

from typing import Any

from twisted.protocols import amp

from bottlenet.control.commands import ERROR_BY_CODE
from bottlenet.errors import BottlenetError


class RemoteError(BottlenetError):
    """An error code this client does not know (a newer daemon, or ``UNHANDLED``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def request_box(command: type[amp.Command], tag: bytes, arguments: dict[str, Any]) -> amp.AmpBox:
    box = command.makeArguments(arguments, None)
    box[amp.COMMAND] = command.commandName
    box[amp.ASK] = tag
    return box


def encode_request(command: type[amp.Command], tag: bytes, arguments: dict[str, Any]) -> bytes:
    return request_box(command, tag, arguments).serialize()


def error_from_box(box: amp.AmpBox) -> BottlenetError:
    """The typed exception for an ``_error`` box (unknown codes give RemoteError)."""
    code = box.get(amp.ERROR_CODE, b"").decode("ascii", "replace")
    message = box.get(amp.ERROR_DESCRIPTION, b"").decode("utf-8", "replace")
    cls = ERROR_BY_CODE.get(code)
    if cls is None:
        return RemoteError(code or "UNKNOWN", message)
    return cls(message)


def decode_answer(command: type[amp.Command], box: amp.AmpBox) -> dict[str, Any]:
    """The parsed answer, or raise the typed error it carries."""
    if amp.ERROR in box:
        raise error_from_box(box)
    return command.parseResponse(box, None)
