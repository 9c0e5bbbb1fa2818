"""``check_socket_owner``: whose listening UNIX socket a path is, read from the VM process's own
network namespace (a daemon restarted in another namespace must still find its VMs' sockets)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmctl.ports import Ownership, check_socket_owner

LISTEN = (
    "import socket, sys; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1); "
    "print('ready', flush=True); sys.stdin.read()"
)


def _listener(path: Path, *prefix: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", LISTEN, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _netns_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-n", "true"], check=False).returncode == 0


def test_a_socket_held_by_the_process_is_owned(tmp_path: Path) -> None:
    """A process listening at the path owns it; another pid listening nowhere does not."""
    path = tmp_path / "s.sock"
    for proc in _listener(path):
        assert check_socket_owner(str(path), proc.pid).ownership is Ownership.OWNED
        assert check_socket_owner(str(path), os.getpid()).ownership is Ownership.FOREIGN


def test_no_listener_and_a_gone_process(tmp_path: Path) -> None:
    """A path nobody listens at is NOT_LISTENING; a process that is gone is FOREIGN."""
    path = tmp_path / "s.sock"
    assert check_socket_owner(str(path), os.getpid()).ownership is Ownership.NOT_LISTENING
    gone = subprocess.Popen(["true"])
    gone.wait()
    check = check_socket_owner(str(path), gone.pid)
    assert check.ownership is Ownership.FOREIGN and "gone" in check.detail


@pytest.mark.skipif(not _netns_works(), reason="another network namespace needs root and unshare")
def test_a_socket_in_another_network_namespace_is_still_found(tmp_path: Path) -> None:
    """The VM process listens in a namespace the caller is not in (a daemon restarted under a
    new ``unshare -n``): the check reads that process's own table and finds it OWNED."""
    path = tmp_path / "s.sock"
    for proc in _listener(path, "unshare", "-n"):
        assert os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        assert check_socket_owner(str(path), proc.pid).ownership is Ownership.OWNED


def test_an_unreadable_table_is_unverifiable(tmp_path: Path) -> None:
    """Without a readable /proc the answer is UNVERIFIABLE, never OWNED."""
    (tmp_path / str(os.getpid())).mkdir()
    check = check_socket_owner(str(tmp_path / "s.sock"), os.getpid(), proc=str(tmp_path))
    assert check.ownership is Ownership.UNVERIFIABLE
