"""The agent's workload: started detached after the launch gate, its end noticed, its output kept.

bottlenet starts the workload with ``machine exec -d`` (so it survives a daemon restart) inside
a small guest shell wrapper that sends its output to a log file and, when it ends, writes its
exit code next to it, both in a directory of the agent VM (:func:`guest_dir`). The daemon holds
one attached ``machine exec`` per running workload that waits for that file (a one-second
``sleep`` loop inside the guest, no polling from the host) and prints the code: that is how the
bottle learns the workload ended and with which code. After a daemon restart the waiter is
started again. ``bottle logs`` runs ``tail`` on the log file through the same exec path.

Whose word the exit code is (security T12). When the spec names a ``user`` other than root,
the prepare step and the wrapper run as the guest's root, not as that user: the directory is
root's (mode 0755), the wrapper is a small ``python3`` parent that starts the workload as the
user (``setgid``/``setuid``), waits for it and writes the exit file itself. The workload's user
can neither write that file nor signal or trace its parent, so its exit code and the moment it
ended are not the workload's to forge. What remains the guest's word: everything, when the
workload runs as root (no ``user``, or ``user = "root"``/``"0"``): root in the guest can write
any file and trace any process there; and in every case the guest kernel and its root (a
hostile image) decide what the waiter prints. This path needs ``python3`` in the image (the
launch gate needs it too) or the probe kit's.

Why not smolvm's own ``machine logs``: it shows the machine's workload (its create command or
image entrypoint), and bottlenet never lets that start the agent (the agent must not run before
the gate); the agent's workload is an exec, whose output smolvm does not keep.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from twisted.internet.error import ProcessDone
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure


class WorkloadState(enum.StrEnum):
    """Whether a bottle's workload still runs (as the state file and the wire carry it)."""

    RUNNING = "running"
    EXITED = "exited"


#: The log is cut to its last this-many lines by ``bottle logs`` unless asked for more.
DEFAULT_TAIL = 200
MAX_TAIL = 100_000

#: Exit codes of the prepare step (:func:`prepare_argv`).
PREPARE_NO_DIR = 125
PREPARE_NOT_FOUND = 127
PREPARE_NO_PYTHON = 124
#: The guest's python3: the probe kit's when it is mounted, else the image's (as the gate).
_PY = 'py=/run/bottlenet-probe/bin/python3; [ -x "$py" ] || py=python3; '
# The root-run prepare step for a workload with a user: a fresh root-owned directory the
# user cannot write (not even to replace it: /tmp is sticky), the log, the command, python3.
_PREPARE_ROOT = (
    f'd=$1; rm -rf "$d" && mkdir -m 0755 "$d" && : > "$d/log" || exit {PREPARE_NO_DIR}; '
    f'command -v -- "$2" >/dev/null 2>&1 || exit {PREPARE_NOT_FOUND}; {_PY}'
    f'command -v -- "$py" >/dev/null 2>&1 || exit {PREPARE_NO_PYTHON}'
)
# The root-run parent: it starts the workload as the user, waits for it, and writes its code
# where the user cannot (argv: the directory, the user, the workload's argv). Python 3.7+.
_PARENT = """\
import os, pwd, sys
d, user, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
name, _, group = user.partition(":")
try:
    pw = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    uid, gid = pw.pw_uid, pw.pw_gid
except KeyError:
    if not name.isdigit():
        sys.exit(126)
    uid = gid = int(name)
if group:
    gid = int(group)
log = os.open(d + "/log", os.O_WRONLY | os.O_APPEND)
null = os.open(os.devnull, os.O_RDONLY)
pid = os.fork()
if pid == 0:
    try:
        os.dup2(null, 0); os.dup2(log, 1); os.dup2(log, 2)
        os.setgroups([gid]); os.setgid(gid); os.setuid(uid)
        os.execvp(argv[0], argv)
    finally:
        os._exit(127)
while True:
    try:
        _, status = os.waitpid(pid, 0)
        break
    except InterruptedError:
        pass
code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
with open(d + "/exit.tmp", "w") as f:
    f.write("%d\\n" % code)
os.rename(d + "/exit.tmp", d + "/exit")
"""
_WRAPPER_ROOT = f'd=$1; u=$2; shift 2; {_PY}exec "$py" -I -S -c "$0" "$d" "$u" "$@"'
# Run synchronously before the detached start, as the workload's user: the directory and an
# empty log exist (and no old exit code) before the waiter starts, and the command exists. A
# detached start cannot report either (its wrapper always starts), and a wrapper that could
# not make its directory would leave the waiter waiting for an exit file forever.
_PREPARE = (
    f'd=$1; mkdir -p "$d" && rm -f "$d/exit" && : > "$d/log" || exit {PREPARE_NO_DIR}; '
    f'command -v -- "$2" >/dev/null 2>&1 || exit {PREPARE_NOT_FOUND}'
)
# $1: the directory (made by the prepare step); the rest: the workload's argv.
_WRAPPER = (
    'd=$1; shift; "$@" >>"$d/log" 2>&1; code=$?; '
    'echo "$code" > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"'
)
# The directory exists before the waiter starts: if it is gone, no exit code will ever come
# (the guest's /tmp was cleaned), so the waiter ends without one instead of waiting forever.
_WAITER = 'd=$1; while [ ! -e "$d/exit" ]; do [ -d "$d" ] || exit 3; sleep 1; done; cat "$d/exit"'
_TAIL = (
    'd=$1; n=$2; shift 2; [ -e "$d/log" ] || { echo "no workload log yet" >&2; exit 1; }; '
    'exec tail -n "$n" "$@" "$d/log"'
)


def guest_dir(agent_vm: str) -> str:
    """Where, inside the agent VM, the wrapper keeps the log and the exit code."""
    return f"/tmp/.bottlenet-workload-{agent_vm}"


def runs_as_root(user: str | None) -> bool:
    """The workload runs as the guest's root: nothing in the guest is out of its reach."""
    return user is None or user.partition(":")[0] in ("root", "0")


def exec_user(user: str | None) -> str | None:
    """Who runs the prepare step and the wrapper (``exec -u``): the workload's user when it
    is root anyway, else the guest's root (the wrapper drops to ``user`` for the workload)."""
    return user if runs_as_root(user) else None


def wrap(argv: tuple[str, ...], agent_vm: str, user: str | None = None) -> list[str]:
    d = guest_dir(agent_vm)
    if runs_as_root(user):
        return ["/bin/sh", "-c", _WRAPPER, "bottlenet-workload", d, *argv]
    assert user is not None
    return ["/bin/sh", "-c", _WRAPPER_ROOT, _PARENT, d, user, *argv]


def prepare_argv(argv: tuple[str, ...], agent_vm: str, user: str | None = None) -> list[str]:
    """Exit 0 when the workload's directory is ready and its command can be run in the guest
    (:data:`PREPARE_NO_DIR`, :data:`PREPARE_NOT_FOUND`, :data:`PREPARE_NO_PYTHON` otherwise)."""
    script = _PREPARE if runs_as_root(user) else _PREPARE_ROOT
    return ["/bin/sh", "-c", script, "bottlenet-prepare", guest_dir(agent_vm), argv[0]]


def waiter_argv(agent_vm: str) -> list[str]:
    return ["/bin/sh", "-c", _WAITER, "bottlenet-wait", guest_dir(agent_vm)]


def logs_argv(agent_vm: str, tail: int, follow: bool) -> list[str]:
    flags = ["-f"] if follow else []
    return ["/bin/sh", "-c", _TAIL, "bottlenet-logs", guest_dir(agent_vm), str(tail), *flags]


class WorkloadWaiter(ProcessProtocol):
    """The attached waiter: ``on_exit(code)`` when the workload ended, ``on_lost()`` when the
    waiter ended without a code (the VM went away, the daemon stops, :meth:`cancel`)."""

    MAX_OUTPUT = 64

    def __init__(self, on_exit: Callable[[int], None], on_lost: Callable[[], None]) -> None:
        self._on_exit = on_exit
        self._on_lost = on_lost
        self._out = bytearray()
        self.cancelled = False

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD == 1 and len(self._out) < self.MAX_OUTPUT:
            self._out += data[: self.MAX_OUTPUT - len(self._out)]

    def processEnded(self, reason: Failure) -> None:
        text = self._out.decode("ascii", "replace").strip()
        if not self.cancelled and isinstance(reason.value, ProcessDone) and text.isdigit():
            if len(text) <= 3:
                self._on_exit(int(text))
                return
        self._on_lost()

    def cancel(self) -> None:
        self.cancelled = True
        transport = self.transport
        if transport is not None:
            try:
                transport.signalProcess("TERM")
            except Exception:
                pass
