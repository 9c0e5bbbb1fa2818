"""``bottlenetctl bottle exec`` and ``bottle shell``: a command in a bottle's agent VM, attached.

With ``-t`` and a terminal on stdin the terminal goes raw for the session and is restored on
every way out (the command ends, Ctrl-C, SIGTERM/SIGHUP, the daemon going away); SIGWINCH
sends the new size. bottlenetctl exits with the command's exit code; 255 when the connection
to the daemon broke mid-session (as ssh does), 1/2/3 as usual when the command never started.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TextIO

from bottlenet.cli.output import clean, report_control_error, usage_error, write_error
from bottlenet.control.calls import ExecRequest
from bottlenet.control.clienterrors import ControlConnectionError
from bottlenet.errors import BottlenetError

if TYPE_CHECKING:
    from bottlenet.cli.invocation import Invocation

EXIT_SESSION_LOST = 255
DEFAULT_SHELL = "/bin/sh"


def run_exec(inv: Invocation, out: TextIO, err: TextIO) -> int:
    """``bottle exec NAME [OPTIONS] -- CMD...``: the command's exit status."""
    o = inv.options
    argv = (*o.argv, *inv.after_dashes)
    if not argv:
        return usage_error(
            err,
            "bottle exec: a command is required (bottle exec NAME -- CMD [ARG]...)",
            as_json=inv.json,
        )
    request = ExecRequest(o.name, argv, env=tuple(o.env), user=o.user, workdir=o.workdir, tty=o.tty)
    return attached(inv, request, o.interactive, err)


def run_shell(inv: Invocation, out: TextIO, err: TextIO) -> int:
    """``bottle shell NAME``: an interactive shell, on a terminal when stdin is one."""
    o = inv.options
    request = ExecRequest(o.name, (o.shell_path,), user=o.user, tty=True)
    return attached(inv, request, True, err)


def attached(
    inv: Invocation,
    request: ExecRequest,
    interactive: bool,
    err: TextIO,
    *,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
) -> int:
    """Run ``request`` (its stdin, size and fds are set here) with the terminal and the
    standard streams; the exit status for bottlenetctl."""
    stdin = stdin if stdin is not None else sys.stdin.buffer
    stdout = stdout if stdout is not None else sys.stdout.buffer
    stderr = stderr if stderr is not None else sys.stderr.buffer
    try:
        in_fd: int | None = stdin.fileno()
    except (AttributeError, OSError, ValueError):
        in_fd = None
    terminal = in_fd if (request.tty and in_fd is not None and os.isatty(in_fd)) else None
    size = None
    if terminal is not None:  # only a tty pays for the terminal module (termios, signals)
        from bottlenet.control.terminal import terminal_size

        size = terminal_size(terminal)
    if request.tty and size is None:
        size = (24, 80)
    forward = interactive or (request.tty and terminal is not None)
    request = request._replace(stdin=forward, size=size)
    client = inv.client(light=True)
    try:
        session = client.start_exec(request)
    except (ControlConnectionError, BottlenetError) as e:
        return report_control_error(e, client.path, err, as_json=inv.json)
    finally:
        client.close()
    raw = terminal if forward else None
    try:
        with session, _terminal_for(session, raw, terminal):
            return session.run(stdin if forward else None, stdout, stderr)
    except ControlConnectionError as e:
        if inv.json:
            write_error(err, "SESSION_LOST", str(e), as_json=True)
        else:
            err.write(f"\r\nerror: {clean(e)}\n")
        return EXIT_SESSION_LOST
    except KeyboardInterrupt:
        return 130


@contextmanager
def _terminal_for(session: Any, raw: int | None, terminal: int | None) -> Iterator[None]:
    """Raw mode and SIGWINCH forwarding on a tty; nothing (and no import) without one."""
    if terminal is None:
        yield
        return
    from bottlenet.control.terminal import forward_winch, raw_terminal

    with raw_terminal(raw), forward_winch(session, terminal):
        yield


def split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``bottle exec NAME [OPTIONS] -- CMD...``: bottlenetctl's words, and the command after
    the first ``--`` (None when there is no ``--``, or it is not an exec)."""
    if "--" not in argv:
        return argv, None
    cut = argv.index("--")
    if "exec" not in argv[:cut]:
        return argv, None
    return argv[:cut], argv[cut + 1 :]


def register(bottle: Any, json_flag: argparse.ArgumentParser) -> None:
    """Add ``exec``, ``shell`` and ``logs`` to ``bottlenetctl bottle``."""
    sp = bottle.add_parser(
        "exec",
        help="run a command in the bottle's agent VM",
        parents=[json_flag],
        description="Run CMD in the agent VM; bottlenetctl exits with its exit code.",
    )
    sp.add_argument("name")
    sp.add_argument("-i", "--interactive", action="store_true", help="forward stdin")
    sp.add_argument("-t", "--tty", action="store_true", help="give the command a terminal")
    sp.add_argument(
        "-e", "--env", action="append", default=[], metavar="K=V", help="extra environment"
    )
    sp.add_argument("-u", "--user", help="run as this user (name or uid[:gid])")
    sp.add_argument("-w", "--workdir", help="working directory in the VM")
    sp.add_argument("argv", nargs="*", metavar="-- CMD [ARG]...")
    sp.set_defaults(run=run_exec)

    sp = bottle.add_parser(
        "shell", help="an interactive shell in the bottle's agent VM", parents=[json_flag]
    )
    sp.add_argument("name")
    sp.add_argument("-u", "--user", help="run as this user (name or uid[:gid])")
    sp.add_argument(
        "--shell",
        dest="shell_path",
        default=DEFAULT_SHELL,
        help=f"the shell (default {DEFAULT_SHELL})",
    )
    sp.set_defaults(run=run_shell)

    sp = bottle.add_parser("logs", help="the output of the bottle's workload", parents=[json_flag])
    sp.add_argument("name")
    sp.add_argument("-f", "--follow", action="store_true", help="keep printing new output")
    sp.add_argument("--tail", type=int, default=None, metavar="N", help="last N lines (200)")
    sp.set_defaults(run=run_logs)


def run_logs(inv: Invocation, out: TextIO, err: TextIO) -> int:
    """``bottle logs NAME [--follow] [--tail N]``: the workload's output on stdout."""
    o = inv.options
    client = inv.blocking_client()
    try:
        return client.logs(
            o.name, stdout=sys.stdout.buffer, stderr=sys.stderr.buffer, tail=o.tail, follow=o.follow
        )
    except (ControlConnectionError, BottlenetError) as e:
        return report_control_error(e, client.path, err, as_json=inv.json)
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()
