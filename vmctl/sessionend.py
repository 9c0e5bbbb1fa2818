"""An attached guest command ends with its session: the guest-side wrapper.

smolvm ends an attached (``exec -i [-t]``) session -- its CLI killed, its client gone, its
``--timeout`` -- by killing only the ``crun exec`` process in the guest and dropping the pipes
(1.9.3 agent ``run_interactive_loop`` -> ``kill_child_on_disconnect``, and the interactive
timeout's ``child.kill()``; the 1.32.2 agent keeps both messages). The command itself is
re-parented to the container's PID 1 and lives on, seeing only EOF on stdin and EPIPE on its
next write: a command that ignores stdin and stays quiet (the workload waiter's ``sleep``
loop, ``logs -f`` on an idle log, a user's ``sleep 300``, a timed-out gate) never ends.

So every attached command vmctl starts runs under :data:`WRAPPER`: it makes itself the
leader of a process group, starts the command in that group, and waits. Its stdout and
stderr are the session's pipes; when the agent drops them, ``poll`` reports ``POLLERR`` (a
pipe whose reader is gone) or ``POLLHUP`` (a terminal hung up, or ``SIGHUP``), and the
wrapper ends the whole group: SIGTERM, then SIGKILL after :data:`GRACE` seconds. Otherwise it
exits with the command's status (its code, or 128 + the signal, as smolvm reports it). It
ignores SIGINT and SIGQUIT (a terminal's Ctrl-C and Ctrl-\\ are the command's to handle: a
REPL that catches Ctrl-C must not lose its session), which its command gets back as defaults.

Why a wrapper and not smolvm's pid-file kill: smolvm kills by pid file only on the plain
(non-``-i``) path (``run_in_keepalive_container`` -> ``ExecPidFile::kill_workload``); ``-i``
has none, does not print the guest pid, and a second exec to kill it would need a free
agent connection exactly when a session is being torn down (the agent serves 8 at once). A
wrapper needs nothing from the host: the session's end is the signal. It needs a
``python3`` in the guest (the launch gate and the bridge need one too); without one the
command runs unwrapped, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Seconds between the wrapper's SIGTERM to the command's group and its SIGKILL.
GRACE = 2
#: argv[0] of the wrapper's shell (what ``ps`` in the guest shows).
NAME = "bottlenet-session"

# Python 3.7+ (the image's). argv: the command. Signals are set before the fork, so an
# early end of the session or of the command is never missed.
WRAPPER = f"""\
import os, select, signal, sys, time
argv = sys.argv[1:]
try:
    os.setpgid(0, 0)
except OSError:
    pass
r, w = os.pipe()
os.set_blocking(w, False)
signal.set_wakeup_fd(w)
signal.signal(signal.SIGCHLD, lambda *a: None)
hup = []
signal.signal(signal.SIGHUP, lambda *a: hup.append(1))
for s in (signal.SIGINT, signal.SIGQUIT):
    signal.signal(s, signal.SIG_IGN)
pid = os.fork()
if pid == 0:
    signal.set_wakeup_fd(-1)
    for s in (signal.SIGCHLD, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT):
        signal.signal(s, signal.SIG_DFL)
    os.close(r)
    os.close(w)
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        sys.stderr.write("%s: %s\\n" % (argv[0], e.strerror))
    os._exit(127)
os.close(0)
p = select.poll()
p.register(r, select.POLLIN)
for fd in (1, 2):
    try:
        os.fstat(fd)
        p.register(fd, 0)
    except OSError:
        pass
def end():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    t = time.monotonic() + {GRACE}
    while time.monotonic() < t and os.waitpid(pid, os.WNOHANG)[0] == 0:
        time.sleep(0.05)
    os.killpg(0, signal.SIGKILL)
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    if hup:
        end()
    try:
        events = p.poll()
    except InterruptedError:
        continue
    for fd, ev in events:
        if fd == r:
            os.read(r, 512)
        elif ev & (select.POLLERR | select.POLLHUP):
            end()
        elif ev & select.POLLNVAL:
            p.unregister(fd)
if os.WIFSIGNALED(status):
    os._exit(128 + os.WTERMSIG(status))
os._exit(os.WEXITSTATUS(status))
"""

#: The shell step: the guest's python3 runs :data:`WRAPPER`, else the command runs as is.
_LAUNCH = (
    'for py in {pythons}; do command -v "$py" >/dev/null 2>&1 && '
    'exec "$py" -I -S -c "$0" "$@"; done; exec "$@"'
)


def wrap(
    argv: Sequence[str], pythons: Sequence[str] = ("python3",), kit: Sequence[str] = ()
) -> list[str]:
    """``argv`` under the session wrapper: run by ``kit`` (the argv of bottlenet's guest kit,
    up to its ``session`` word) when the guest has it mounted, else by the first of
    ``pythons`` the guest has (through its ``/bin/sh``)."""
    if kit:
        return [*kit, *argv]
    launch = _LAUNCH.format(pythons=" ".join(pythons))
    return ["/bin/sh", "-c", launch, WRAPPER, *argv]
