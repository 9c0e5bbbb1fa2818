"""The agent's workload: started detached after the launch gate, its end noticed, its output kept.

bottlenet starts the workload with ``machine exec -d`` (so it survives a daemon restart) inside
a small guest shell wrapper that sends its output to a log file and, when it ends, writes its
exit code next to it, both in a directory of the agent VM (:func:`guest_dir`). The daemon holds
one attached ``machine exec`` per running workload that waits for that file (a one-second
``sleep`` loop inside the guest, no polling from the host) and prints the code: that is how the
bottle learns the workload ended and with which code. After a daemon restart the waiter is
started again. ``bottle logs`` runs ``tail`` on the log file through the same exec path.

Why not smolvm's own ``machine logs``: it shows the machine's workload (its create command or
image entrypoint), and bottlenet never lets that start the agent (the agent must not run before
the gate); the agent's workload is an exec, whose output smolvm does not keep.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.error import ProcessDone
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

STATE_RUNNING = "running"
STATE_EXITED = "exited"
#: The log is cut to its last this-many lines by ``bottle logs`` unless asked for more.
DEFAULT_TAIL = 200
MAX_TAIL = 100_000

#: Exit codes of the prepare step (:func:`prepare_argv`).
PREPARE_NO_DIR = 125
PREPARE_NOT_FOUND = 127
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


def wrap(argv: tuple[str, ...], agent_vm: str) -> list[str]:
    return ["/bin/sh", "-c", _WRAPPER, "bottlenet-workload", guest_dir(agent_vm), *argv]


def prepare_argv(argv: tuple[str, ...], agent_vm: str) -> list[str]:
    """Exit 0 when the workload's directory is ready and its command can be run in the guest
    (:data:`PREPARE_NO_DIR`, :data:`PREPARE_NOT_FOUND` otherwise)."""
    return ["/bin/sh", "-c", _PREPARE, "bottlenet-prepare", guest_dir(agent_vm), argv[0]]


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
