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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TextIO

from bottlenet.cli.output import clean, report_control_error, write_error
from bottlenet.control.calls import ExecRequest
from bottlenet.control.clienterrors import ControlConnectionError
from bottlenet.errors import BottlenetError

if TYPE_CHECKING:  # the client is imported when a session starts, not for --help
    from bottlenet.control.blocking import BlockingControlClient
    from bottlenet.control.lightclient import LightControlClient

EXIT_SESSION_LOST = 255
DEFAULT_SHELL = "/bin/sh"


def run_exec(
    connect: Callable[[], BlockingControlClient | LightControlClient],
    args: argparse.Namespace,
    err: TextIO,
    *,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
) -> int:
    """Run ``args.argv`` in ``args.name``'s agent VM; the exit status for bottlenetctl."""
    stdin = stdin if stdin is not None else sys.stdin.buffer
    stdout = stdout if stdout is not None else sys.stdout.buffer
    stderr = stderr if stderr is not None else sys.stderr.buffer
    try:
        in_fd: int | None = stdin.fileno()
    except (AttributeError, OSError, ValueError):
        in_fd = None
    terminal = in_fd if (args.tty and in_fd is not None and os.isatty(in_fd)) else None
    size = None
    if terminal is not None:  # only a tty pays for the terminal module (termios, signals)
        from bottlenet.control.terminal import terminal_size

        size = terminal_size(terminal)
    if args.tty and size is None:
        size = (24, 80)
    forward = args.interactive or (args.tty and terminal is not None)
    request = ExecRequest(
        args.name,
        tuple(args.argv),
        env=tuple(args.env),
        user=args.user,
        workdir=args.workdir,
        stdin=forward,
        tty=args.tty,
        size=size,
    )
    client = connect()
    try:
        session = client.start_exec(request, timeout=args.timeout)
    except (ControlConnectionError, BottlenetError) as e:
        return report_control_error(e, client.path, err, as_json=getattr(args, "json", False))
    finally:
        client.close()
    raw = terminal if forward else None
    try:
        with session, _terminal_for(session, raw, terminal):
            return session.run(stdin if forward else None, stdout, stderr)
    except ControlConnectionError as e:
        if getattr(args, "json", False):
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
    """Add ``exec`` and ``shell`` to ``bottlenetctl bottle``."""
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
    sp.set_defaults(attached=True)

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
    sp.set_defaults(attached=True, shell_mode=True)

    sp = bottle.add_parser("logs", help="the output of the bottle's workload", parents=[json_flag])
    sp.add_argument("name")
    sp.add_argument("-f", "--follow", action="store_true", help="keep printing new output")
    sp.add_argument("--tail", type=int, default=None, metavar="N", help="last N lines (200)")
    sp.set_defaults(logs=True)


def run_logs(
    connect: Callable[[], BlockingControlClient], args: argparse.Namespace, err: TextIO
) -> int:
    """``bottle logs NAME [--follow] [--tail N]``: the workload's output on stdout."""
    client = connect()
    try:
        return client.logs(
            args.name,
            stdout=sys.stdout.buffer,
            stderr=sys.stderr.buffer,
            tail=args.tail,
            follow=args.follow,
            timeout=args.timeout,
        )
    except (ControlConnectionError, BottlenetError) as e:
        return report_control_error(e, client.path, err, as_json=getattr(args, "json", False))
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


def prepare(args: argparse.Namespace) -> str | None:
    """Fill in ``shell``'s defaults and check the command; a usage error message or None."""
    if getattr(args, "shell_mode", False):
        args.argv = [args.shell_path]
        args.interactive = args.tty = True
        args.env = []
        args.workdir = None
        return None
    if getattr(args, "command_after_dashes", None) is not None:
        args.argv = list(args.argv) + list(args.command_after_dashes)
    if not args.argv:
        return "bottle exec: a command is required (bottle exec NAME -- CMD [ARG]...)"
    return None
