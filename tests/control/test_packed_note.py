"""smolvm's packed-assets note never reaches an exec client: a real daemon driving the fake
smolvm in its ``packed-note`` mode (a TEST DOUBLE that prints the note first on stderr of every
call, as the ``smolmachines`` wheel's ``smol-vmm`` 1.32.2 does; ``exec-netns``, needs root).
Each session kind: the client taking the command's pipes (``fds``), framed through the daemon,
and a terminal (``-t``, where the note arrives on the one stream, ending ``\\r\\n``)."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Iterator

import pytest

from .vmdaemon import VMDaemon, run_in_pty

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="exec-netns (unshare) needs root")

NOTE = b"note: no packed assets found"
COMMAND = ["sh", "-c", "echo out; echo err >&2; exit 3"]


@pytest.fixture(scope="module")
def daemon() -> Iterator[VMDaemon]:
    d = VMDaemon()
    d.fake.set_faults("exec-netns", "packed-note")
    d.start()
    d.create_vm_bottle("b1")
    try:
        yield d
    finally:
        assert not d.cleanup()


def test_the_fake_prints_the_note_on_every_call(daemon: VMDaemon) -> None:
    """The mode is on: the fake's own stderr starts with the note (what the daemon gets)."""
    import subprocess

    from tests.fakes import FAKE_SMOLVM

    r = subprocess.run(
        [FAKE_SMOLVM, "--version"],
        env=daemon.fake.environ(SMOLVM_DATA_DIR=daemon.fake.path),
        capture_output=True,
    )
    assert r.stderr.startswith(NOTE), r.stderr


@pytest.mark.parametrize("fds", [True, False])
def test_exec_clients_stderr_has_no_note(daemon: VMDaemon, fds: bool) -> None:
    """The client's stderr is the command's own, whether it takes the pipes or gets frames."""
    out, err = io.BytesIO(), io.BytesIO()
    with daemon.client(timeout=60) as c:
        code = c.exec("b1", COMMAND, stdout=out, stderr=err, fds=fds)
    assert (code, out.getvalue(), err.getvalue()) == (3, b"out\n", b"err\n")


def test_bottlenetctl_exec_has_no_note(daemon: VMDaemon) -> None:
    """``bottlenetctl bottle exec`` (the light client, fds): stdout and stderr exact."""
    r = daemon.ctl("bottle", "exec", "b1", "--", *COMMAND)
    assert (r.returncode, r.stdout, r.stderr) == (3, b"out\n", b"err\n")


def test_terminal_session_shows_no_note(daemon: VMDaemon) -> None:
    """``bottle exec -t`` on a terminal: the user's screen gets the command's bytes only."""
    argv = daemon.ctl_argv("bottle", "exec", "-t", "b1", "--", "sh", "-c", "echo T$((40+2))")
    pid, fd = run_in_pty([sys.executable, *argv[1:]] if argv[0] == sys.executable else argv)
    seen = b""
    try:
        while True:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the terminal's other side is gone
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)
    assert b"T42" in seen, seen
    assert NOTE not in seen, seen
    assert os.waitstatus_to_exitcode(status) == 0
