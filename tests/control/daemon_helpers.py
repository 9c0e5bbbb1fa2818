"""Start and stop the real daemon (``python -m twisted bottlenet``) for process-level tests.

The daemon is exactly what a person or a unit file runs: twist, the plugin, the tap's
service tree with its own control socket (``--control``). For socket activation the
listening socket is put on fd 3 and ``LISTEN_PID``/``LISTEN_FDS``/``LISTEN_FDNAMES`` are set
by a tiny wrapper that then ``exec``s the daemon, so ``LISTEN_PID`` is the daemon's own pid,
as systemd would have it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from bottlenet.control.blocking import BlockingControlClient
from tests.netguard import GATE_STAND_INS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO}
# This interpreter's directory first: the fake smolvm (``#!/usr/bin/env python3``) and the
# probe then start this Python, not a version manager's shim script (pyenv's cost ~150 ms a
# call, several times what the fake itself costs).
ENV["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), ENV.get("PATH", os.defpath)])
ENV.pop("XDG_RUNTIME_DIR", None)  # every test names its control socket explicitly
for _name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "NOTIFY_SOCKET"):
    ENV.pop(_name, None)

# Moves fd argv[1] to 3, sets the systemd variables for this very process, then execs argv[2:].
_SYSTEMD_WRAPPER = (
    "import os, sys\n"
    "fd = int(sys.argv[1])\n"
    "if fd != 3:\n"
    "    os.dup2(fd, 3)\n"
    "    os.close(fd)\n"
    "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1', LISTEN_FDNAMES='control')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def daemon_argv(
    state: str, control: str, *extra: str, log_format: str = "text", log_level: str | None = None
) -> list[str]:
    """``python -m twisted [--log-level=L] bottlenet --log-format=F --state-dir S --control C``
    (plus the gate's stand-ins for its outside address and DNS name)."""
    argv = [sys.executable, "-m", "twisted"]
    if log_level is not None:
        argv.append(f"--log-level={log_level}")
    argv += ["bottlenet", f"--log-format={log_format}", "--state-dir", state]
    return [*argv, "--control", control, *GATE_STAND_INS, *extra]


def start_daemon(
    state: str,
    control: str,
    pass_fd: int | None = None,
    *,
    extra: Sequence[str] = (),
    log_format: str = "text",
    log_level: str | None = None,
    stderr_to_stdout: bool = True,
) -> subprocess.Popen[bytes]:
    """The real daemon; with ``pass_fd`` it adopts that listening socket as systemd's."""
    argv = daemon_argv(state, control, *extra, log_format=log_format, log_level=log_level)
    if pass_fd is not None:
        argv = [sys.executable, "-c", _SYSTEMD_WRAPPER, str(pass_fd), *argv]
    return subprocess.Popen(
        argv,
        env=ENV,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if stderr_to_stdout else subprocess.PIPE,
        pass_fds=[pass_fd] if pass_fd is not None else [],
    )


def wait_ready(path: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"daemon exited {proc.returncode}: {out}")
        try:
            with BlockingControlClient(path, timeout=2) as c:
                c.ping()
            return
        except Exception:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("daemon never answered")


#: twist re-raises the SIGTERM that stopped it (so systemd counts a clean stop): -15.
CLEAN_EXIT = (0, -signal.SIGTERM)


def stop(proc: subprocess.Popen[bytes]) -> str:
    """SIGTERM, wait, and return everything the daemon wrote (stdout, and stderr if merged)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return (out + (err or b"")).decode(errors="replace")
