"""What every bottlenetctl subcommand prints the same way: safe text, and an unreachable or
refusing daemon (with the exit codes scripts rely on)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TextIO

from bottlenet.control.clienterrors import ControlConnectionError
from bottlenet.errors import BottlenetError

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


def report_control_error(e: ControlConnectionError | BottlenetError, path: str, err: TextIO) -> int:
    """Explain a failed control call on ``err``; the exit status to return."""
    if isinstance(e, ControlConnectionError):
        err.write(f"error: {clean(e)}\n")
        err.write(
            f"hint: is the bottlenet daemon running? its control socket is expected at {path}"
            " (set --control or BOTTLENET_CONTROL)\n"
        )
        return EXIT_UNREACHABLE
    err.write(f"error: {clean(e.code)}: {clean(e.message)}\n")
    return EXIT_DAEMON
