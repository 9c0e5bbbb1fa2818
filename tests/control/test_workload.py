"""The workload: running, then exited with its code (the bottle says so and stays up), its
output through ``bottle logs``, across a daemon restart. Against the fake smolvm (a TEST DOUBLE:
the "guest" is the host, so the wrapper's files live in the host's /tmp)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from bottlenet.bottles.workload import guest_dir

from .vmdaemon import VMDaemon, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="exec-netns (unshare) needs root")


@pytest.fixture
def daemon() -> Iterator[VMDaemon]:
    d = VMDaemon().start()
    try:
        yield d
    finally:
        assert not d.cleanup()
        for name in ("b1", "b2"):
            shutil.rmtree(guest_dir(f"bn-{name}-agent"), ignore_errors=True)


def status(d: VMDaemon, name: str) -> dict[str, object]:
    r = d.ctl("--json", "bottle", "status", name)
    assert r.returncode == 0, r.stderr
    bottle: dict[str, object] = json.loads(r.stdout)["bottle"]
    return bottle


def test_workload_exit_turns_the_bottle_exited_and_keeps_it_up(daemon: VMDaemon) -> None:
    gate = os.path.join(daemon.dir, "go")
    script = (
        "echo hello from the agent; echo oops >&2; "
        f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 4"
    )
    watcher = subprocess.Popen(
        daemon.ctl_argv("events", "--json", "--bottle", "b1"), stdout=subprocess.PIPE
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
        with open(gate, "w"):
            pass
        assert watcher.stdout is not None
        kinds = []
        while not kinds or kinds[-1]["kind"] != "workload_exited":
            line = watcher.stdout.readline()
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
    gate = os.path.join(daemon.dir, "go2")
    script = f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 9"
    daemon.create_vm_bottle("b2", workload=["/bin/sh", "-c", script])
    daemon.stop()
    daemon.start()
    wait_for(lambda: "recovery done" in daemon.log().split("Starting reactor")[-1], 60, "recovery")
    assert status(daemon, "b2")["workload"] == "running"
    with open(gate, "w"):
        pass
    wait_for(lambda: status(daemon, "b2")["state"] == "exited", 60, "the exit after a restart")
    assert status(daemon, "b2")["workload_exit_code"] == 9


def test_logs_usage_and_errors(daemon: VMDaemon) -> None:
    daemon.create_vm_bottle("b1")  # no workload in its spec
    r = daemon.ctl("bottle", "logs", "b1")
    assert r.returncode == 1 and b"runs no workload" in r.stderr
    r = daemon.ctl("bottle", "logs", "nope")
    assert r.returncode == 1 and b"NOT_FOUND" in r.stderr
    r = daemon.ctl("bottle", "logs", "b1", "--tail", "-1")
    assert r.returncode == 1 and b"INVALID_ARGUMENT" in r.stderr
