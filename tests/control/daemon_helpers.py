"""Start and stop daemon processes (tests/control/daemon_main.py) for process-level tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from bottlenet.control.blocking import BlockingControlClient

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO}


def start_daemon(state: str, control: str, pass_fd: int | None = None) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "tests.control.daemon_main", state, control]
    if pass_fd is not None:
        argv.append(str(pass_fd))
    return subprocess.Popen(
        argv,
        env=ENV,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        pass_fds=[pass_fd] if pass_fd is not None else [],
    )


def wait_ready(path: str, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(300):
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"daemon exited {proc.returncode}: {out}")
        try:
            with BlockingControlClient(path, timeout=2) as c:
                c.ping()
            return
        except Exception:
            time.sleep(0.05)
    raise AssertionError("daemon never answered")


def stop(proc: subprocess.Popen[bytes]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    return out.decode()
