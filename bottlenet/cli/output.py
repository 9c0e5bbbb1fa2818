"""What every bottlenetctl subcommand prints the same way: safe text, and an unreachable or
refusing daemon (with the exit codes scripts rely on)."""

from __future__ import annotations

from typing import TextIO

from bottlenet.control.blocking import ControlConnectionError
from bottlenet.errors import BottlenetError

EXIT_OK, EXIT_DAEMON, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


def clean(value: object) -> str:
    """Printable text only: a daemon-reported value never drives the terminal."""
    text = "" if value is None else str(value)
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


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
