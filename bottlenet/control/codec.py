"""Request/answer boxes without a reactor, built from the same Command definitions.

The blocking client uses this; so do tests. The byte format comes only from
``Command.makeArguments`` / ``AmpBox.serialize`` and ``Command.parseResponse``, so there is
no second copy of the wire format.
"""

from __future__ import annotations

from typing import Any

from twisted.protocols import amp

from bottlenet.control.clienterrors import RemoteError, error_for
from bottlenet.control.commands import ERROR_BY_CODE
from bottlenet.errors import BottlenetError

__all__ = ["RemoteError", "decode_answer", "encode_request", "error_from_box", "request_box"]


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
    return error_for(code, message, ERROR_BY_CODE)


def decode_answer(command: type[amp.Command], box: amp.AmpBox) -> dict[str, Any]:
    """The parsed answer, or raise the typed error it carries."""
    if amp.ERROR in box:
        raise error_from_box(box)
    return command.parseResponse(box, None)
