"""Exec and attach in the agent VM, end to end: the real daemon, ``bottlenetctl``, the fake
smolvm (a TEST DOUBLE: the "guest" command runs on the host, in a network-less namespace).

What cannot run here: a booted smolvm VM. The daemon's smolvm side (``machine exec -i [-t]
[-u]``, a pty sized and resized for ``-t``) is what real smolvm 1.32.2 documents in its
``--help``; the fake implements the same flags and behaviour (stdin streamed, the CLI's
terminal size copied at start and on SIGWINCH, the command killed with the CLI).
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import socket
import struct
import sys
import termios
import time
from collections.abc import Iterator

import pytest

from bottlenet.control import commands as C
from bottlenet.control import stream
from bottlenet.control.blocking import BlockingControlClient, ControlConnectionError
from bottlenet.errors import InvalidArgument, NotFound

from .vmdaemon import VMDaemon, read_until_closed, run_in_pty, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="exec-netns (unshare) needs root")

# Runs bottlenetctl on the pty and reports whether the terminal came back as it was.
WRAPPER = (
    "import subprocess, sys, termios\n"
    "before = termios.tcgetattr(0)\n"
    "rc = subprocess.call(sys.argv[1:])\n"
    "after = termios.tcgetattr(0)\n"
    "sys.stdout.write('\\r\\nWRAPPER rc=%d restored=%s\\r\\n' % (rc, before == after))\n"
    "sys.stdout.flush()\n"
)


@pytest.fixture(scope="module")
def daemon() -> Iterator[VMDaemon]:
    d = VMDaemon().start()
    d.create_vm_bottle("b1")
    try:
        yield d
    finally:
        survivors = d.cleanup()
        assert not survivors


def read_until(fd: int, token: bytes, timeout: float = 30.0) -> bytes:
    buf = b""
    deadline = time.monotonic() + timeout
    while token not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {token!r} in {buf[-400:]!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                raise AssertionError(f"EOF before {token!r} in {buf[-400:]!r}")
            buf += chunk
    return buf


def read_to_eof(fd: int, timeout: float = 30.0) -> bytes:
    buf = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], deadline - time.monotonic())
        if not ready:
            break
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the other side of the pty is closed
            break
        if not chunk:
            break
        buf += chunk
    return buf


def set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def test_exec_streams_stdout_stderr_and_exit_code(daemon: VMDaemon) -> None:
    r = daemon.ctl("bottle", "exec", "b1", "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (r.returncode, r.stdout, r.stderr) == (7, b"out\n", b"err\n")
    log = daemon.log()
    assert "echo out" not in log and "echo err" not in log  # no command line in the log
    assert "ended: exit 7" in log


def test_exec_forwards_stdin_env_user_and_workdir(daemon: VMDaemon) -> None:
    payload = os.urandom(200_000).hex().encode()  # more than one frame and one pipe buffer
    r = daemon.ctl("bottle", "exec", "b1", "-i", "--", "sh", "-c", "cat; echo", input=payload)
    assert r.returncode == 0, r.stderr
    assert r.stdout == payload + b"\n"
    assert payload[:64].decode() not in daemon.log()
    r = daemon.ctl(
        "bottle",
        "exec",
        "b1",
        "-e",
        "GREETING=hi there",
        "-u",
        "65534",
        "-w",
        "/tmp",
        "--",
        "sh",
        "-c",
        'echo "$GREETING" $(id -u) "$PWD"',
    )
    assert (r.returncode, r.stdout) == (0, b"hi there 65534 /tmp\n"), r.stderr
    argv = [a for a in daemon.fake.argvs() if a[:2] == ["machine", "exec"] and "--user" in a][-1]
    assert argv[argv.index("--user") + 1] == "65534" and "-i" in argv and "-t" not in argv


def test_exec_usage_and_typed_errors(daemon: VMDaemon) -> None:
    assert daemon.ctl("bottle", "exec", "b1").returncode == 2  # no command
    r = daemon.ctl("bottle", "exec", "nope", "--", "true")
    assert r.returncode == 1 and b"NOT_FOUND" in r.stderr
    r = daemon.ctl("bottle", "exec", "b1", "-e", "1BAD=x", "--", "true")
    assert r.returncode == 1 and b"INVALID_ARGUMENT" in r.stderr
    r = daemon.ctl("bottle", "exec", "b1", "--user=-rf", "--", "true")
    assert r.returncode == 1 and b"INVALID_ARGUMENT" in r.stderr
    with daemon.client() as c:
        c.create_bottle("fwd")
        try:
            with pytest.raises(InvalidArgument, match="forward-only"):
                c.exec("fwd", ["true"])
            with pytest.raises(NotFound):
                c.exec("ghost", ["true"])
        finally:
            c.destroy_bottle("fwd")
        # Exec must have its connection to itself (the blocking client opens its own).
        c.ping()


def test_client_that_disappears_ends_the_command(daemon: VMDaemon) -> None:
    before = set(daemon.exec_pids())
    with daemon.client() as c:
        session = c.open_exec("b1", ["sh", "-c", "echo started; exec sleep 1000"], fds=False)
        # the guest command runs ...
        frame = b""
        while b"started" not in frame:
            frame += session.sock.recv(4096)
        started = wait_for(lambda: set(daemon.exec_pids()) - before, 30, "the guest command")
        session.close()  # ... and the client vanishes without a word
    wait_for(lambda: not (set(daemon.exec_pids()) & started), 30, "the guest command to end")
    wait_for(lambda: "went away; ending the command" in daemon.log(), 30, "the log line")


def test_blocking_client_exec_streams_to_files(daemon: VMDaemon, tmp_path: object) -> None:
    import io

    out, err = io.BytesIO(), io.BytesIO()
    with daemon.client() as c:
        code = c.exec(
            "b1",
            ["sh", "-c", "cat; echo e >&2; exit 3"],
            stdin=io.BytesIO(b"in\n"),
            stdout=out,
            stderr=err,
        )
    assert (code, out.getvalue(), err.getvalue()) == (3, b"in\n", b"e\n")


def test_exec_frames_are_checked(daemon: VMDaemon) -> None:
    """A client that sends a frame of a kind it may not send loses its session."""
    before = set(daemon.exec_pids())
    with daemon.client() as c:
        session = c.open_exec("b1", ["sleep", "1000"], stdin=True, fds=False)
        session.sock.sendall(stream.encode(stream.EXIT, b"\0\0\0\0"))
        read_until_closed(session.sock)  # the daemon closes the connection
        session.close()
    wait_for(lambda: "unexpected frame kind" in daemon.log(), 30, "the warning")
    wait_for(lambda: not (set(daemon.exec_pids()) - before), 30, "the command to end")


def _shell_on_pty(daemon: VMDaemon) -> tuple[int, int]:
    argv = [sys.executable, "-c", WRAPPER, *daemon.ctl_argv("bottle", "shell", "b1")]
    pid, fd = run_in_pty(argv)
    set_size(fd, 30, 100)
    return pid, fd


def test_tty_shell_resize_and_ctrl_d_restores_the_terminal(daemon: VMDaemon) -> None:
    pid, fd = _shell_on_pty(daemon)
    try:
        read_until(fd, b"# ")  # the guest shell's prompt: bottlenetctl's terminal is raw now
        os.write(fd, b"stty size; echo M$((0+1))\n")  # the typed line echoes "M$((0+1))"
        assert b"30 100" in read_until(fd, b"M1\r\n")
        set_size(fd, 41, 123)  # the kernel sends SIGWINCH to bottlenetctl
        wait_for(lambda: _size_is(fd, b"41 123"), 30, "the resize to reach the guest")
        os.write(fd, b"\x04")  # Ctrl-D at an empty prompt ends the shell
        tail = read_until(fd, b"restored=")
        tail += read_to_eof(fd)
        assert b"WRAPPER rc=0 restored=True" in tail, tail
    finally:
        os.close(fd)
        os.waitpid(pid, 0)


def _size_is(fd: int, want: bytes) -> bool:
    os.write(fd, b"stty size; echo M$((1+1))\n")
    return want in read_until(fd, b"M2\r\n")


def test_tty_terminal_restored_when_the_daemon_dies_mid_session() -> None:
    d = VMDaemon().start()
    try:
        d.create_vm_bottle("b1")
        pid, fd = _shell_on_pty(d)
        try:
            read_until(fd, b"# ")
            os.write(fd, b"echo AL''IVE\n")
            read_until(fd, b"ALIVE\r\n")
            guests = wait_for(d.exec_pids, 30, "the guest shell")
            d.kill(signal.SIGKILL)
            tail = read_until(fd, b"restored=")
            tail += read_to_eof(fd)
            assert b"WRAPPER rc=255 restored=True" in tail, tail
        finally:
            os.close(fd)
            os.waitpid(pid, 0)
        # the guest shell did not outlive its session (no orphan)
        wait_for(lambda: not (set(d.exec_pids()) & set(guests)), 30, "the guest shell to end")
    finally:
        assert not d.cleanup()


# Exec on a degraded bottle (DEGRADED) and while it is created (BUSY) are the registry's rules:
# tests/bottles/test_exec_target.py checks them in process.


def test_exec_needs_a_connection_of_its_own(daemon: VMDaemon) -> None:
    """Commands pipelined with Exec on one connection: Exec is refused (BUSY)."""
    from bottlenet.control import codec

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(daemon.control)
    sock.settimeout(30)
    try:
        sock.sendall(
            codec.encode_request(C.VerifyBottle, b"1", {"name": "b1"})
            + codec.encode_request(C.Exec, b"2", {"bottle": "b1", "argv": ["true"]})
        )
        data = b""
        while b"BUSY" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    finally:
        sock.close()


def test_session_error_when_the_connection_breaks() -> None:
    with pytest.raises(ControlConnectionError):
        a, b = socket.socketpair()
        from bottlenet.control.blocking import ExecSession

        s = ExecSession(a, b"", tty=False, stdin=False)
        b.close()
        s.run()


def test_blocking_client_exec_over_a_plain_path_address(daemon: VMDaemon) -> None:
    with BlockingControlClient(f"unix:{daemon.control}") as c:
        assert c.exec("b1", ["true"]) == 0
