"""The real daemon process: systemd socket activation, and a fatal exit without its socket."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from bottlenet.control.blocking import BlockingControlClient

from .daemon_helpers import CLEAN_EXIT, start_daemon, stop, wait_ready


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
    state = os.path.join(tmp, "state")
    proc = start_daemon(state, "systemd:domain=UNIX:name=control", s.fileno())
    s.close()
    try:
        wait_ready(path, proc)
        with BlockingControlClient(path, timeout=5) as c:
            assert c.hello().protocol == 1
            c.create_bottle("sd")
            assert [b.name for b in c.all_bottles()] == ["sd"]
        assert os.stat(path).st_mode & 0o777 == 0o600
    finally:
        out = stop(proc)
    assert proc.returncode in CLEAN_EXIT, out
    assert "Traceback" not in out
    assert "control: listening on" in out
    # systemd owns the path: the daemon neither chmods nor unlinks it.
    assert os.path.exists(path) and os.stat(path).st_mode & 0o777 == 0o600


def test_daemon_without_its_socket_exits_nonzero(tmp: str) -> None:
    run = os.path.join(tmp, "run")
    os.mkdir(run, 0o700)
    path = os.path.join(run, "control.sock")
    with open(path, "w") as f:
        f.write("not a socket")
    proc = start_daemon(os.path.join(tmp, "state"), f"unix:{path}")
    out, _ = proc.communicate(timeout=60)
    text = out.decode()
    assert proc.returncode == 1, text
    assert "Traceback" not in text
    assert [line for line in text.splitlines() if "cannot listen on" in line] != []
    with open(path) as f:
        assert f.read() == "not a socket"


def test_control_connection_cap_is_an_option(tmp: str) -> None:
    """``--control-max-connections 1``: while one client holds its connection (as an exec
    session or a watcher does) the next is closed at accept; once it goes, the next is served."""
    from bottlenet.control.blocking import ControlConnectionError

    path = os.path.join(tmp, "c.sock")
    state = os.path.join(tmp, "state")
    proc = start_daemon(state, f"unix:{path}", extra=("--control-max-connections", "1"))
    try:
        wait_ready(path, proc)
        with BlockingControlClient(path, timeout=10) as held:
            held.ping()  # accepted and counted
            with pytest.raises(ControlConnectionError):
                with BlockingControlClient(path, timeout=10) as second:
                    second.ping()
        # the held connection is gone: its slot comes back (wait_ready retries until then)
        wait_ready(path, proc)
    finally:
        out = stop(proc)
    assert proc.returncode in CLEAN_EXIT, out
    assert "control: refused a connection: 1 connections are open" in out
