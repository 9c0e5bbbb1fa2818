"""Security-2 T11: the terminal is restored on every catchable signal that ends the CLI.

A real child process holds a real pty in raw mode (``raw_terminal``) and gets the signal;
the pty's line discipline is read afterwards. The child sets each signal to its default
first, so the result does not depend on the dispositions the test runner inherited.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import termios

import pytest

CHILD = (
    "import os, signal, sys, time\n"
    "from bottlenet.control.terminal import raw_terminal\n"
    "signal.signal(int(sys.argv[1]), signal.SIG_DFL)\n"
    "with raw_terminal(0):\n"
    "    os.write(1, b'raw')\n"
    "    time.sleep(60)\n"
)

SIGNALS = ["SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGPIPE", "SIGXCPU", "SIGTERM", "SIGHUP"]


@pytest.mark.parametrize("name", SIGNALS)
def test_terminal_restored_on_fatal_signal(name: str) -> None:
    """T11: QUIT, USR1, USR2, ALRM (and PIPE at its default) used to leave the tty raw."""
    signum = getattr(signal, name)
    master, slave = os.openpty()
    ready_r, ready_w = os.pipe()
    try:
        cooked = termios.tcgetattr(slave)
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(int(signum))],
            stdin=slave,
            stdout=ready_w,
            start_new_session=True,
        )
        os.close(ready_w)
        ready_w = -1
        try:
            assert select.select([ready_r], [], [], 60)[0], "the child never went raw"
            assert os.read(ready_r, 3) == b"raw"
            assert not termios.tcgetattr(slave)[3] & termios.ICANON  # raw now
            child.send_signal(signum)
            assert child.wait(60) == 128 + signum  # an orderly exit, not death by signal
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert termios.tcgetattr(slave) == cooked
    finally:
        for fd in (master, slave, ready_r, ready_w):
            if fd >= 0:
                os.close(fd)
