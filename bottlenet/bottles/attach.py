"""Commands a launcher runs in a bottle's agent VM (``machine exec -i [-t]``), attached.

This room knows smolvm; the control plane (which never drives smolvm) hands in a
``ProcessProtocol`` and gets the child's transport back. The request is validated here with
the same rules as the bottle spec (env entries, absolute paths), before smolvm runs.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from typing import Any

from attrs import frozen
from twisted.internet.interfaces import IProcessProtocol, IProcessTransport

from bottlenet.bottles import workload
from bottlenet.bottles.model import Bottle
from bottlenet.bottles.spec import MAX_ENV, MAX_STRING, check_env_entries
from bottlenet.bottles.vmerrors import map_vmctl
from bottlenet.errors import InvalidArgument, SmolvmUnavailable, safe_repr
from bottlenet.kit.program import kit_session
from vmctl.errors import VmctlError
from vmctl.smolvm import GUEST_ROOT, set_pty_size
from vmctl.spec import check_user

MAX_ARGV = 4096
MAX_ARGV_BYTES = 256 * 1024


@frozen
class ExecRequest:
    """A validated exec: the command, its extra env, user, workdir and terminal."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    user: str | None = None
    workdir: str | None = None
    stdin: bool = False
    tty: bool = False
    size: tuple[int, int] | None = None


def _check_encodes(value: str, where: str) -> None:
    """A lone surrogate cannot become an argv word: refused here, not INTERNAL at spawn."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"{where}: must be valid Unicode (no lone surrogates)") from None


def _check_workdir(workdir: str) -> None:
    """An absolute path that says what it is: no ``..`` segment, no ``:``, no control or
    format character (C0, DEL, C1, bidi overrides, zero-width), nothing unencodable."""
    if (
        not isinstance(workdir, str)
        or not workdir.startswith("/")
        or len(workdir) > MAX_STRING
        or ":" in workdir
        or any(unicodedata.category(c) in ("Cc", "Cf", "Cs") for c in workdir)
    ):
        raise InvalidArgument(
            "workdir: must be an absolute path without ':', control or format characters"
        )
    if ".." in workdir.split("/"):
        raise InvalidArgument("workdir: must not contain a '..' segment")


def parse_exec_request(
    argv: Sequence[str],
    *,
    env: Sequence[str] = (),
    user: str | None = None,
    workdir: str | None = None,
    stdin: bool = False,
    tty: bool = False,
    rows: int | None = None,
    cols: int | None = None,
) -> ExecRequest:
    """Every argument checked; INVALID_ARGUMENT names the argument, never echoes it raw."""
    words = tuple(argv)
    if not words:
        raise InvalidArgument("argv: a command is required")
    if len(words) > MAX_ARGV or sum(len(w.encode("utf-8", "surrogatepass")) for w in words) > (
        MAX_ARGV_BYTES
    ):
        raise InvalidArgument("argv: too long")
    for i, w in enumerate(words):
        if not isinstance(w, str) or "\0" in w:
            raise InvalidArgument(f"argv[{i}]: must be a string without NUL")
        _check_encodes(w, f"argv[{i}]")
    if not words[0]:
        raise InvalidArgument("argv[0]: must not be empty")
    entries = tuple(env)
    if len(entries) > MAX_ENV:
        raise InvalidArgument(f"env: at most {MAX_ENV} entries")
    for i, e in enumerate(entries):
        if not isinstance(e, str) or len(e) > MAX_STRING:
            raise InvalidArgument(f"env[{i}]: must be a string of at most {MAX_STRING} characters")
        _check_encodes(e, f"env[{i}]")
    check_env_entries(entries, "env")
    if user is not None:
        try:
            check_user(user)
        except VmctlError:
            raise InvalidArgument(f"user {safe_repr(user)}: use a user name or uid[:gid]") from None
    if workdir is not None:
        _check_workdir(workdir)
    size = None
    if rows is not None or cols is not None:
        if rows is None or cols is None or not (0 <= rows <= 0xFFFF and 0 <= cols <= 0xFFFF):
            raise InvalidArgument("rows and cols: both, each 0-65535")
        size = (rows, cols)
    pairs = tuple((k, v) for k, _, v in (e.partition("=") for e in entries))
    return ExecRequest(words, pairs, user, workdir, stdin, tty, size)


def logs_request(bottle: Bottle, tail: int, follow: bool) -> ExecRequest:
    """The command that shows the workload's log (INVALID_ARGUMENT: the bottle runs none)."""
    vm = bottle.require_vms()
    if vm.workload is None:
        raise InvalidArgument(f"bottle {bottle.name} runs no workload (its spec names none)")
    return ExecRequest(
        tuple(workload.logs_argv(vm.agent_vm, tail, follow, vm.kit)), user=GUEST_ROOT
    )


async def spawn_exec(
    host: Any,
    bottle: Bottle,
    request: ExecRequest,
    protocol: IProcessProtocol,
    *,
    stdio: tuple[int, int, int] | None = None,
) -> IProcessTransport:
    """Start ``machine exec`` in the bottle's agent VM with ``protocol`` attached to its stdio.

    ``host`` is the VMHost (its ``smolvm``); vmctl errors become the control plane's.
    The bottle's guest kit, when its VMs have one, wraps the command (it ends with its
    session) instead of the image's python3.
    """
    if host is None:
        raise SmolvmUnavailable("this daemon runs without smolvm: VM bottles are unavailable")
    env = dict(request.env)
    if bottle.home != bottle.name:  # taken from a warm pool: its VM was made for its home
        env.setdefault("BOTTLENET_BOTTLE", bottle.name)
    try:
        transport: IProcessTransport = await host.smolvm.spawn_exec(
            bottle.require_vms().agent_vm,
            list(request.argv),
            protocol,
            env=env,
            workdir=request.workdir,
            user=request.user,
            tty=request.tty,
            size=request.size,
            stdio=stdio,
            session=kit_session(bottle.require_vms().kit),
        )
    except VmctlError as e:
        raise map_vmctl(e, bottle.name) from None
    return transport


def resize(transport: IProcessTransport, rows: int, cols: int) -> None:
    """Resize an exec's terminal (a no-op for an exec without one, or one that ended)."""
    fd = getattr(transport, "fd", None)
    if not isinstance(fd, int) or fd < 0:
        return
    try:
        set_pty_size(fd, rows, cols)
    except OSError:
        pass
