"""The agent's workload: started detached after the launch gate, its end noticed, its output kept.

bottlenet starts the workload with ``machine exec -d`` (so it survives a daemon restart) inside
a small guest wrapper that sends its output to a log file and, when it ends, writes its exit
code next to it, both in a directory of the agent VM (:func:`guest_dir`). The daemon holds
one attached ``machine exec`` per running workload that waits for that file (a one-second
``sleep`` loop inside the guest, no polling from the host) and prints the code: that is how the
bottle learns the workload ended and with which code. After a daemon restart the waiter is
started again. ``bottle logs`` runs ``tail`` on the log file through the same exec path.

Whose user, whose word the exit code is (security T12). Every command of bottlenet's own
runs as the guest's root (``exec -u 0:0``, ``vmctl.smolvm.GUEST_ROOT``): without ``-u``
smolvm runs a command as the image's ``USER``, which may be a user with no capability at all.
The workload runs as ``agent.user``, else as the image's ``USER`` (read in the guest with
:data:`IMAGE_USER_ARGV`, run without ``-u``), never as root by accident. The prepare step and
the wrapper run as root: the directory is root's (mode 0755), the wrapper is a small
``python3`` parent that starts the workload as its user (``setgid``/``setuid``), copies its
output into the log (bounded: :data:`LOG_CAP`, one rotation), waits for it and writes the exit
file itself. A workload that is not root can neither write that file nor signal or trace its
parent, so its exit code and the moment it ended are not its to forge. What remains the
guest's word: everything, when the workload runs as root (``user = "root"``/``"0"``, or an
image whose ``USER`` is root): root in the guest can write any file and trace any process
there; and in every case the guest kernel and its root (a hostile image) decide what the
waiter prints. Each step runs on bottlenet's guest kit (``bottlenet.kit``: ``workload
prepare|run|wait|logs`` and ``whoami``) where the daemon built one; else on the image's
``/bin/sh`` and ``python3``.

Why not smolvm's own ``machine logs``: it shows the machine's workload (its create command or
image entrypoint), and bottlenet never lets that start the agent (the agent must not run before
the gate); the agent's workload is an exec, whose output smolvm does not keep.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from importlib import resources

from twisted.internet.error import ProcessDone
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from bottlenet.errors import SmolvmFailed
from bottlenet.kit import guest, parent
from bottlenet.kit.program import KitRef
from vmctl.smolvm import GUEST_ROOT, Smolvm


class WorkloadState(enum.StrEnum):
    """Whether a bottle's workload still runs (as the state file and the wire carry it)."""

    RUNNING = "running"
    EXITED = "exited"


#: The log is cut to its last this-many lines by ``bottle logs`` unless asked for more.
DEFAULT_TAIL = 200
MAX_TAIL = 100_000
#: The guest's ``/tmp`` is a RAM tmpfs with no size (smolvm's main container:
#: ``oci.rs`` ``default_mounts``, fidelity.md #7), so the workload's log is bounded: at this
#: size ``log`` becomes ``log.1`` (replacing the older one) and a new ``log`` starts. At most
#: twice this much of the guest's RAM holds the workload's output.
LOG_CAP = parent.CAP

#: A quick guest step of the start (the workload's command check, the image's user).
SETUP_TIMEOUT = 60.0
#: The workload's detached start.
START_TIMEOUT = 60.0

#: Exit codes of the prepare step (:func:`prepare_argv`).
PREPARE_NO_DIR = guest.PREPARE_NO_DIR
PREPARE_NOT_FOUND = guest.PREPARE_NOT_FOUND
PREPARE_NO_PYTHON = 124
#: Run *without* ``-u``: prints ``uid:gid`` of the user smolvm runs a command as by default
#: (the machine's, then the image's ``USER``): the workload's user when the spec names none.
IMAGE_USER_ARGV = ["/bin/sh", "-c", 'echo "$(id -u):$(id -g)"']
#: Where no kit could be built: the image's python3 (as the gate's).
_PY = "py=python3; "
# The root-run prepare step: a fresh root-owned directory the workload's user cannot write
# (not even to replace it: /tmp is sticky), the log, the command, python3.
_PREPARE_ROOT = (
    f'd=$1; rm -rf "$d" && mkdir -m 0755 "$d" && : > "$d/log" || exit {PREPARE_NO_DIR}; '
    f'command -v -- "$2" >/dev/null 2>&1 || exit {PREPARE_NOT_FOUND}; {_PY}'
    f'command -v -- "$py" >/dev/null 2>&1 || exit {PREPARE_NO_PYTHON}'
)
# The root-run parent (``kit/parent.py``): it starts the workload as the user, copies its
# output into the log (rotated at its CAP), waits for it, and writes its code where the user
# cannot (argv: the directory, the user, the workload's argv). Python 3.7+.
_PARENT = resources.files("bottlenet.kit").joinpath("parent.py").read_text()
_WRAPPER_ROOT = f'd=$1; u=$2; shift 2; {_PY}exec "$py" -I -S -c "$0" "$d" "$u" "$@"'
# The directory exists before the waiter starts: if it is gone, no exit code will ever come
# (the guest's /tmp was cleaned), so the waiter ends without one instead of waiting forever.
_WAITER = 'd=$1; while [ ! -e "$d/exit" ]; do [ -d "$d" ] || exit 3; sleep 1; done; cat "$d/exit"'
# The last lines of both files (the rotated one first); following goes by name (-F), so a
# rotation is followed into the new log.
_TAIL = (
    'd=$1; n=$2; shift 2; [ -e "$d/log" ] || { echo "no workload log yet" >&2; exit 1; }; '
    '[ $# -gt 0 ] && exec tail -n "$n" "$@" "$d/log"; '
    '{ cat "$d/log.1" 2>/dev/null; cat "$d/log"; } | tail -n "$n"'
)


def guest_dir(agent_vm: str) -> str:
    """Where, inside the agent VM, the wrapper keeps the log and the exit code."""
    return f"/tmp/.bottlenet-workload-{agent_vm}"


def runs_as_root(user: str | None) -> bool:
    """The workload runs as the guest's root: nothing in the guest is out of its reach."""
    return user is None or user.partition(":")[0] in ("root", "0")


def image_user(stdout: bytes) -> str | None:
    """``uid:gid`` from :data:`IMAGE_USER_ARGV`'s output (None when it is not that)."""
    text = stdout.decode("ascii", "replace").strip()
    uid, sep, gid = text.partition(":")
    if sep and uid.isdigit() and gid.isdigit() and len(text) <= 21:
        return text
    return None


def wrap(
    argv: tuple[str, ...], agent_vm: str, user: str | None = None, kit: KitRef | None = None
) -> list[str]:
    """The detached wrapper, run as the guest's root; the workload runs as ``user`` (None:
    root). ``kit``: the guest kit runs it (else the image's /bin/sh and python3)."""
    who = "0" if user is None else user
    if kit is not None:
        return kit.argv("workload", "run", guest_dir(agent_vm), who, *argv)
    return ["/bin/sh", "-c", _WRAPPER_ROOT, _PARENT, guest_dir(agent_vm), who, *argv]


def prepare_argv(argv: tuple[str, ...], agent_vm: str, kit: KitRef | None = None) -> list[str]:
    """Exit 0 when the workload's directory is ready and its command can be run in the guest
    (:data:`PREPARE_NO_DIR`, :data:`PREPARE_NOT_FOUND`, :data:`PREPARE_NO_PYTHON` otherwise).
    Run as the guest's root."""
    if kit is not None:
        return kit.argv("workload", "prepare", guest_dir(agent_vm), argv[0])
    return ["/bin/sh", "-c", _PREPARE_ROOT, "bottlenet-prepare", guest_dir(agent_vm), argv[0]]


def waiter_argv(agent_vm: str, kit: KitRef | None = None) -> list[str]:
    if kit is not None:
        return kit.argv("workload", "wait", guest_dir(agent_vm))
    return ["/bin/sh", "-c", _WAITER, "bottlenet-wait", guest_dir(agent_vm)]


def logs_argv(agent_vm: str, tail: int, follow: bool, kit: KitRef | None = None) -> list[str]:
    flags = ["-F"] if follow else []
    if kit is not None:
        return kit.argv("workload", "logs", guest_dir(agent_vm), str(tail), *flags)
    return ["/bin/sh", "-c", _TAIL, "bottlenet-logs", guest_dir(agent_vm), str(tail), *flags]


def image_user_argv(kit: KitRef | None = None) -> list[str]:
    """Prints ``uid:gid`` of the user it runs as (run without ``-u``)."""
    return list(IMAGE_USER_ARGV) if kit is None else kit.argv("whoami")


async def start(
    smolvm: Smolvm,
    agent_vm: str,
    argv: tuple[str, ...],
    user: str | None,
    env: tuple[tuple[str, str], ...],
    kit: KitRef | None = None,
) -> None:
    """The workload ``argv``, after the gate (create's step 6d): its user known (``user``,
    else the image's ``USER``), its command checked (as the guest's root), then started
    detached as its user. SmolvmFailed says which of these failed. ``kit``: the guest kit
    runs each step (else the image's /bin/sh and python3)."""
    user = user or await read_image_user(smolvm, agent_vm, env, kit)
    check = await smolvm.exec(
        agent_vm,
        prepare_argv(argv, agent_vm, kit),
        env=dict(env),
        timeout=SETUP_TIMEOUT,
        user=GUEST_ROOT,
    )
    if check.exit_code == PREPARE_NO_PYTHON:
        raise SmolvmFailed(
            f"starting the workload in {agent_vm} failed: its wrapper needs python3 in the "
            f"agent VM (exit {check.exit_code})"
        )
    if check.exit_code == PREPARE_NO_DIR:
        raise SmolvmFailed(
            f"starting the workload in {agent_vm} failed: the guest's root cannot create "
            f"{guest_dir(agent_vm)} in the agent VM (exit {check.exit_code})"
        )
    if check.exit_code != 0:
        raise SmolvmFailed(
            f"starting the workload in {agent_vm} failed: its command is not found"
            f" in the agent VM (exit {check.exit_code})"
        )
    result = await smolvm.exec(
        agent_vm,
        wrap(argv, agent_vm, None if runs_as_root(user) else user, kit),
        env=dict(env),
        detach=True,
        timeout=START_TIMEOUT,
        user=GUEST_ROOT,
    )
    if result.exit_code != 0:
        raise SmolvmFailed(f"starting the workload in {agent_vm} failed (exit {result.exit_code})")


async def read_image_user(
    smolvm: Smolvm, agent_vm: str, env: tuple[tuple[str, str], ...], kit: KitRef | None = None
) -> str:
    """The user smolvm runs a command as without ``-u`` (the image's ``USER``), as
    ``uid:gid``: the workload's user when the spec names none."""
    result = await smolvm.exec(agent_vm, image_user_argv(kit), env=dict(env), timeout=SETUP_TIMEOUT)
    user = image_user(result.stdout) if result.exit_code == 0 else None
    if user is None:
        raise SmolvmFailed(
            f"starting the workload in {agent_vm} failed: the image's user cannot be read "
            f"(`id` as the image's USER: exit {result.exit_code}); set agent.user"
        )
    return user


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
