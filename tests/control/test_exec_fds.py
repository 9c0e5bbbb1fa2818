"""Exec with file descriptors, end to end: the real daemon, ``bottlenetctl`` and the blocking
client on the UNIX socket, the fake smolvm (a TEST DOUBLE: the "guest" command runs on the
host, in a network-less namespace). The daemon hands the command's stdio pipes over
``SCM_RIGHTS``; it still owns the command, its time limit and its exit code.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
from collections.abc import Iterator

import pytest

from bottlenet.control import stream

from .vmdaemon import VMDaemon, read_until_closed, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="exec-netns (unshare) needs root")


@pytest.fixture(scope="module")
def daemon() -> Iterator[VMDaemon]:
    d = VMDaemon().start()
    d.create_vm_bottle("b1")
    try:
        yield d
    finally:
        survivors = d.cleanup()
        assert not survivors


def fd_sessions(d: VMDaemon) -> int:
    return d.log().count("fds=True)")


def test_bottlenetctl_takes_the_pipes_output_and_exit_code(daemon: VMDaemon) -> None:
    """stdout, stderr and the exit code of a command whose pipes bottlenetctl was handed."""
    before = fd_sessions(daemon)
    r = daemon.ctl("bottle", "exec", "b1", "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (r.returncode, r.stdout, r.stderr) == (7, b"out\n", b"err\n")
    assert fd_sessions(daemon) == before + 1
    assert "ended: exit 7" in daemon.log()


def test_session_is_handed_the_pipes(daemon: VMDaemon) -> None:
    """The blocking client's session holds the command's three pipes, and gets the output
    and exit code of a command that ended before the client asked for its pipes."""
    with daemon.client() as c:
        ended = daemon.log().count("ended: exit 0")
        with c.open_exec("b1", ["sh", "-c", "echo hi"]) as session:
            assert session.fds
            wait_for(lambda: daemon.log().count("ended: exit 0") > ended, 30, "the end")
            out = io.BytesIO()
            assert session.run(None, out, None) == 0
            assert out.getvalue() == b"hi\n"
        with c.open_exec("b1", ["true"], fds=False) as session:
            assert not session.fds  # asked for frames: frames
            assert session.run() == 0


def test_stdin_is_streamed_to_its_end(daemon: VMDaemon) -> None:
    """Input bigger than a pipe reaches the command, and its end is an EOF there."""
    payload = os.urandom(300_000).hex().encode()
    before = fd_sessions(daemon)
    r = daemon.ctl("bottle", "exec", "b1", "-i", "--", "sh", "-c", "cat; echo end", input=payload)
    assert r.returncode == 0, r.stderr
    assert r.stdout == payload + b"end\n"
    assert fd_sessions(daemon) == before + 1
    with daemon.client() as c:  # a file without an fd: its bytes, then EOF
        out = io.BytesIO()
        assert c.exec("b1", ["wc", "-c"], stdin=io.BytesIO(b"x" * 70_000), stdout=out) == 0
        assert out.getvalue().strip() == b"70000"


def test_a_client_that_dies_mid_stream_ends_the_command(daemon: VMDaemon) -> None:
    """bottlenetctl killed while the command streams: the daemon ends the command."""
    before = set(daemon.exec_pids())
    p = subprocess.Popen(
        daemon.ctl_argv("bottle", "exec", "b1", "--", "sh", "-c", "echo started; exec sleep 1000"),
        stdout=subprocess.PIPE,
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline() == b"started\n"
        started = wait_for(lambda: set(daemon.exec_pids()) - before, 30, "the guest command")
        p.send_signal(signal.SIGKILL)
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    wait_for(lambda: not (set(daemon.exec_pids()) & started), 30, "the guest command to end")
    wait_for(lambda: "went away; ending the command" in daemon.log(), 30, "the log line")


def test_the_daemon_still_ends_a_command_past_its_time_limit(daemon: VMDaemon) -> None:
    """time_limit: the daemon ends an fd session's command (exit 124) and says so. The
    shortest limit (1 s) is waited out, and nothing here races it: the command never ends
    by itself. That its output before the end is the client's, the daemon framing none of it,
    is checked without waiting a limit out: tests/control/test_exec_fds_limit.py."""
    before = fd_sessions(daemon)
    with daemon.client() as c:
        code = c.exec("b1", ["sh", "-c", "exec sleep 1000"], stdout=io.BytesIO(), time_limit=1)
    assert code == 124
    assert fd_sessions(daemon) == before + 1
    assert "timeout; ending the command" in daemon.log()


def test_fd_session_frames_are_checked(daemon: VMDaemon) -> None:
    """A client that sends stdin frames on an fd session loses it; the command ends."""
    before = set(daemon.exec_pids())
    with daemon.client() as c:
        session = c.open_exec("b1", ["sleep", "1000"], stdin=True)
        assert session.fds
        session.sock.sendall(stream.encode(stream.STDIN, b"x"))
        read_until_closed(session.sock)  # the daemon closes the connection
        session.close()
    wait_for(lambda: "unexpected frame kind 1" in daemon.log(), 30, "the warning")
    wait_for(lambda: not (set(daemon.exec_pids()) - before), 30, "the command to end")
