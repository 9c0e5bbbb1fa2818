"""Daemon processes without the forward table: systemd socket activation, fatal exit."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from bottlenet.control.blocking import BlockingControlClient

from .daemon_helpers import start_daemon, stop, wait_ready


@pytest.fixture
def tmp() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="bnd-")
    yield d
    subprocess.run(["rm", "-rf", d], check=False)


def test_systemd_socket_activation(tmp: str) -> None:
    path = os.path.join(tmp, "sd.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    os.chmod(path, 0o600)
    s.listen(16)
    s.set_inheritable(True)
    proc = start_daemon("FAKE", "systemd:domain=UNIX:name=control", s.fileno())
    s.close()
    try:
        wait_ready(path, proc)
        with BlockingControlClient(path, timeout=5) as c:
            assert c.hello().smolvm_available is False
        assert os.stat(path).st_mode & 0o777 == 0o600
    finally:
        stop(proc)


def test_daemon_without_its_socket_exits_nonzero(tmp: str) -> None:
    run = os.path.join(tmp, "run")
    os.mkdir(run, 0o700)
    path = os.path.join(run, "control.sock")
    with open(path, "w") as f:
        f.write("not a socket")
    proc = start_daemon("FAKE", f"unix:{path}")
    out, _ = proc.communicate(timeout=30)
    text = out.decode()
    assert proc.returncode == 1, text
    assert "Traceback" not in text
    assert [line for line in text.splitlines() if "cannot listen on" in line] != []
    with open(path) as f:
        assert f.read() == "not a socket"
