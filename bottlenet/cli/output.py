"""What every bottlenetctl subcommand prints the same way: safe text, and an unreachable or
refusing daemon (with the exit codes scripts rely on)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import TextIO

from bottlenet.control.clienterrors import (
    ClosedBeforeAnswer,
    ControlConnectionError,
    DaemonUnreachable,
)
from bottlenet.errors import BottlenetError, safe_repr

EXIT_OK, EXIT_DAEMON, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


def clean(value: object) -> str:
    """Printable text only: a daemon-reported value never drives the terminal."""
    text = "" if value is None else str(value)
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def table_lines(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """The one table renderer: left-aligned columns two spaces apart, every cell cleaned."""
    cells = [[clean(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [list(headers), *cells]
    ]


def write_table(headers: Sequence[str], rows: Iterable[Sequence[object]], out: TextIO) -> None:
    """:func:`table_lines`, written to ``out``."""
    for line in table_lines(headers, rows):
        out.write(line + "\n")


def write_error(err: TextIO, code: str, message: str, *, as_json: bool, hint: str = "") -> None:
    """Under ``--json`` one JSON object per failure (``code``, ``message``, maybe ``hint``),
    so a script parses errors as it parses output; else ``error: CODE: message``."""
    if as_json:
        doc = {"code": code, "message": message, **({"hint": hint} if hint else {})}
        err.write(json.dumps(doc, sort_keys=True) + "\n")
        return
    err.write(f"error: {clean(code)}: {clean(message)}\n")
    if hint:
        err.write(f"hint: {clean(hint)}\n")


def usage_error(err: TextIO, message: str, *, as_json: bool, prog: str = "bottlenetctl") -> int:
    """A usage error (exit 2): ``PROG: error: message``, or code ``USAGE`` under ``--json``."""
    if as_json:
        write_error(err, "USAGE", message, as_json=True)
    else:
        err.write(f"{prog}: error: {clean(message)}\n")
    return EXIT_USAGE


def _unreachable_hint(e: ControlConnectionError, path: str) -> str:
    """``hint: ...``, where to look: a daemon that ended the connection unanswered refused
    this peer (it runs: "is it running?" would point the wrong way); else, is it running."""
    if isinstance(e, ClosedBeforeAnswer):
        uid = os.geteuid()
        return (
            "hint: the daemon refused this connection: it accepts only its own uid and the "
            f"uids it was started with --allow-uid, and this is uid {uid} (start it with "
            f"--allow-uid {uid}; its log says 'control: refused peer uid={uid}'), or it was at its "
            "--control-max-connections cap"
        )
    if isinstance(e, DaemonUnreachable) and e.reason == "Permission denied":
        return (
            f"hint: the control socket {path} (or its directory) does not let uid "
            f"{os.geteuid()} in: it is the daemon's user's, or its group's (bottlenet-launch "
            "in the system unit); ask to be added to that group"
        )
    return (
        f"hint: is the bottlenet daemon running? its control socket is expected at {path}"
        " (set --control or BOTTLENET_CONTROL)"
    )


def own_words(message: str, typed: Iterable[str]) -> str:
    """``message`` with the daemon's digest of a word this person typed (``<9 bytes
    sha256:...>``: the daemon never echoes an odd value raw) shown as the word, escaped: it is
    their own input, on their own terminal."""
    for word in typed:
        digest = safe_repr(word)
        if digest.startswith("<") and digest in message:
            message = message.replace(digest, ascii(word))
    return message


def report_control_error(
    e: ControlConnectionError | BottlenetError,
    path: str,
    err: TextIO,
    *,
    as_json: bool = False,
    typed: Iterable[str] = (),
) -> int:
    """Explain a failed control call on ``err``; the exit status to return.

    An unreachable daemon is code ``UNREACHABLE`` (exit 3), a refusal the daemon's code (1).
    ``typed``: the words of the command line, shown as typed where the daemon digested them.
    """
    if isinstance(e, ControlConnectionError):
        hint = _unreachable_hint(e, path)
        if as_json:
            write_error(err, "UNREACHABLE", str(e), as_json=True, hint=hint[len("hint: ") :])
        else:
            err.write(f"error: {clean(e)}\n{clean(hint)}\n")
        return EXIT_UNREACHABLE
    write_error(err, e.code, own_words(e.message, typed), as_json=as_json)
    return EXIT_DAEMON
