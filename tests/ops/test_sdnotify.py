"""sd_notify against a real datagram socket standing in for systemd."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator

import pytest
from twisted.internet.defer import Deferred, succeed

from bottlenet.ops import sdnotify


@pytest.fixture
def systemd() -> Iterator[tuple[socket.socket, dict[str, str]]]:
    """A bound AF_UNIX datagram socket, and an env whose NOTIFY_SOCKET names it."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(5)
        try:
            yield sock, {"NOTIFY_SOCKET": path}
        finally:
            sock.close()


def test_ready_sends_one_datagram(systemd: tuple[socket.socket, dict[str, str]]) -> None:
    sock, env = systemd
    assert sdnotify.ready("3 bottles restored", env) is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=3 bottles restored"


def test_stopping_and_status(systemd: tuple[socket.socket, dict[str, str]]) -> None:
    sock, env = systemd
    assert sdnotify.status("draining", env)
    assert sdnotify.stopping(env)
    assert sock.recv(4096) == b"STATUS=draining"
    assert sock.recv(4096) == b"STOPPING=1"


def test_status_cannot_inject_assignments(systemd: tuple[socket.socket, dict[str, str]]) -> None:
    sock, env = systemd
    sdnotify.status("x\nREADY=1\x00", env)
    assert sock.recv(4096) == b"STATUS=x READY=1 "


@pytest.mark.skipif(
    not hasattr(socket, "AF_UNIX") or os.uname().sysname != "Linux",
    reason="the abstract socket namespace is Linux-only",
)
def test_abstract_namespace() -> None:
    name = f"bottlenet-test-{os.getpid()}-{id(object())}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert sdnotify.ready(env={"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(4096) == b"READY=1"


def test_unset_is_a_noop() -> None:
    assert sdnotify.ready("x", env={}) is False
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": ""}) is False
    # A relative name is not a socket systemd would give us: refuse rather than guess.
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": "relative"}) is False


def test_nobody_listening_returns_false_without_raising(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "gone")
    assert sdnotify.stopping({"NOTIFY_SOCKET": path}) is False


def test_notifier_service_ready_then_stopping(
    systemd: tuple[socket.socket, dict[str, str]],
) -> None:
    sock, env = systemd
    when_ready: Deferred[str] = Deferred()
    svc = sdnotify.SystemdNotifier(when_ready, status="2 bottles", env=env)
    svc.startService()
    assert svc.sent == []
    when_ready.callback("result")
    assert sock.recv(4096) == b"READY=1\nSTATUS=2 bottles"
    # The caller's Deferred keeps its result: the notifier only observes it.
    seen: list[str] = []
    when_ready.addCallback(seen.append)
    assert seen == ["result"]
    svc.stopService()
    assert sock.recv(4096) == b"STOPPING=1"
    assert svc.sent == ["READY=1", "STOPPING=1"]


def test_notifier_sends_nothing_when_start_fails() -> None:
    when_ready: Deferred[None] = Deferred()
    svc = sdnotify.SystemdNotifier(when_ready, env={})
    svc.startService()
    when_ready.errback(RuntimeError("bind failed"))
    failures: list[object] = []
    when_ready.addErrback(failures.append)  # the failure is still the caller's to handle
    assert len(failures) == 1
    assert svc.sent == []


def test_notifier_already_ready() -> None:
    svc = sdnotify.SystemdNotifier(succeed(None), env={})
    svc.startService()
    assert svc.sent == ["READY=1"]


def test_the_daemon_itself_sends_ready_then_stopping(
    systemd: tuple[socket.socket, dict[str, str]], tmp_path: object
) -> None:
    """The real daemon (``Type=notify`` units wait for this): READY=1 once its control socket
    is up, STOPPING=1 on SIGTERM. Before, only the notifier class was tested: a daemon wired
    with an empty environment would never have said READY and every test stayed green."""
    import signal
    import subprocess
    import sys

    from bottlenet.control.blocking import BlockingControlClient

    sock, env = systemd
    sock.settimeout(90)  # the daemon's start on a loaded machine; fires as soon as it is up
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    state, control = os.path.join(str(tmp_path), "s"), os.path.join(str(tmp_path), "c", "c.sock")
    child_env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    child_env.update(env, PYTHONPATH=root)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "twisted",
            "bottlenet",
            "--state-dir",
            state,
            "--control",
            "unix:" + control,
        ],
        env=child_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        message = sock.recv(4096)
        assert message.split(b"\n")[0] == b"READY=1", message
        with BlockingControlClient(control, timeout=10) as client:
            client.ping()  # READY came after the control socket was listening
        proc.send_signal(signal.SIGTERM)
        assert sock.recv(4096) == b"STOPPING=1"
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
