"""The workload: running, then exited with its code (the bottle says so and stays up), its
output through ``bottle logs``, across a daemon restart. Against the fake smolvm (a TEST DOUBLE)
with ``exec-netns``: each exec of the agent VM sees that machine's own /tmp (kept across its
execs, as a VM's filesystem), not the host's, so the test tells its workload to end the way a
launcher would, by an exec in the bottle that makes the file the workload waits for."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Iterator

import pytest

from .vmdaemon import VMDaemon, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="exec-netns (unshare) needs root")


@pytest.fixture
def daemon() -> Iterator[VMDaemon]:
    d = VMDaemon().start()
    try:
        yield d
    finally:
        assert not d.cleanup()


def status(d: VMDaemon, name: str) -> dict[str, object]:
    r = d.ctl("--json", "bottle", "status", name)
    assert r.returncode == 0, r.stderr
    bottle: dict[str, object] = json.loads(r.stdout)["bottle"]
    return bottle


def release(d: VMDaemon, name: str, gate: str) -> None:
    """Make ``gate`` in the bottle's agent VM (the file its workload waits for)."""
    r = d.ctl("bottle", "exec", name, "--", "/bin/sh", "-c", f': > "{gate}"')
    assert r.returncode == 0, r.stderr


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    """One line of ``proc``'s stdout, or an AssertionError after ``timeout`` seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no line from the watcher in {timeout} s"
    return proc.stdout.readline()


def test_workload_exit_turns_the_bottle_exited_and_keeps_it_up(daemon: VMDaemon) -> None:
    gate = "/tmp/bottlenet-test-go"
    script = (
        "echo hello from the agent; echo oops >&2; "
        f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 4"
    )
    watcher = subprocess.Popen(
        daemon.ctl_argv("events", "--json", "--bottle", "b1"),
        stdout=subprocess.PIPE,
        bufsize=0,  # unbuffered: select() sees every line not yet read
    )
    try:
        wait_for(lambda: "watches events" in daemon.log(), 30, "the watcher")
        record = daemon.create_vm_bottle("b1", workload=["/bin/sh", "-c", script])
        assert record["workload"] == "running"
        assert status(daemon, "b1")["workload"] == "running"
        wait_for(
            lambda: b"hello from the agent" in daemon.ctl("bottle", "logs", "b1").stdout,
            30,
            "the workload's output",
        )
        release(daemon, "b1", gate)
        kinds = []
        deadline = time.monotonic() + 60
        while not kinds or kinds[-1]["kind"] != "workload_exited":
            line = read_line(watcher, max(0.0, deadline - time.monotonic()))
            assert line, kinds
            kinds.append(json.loads(line))
        event = kinds[-1]
        assert (event["state"], event["exit_code"]) == ("exited", 4)
        assert event["detail"] == "workload exited with code 4"
    finally:
        watcher.kill()
        watcher.wait()
    b = status(daemon, "b1")
    assert (b["state"], b["workload"], b["workload_exit_code"]) == ("exited", "exited", 4)
    # nothing was torn down: both machines run, exec and logs still work
    machines = daemon.fake.state()["machines"]
    assert sorted(machines) == ["bn-b1-agent", "bn-b1-sidecar"]
    r = daemon.ctl("bottle", "logs", "b1")
    assert (r.returncode, r.stdout) == (0, b"hello from the agent\noops\n"), r.stderr
    r = daemon.ctl("bottle", "logs", "b1", "--tail", "1")
    assert r.stdout == b"oops\n"
    assert daemon.ctl("bottle", "exec", "b1", "--", "true").returncode == 0
    text = daemon.ctl("bottle", "status", "b1").stdout.decode()
    assert "workload" in text and "exited (code 4)" in text
    assert daemon.ctl("bottle", "rm", "b1").returncode == 0


def test_a_restarted_daemon_still_sees_the_workload_end(daemon: VMDaemon) -> None:
    gate = "/tmp/bottlenet-test-go2"
    script = f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 9"
    daemon.create_vm_bottle("b2", workload=["/bin/sh", "-c", script])
    daemon.stop()
    daemon.start()
    wait_for(lambda: "recovery done" in daemon.log().split("Starting reactor")[-1], 60, "recovery")
    assert status(daemon, "b2")["workload"] == "running"
    release(daemon, "b2", gate)
    wait_for(lambda: status(daemon, "b2")["state"] == "exited", 60, "the exit after a restart")
    assert status(daemon, "b2")["workload_exit_code"] == 9


def test_t12_a_workload_with_a_user_cannot_forge_its_exit(daemon: VMDaemon) -> None:
    """T12: a workload run as agent.user cannot write its exit file (the directory is the
    guest root's, the code is written by its root parent): the bottle stays running until
    the workload really ends, and then has its real code."""
    guest = "/tmp/.bottlenet-workload-bn-b3-agent"
    gate = "/tmp/bottlenet-test-go3"
    script = (
        f"id -u; (echo 0 > {guest}/exit.tmp && mv {guest}/exit.tmp {guest}/exit) 2>/dev/null "
        f"&& echo forged || echo forge refused; "
        f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 5"
    )
    daemon.create_vm_bottle("b3", workload=["/bin/sh", "-c", script], user="65534")
    logs = wait_for(
        lambda: (out := daemon.ctl("bottle", "logs", "b3").stdout) and b"forge" in out and out,
        30,
        "the workload's forge attempt",
    )
    assert logs == b"65534\nforge refused\n"
    r = daemon.ctl("bottle", "exec", "b3", "--", "/bin/sh", "-c", f'[ ! -e "{guest}/exit" ]')
    assert r.returncode == 0, "an exit file exists while the workload runs"
    assert status(daemon, "b3")["workload"] == "running"
    release(daemon, "b3", gate)
    wait_for(lambda: status(daemon, "b3")["state"] == "exited", 60, "the real exit")
    assert status(daemon, "b3")["workload_exit_code"] == 5


def test_logs_usage_and_errors(daemon: VMDaemon) -> None:
    daemon.create_vm_bottle("b1")  # no workload in its spec
    r = daemon.ctl("bottle", "logs", "b1")
    assert r.returncode == 1 and b"runs no workload" in r.stderr
    r = daemon.ctl("bottle", "logs", "nope")
    assert r.returncode == 1 and b"NOT_FOUND" in r.stderr
    r = daemon.ctl("bottle", "logs", "b1", "--tail", "-1")
    assert r.returncode == 1 and b"INVALID_ARGUMENT" in r.stderr
