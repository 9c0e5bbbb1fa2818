"""The fake smolvm's locks are the real CLIs' (docs/smolvm.md, "Locks"): one machine's start
or stop in progress holds that machine's lock only, so another machine starts, stops, runs
commands and is listed meanwhile (issue 38: the sidecar and the agent boot at once)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.fakes import FAKE_SMOLVM, FakeSmolvm
from tests.fakes.smolvm_impl import ALREADY_STARTING, BOOT_RELEASE
from tests.vmctl.test_fake import run


def machine(fake: FakeSmolvm, *args: str) -> subprocess.CompletedProcess[str]:
    return run(fake, "machine", *args)


def background(fake: FakeSmolvm, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [FAKE_SMOLVM, "machine", *args],
        env=fake.environ(SMOLVM_DATA_DIR=fake.path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_file(path: str, proc: subprocess.Popen[str]) -> None:
    """Until ``path`` exists (the call ``proc`` made it), or ``proc`` ended without it."""
    import time

    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@contextmanager
def booting(fake: FakeSmolvm, **faults: Any) -> Iterator[subprocess.Popen[str]]:
    """Machine ``a``'s start, in progress: its "VM" process runs and waits to be let boot."""
    fake.set_faults(boot_hold=["a"], **faults)
    for name in ("a", "b"):
        assert machine(fake, "create", "--name", name).returncode == 0
    start = background(fake, "start", "--name", "a")
    try:
        wait_for_file(os.path.join(fake.vm_dir("a"), "agent.pid"), start)
        yield start
    finally:
        if start.poll() is None:
            start.kill()
        start.communicate()


@pytest.fixture
def held(fake_smolvm: FakeSmolvm) -> Iterator[subprocess.Popen[str]]:
    """``a`` booting, the fake playing the run's version."""
    with booting(fake_smolvm) as start:
        yield start


def test_another_machine_starts_stops_and_runs_while_one_boots(
    fake_smolvm: FakeSmolvm, held: subprocess.Popen[str]
) -> None:
    """While ``a`` boots, ``b`` starts, runs a command and stops; ``a`` is listed
    ``created`` (its record turns running only once booted), then its start finishes."""
    assert machine(fake_smolvm, "start", "--name", "b").returncode == 0
    assert held.poll() is None, "b's start waited for a's boot"
    r = machine(fake_smolvm, "exec", "--name", "b", "--", "echo", "hi")
    assert (r.returncode, r.stdout) == (0, "hi\n")
    states = {m["name"]: m["state"] for m in fake_smolvm.state()["machines"].values()}
    assert states == {"a": "created", "b": "running"}
    assert machine(fake_smolvm, "stop", "--name", "b").returncode == 0
    assert held.poll() is None
    with open(os.path.join(fake_smolvm.vm_dir("a"), BOOT_RELEASE), "w"):
        pass
    out, err = held.communicate(timeout=30)
    assert held.returncode == 0, err
    assert "running (PID: " in out
    assert fake_smolvm.state()["machines"]["a"]["state"] == "running"
    assert fake_smolvm.state()["machines"]["b"]["state"] == "stopped"


def test_a_second_start_of_a_booting_machine_is_refused(fake_smolvm: FakeSmolvm) -> None:
    """As 1.32.2: ``vm.lock`` is taken without waiting (1.37.3 first waits for the stop lock
    its first start holds)."""
    with booting(fake_smolvm, version="1.32.2"):
        r = machine(fake_smolvm, "start", "--name", "a")
    assert r.returncode == 1
    assert r.stderr == f"Error: {ALREADY_STARTING}\n"


def test_another_machine_stops_while_one_stops(fake_smolvm: FakeSmolvm) -> None:
    """``a``'s stop waits out its grace (its VM ignores TERM); ``b``'s stop and delete
    finish meanwhile, and ``a``'s ends as soon as its VM is gone."""
    fake_smolvm.set_faults("ignore-term", stop_grace=120)
    for name in ("a", "b"):
        assert machine(fake_smolvm, "create", "--name", name).returncode == 0
        assert machine(fake_smolvm, "start", "--name", name).returncode == 0
    a_pid = fake_smolvm.state()["machines"]["a"]["pid"]
    stopping = background(fake_smolvm, "stop", "--name", "a")
    try:
        # a's stop has begun once its VM got the TERM (ignored): wait on the stop's line.
        assert stopping.stdout is not None
        assert stopping.stdout.readline() == "Stopping machine 'a'...\n"
        b_pid = fake_smolvm.state()["machines"]["b"]["pid"]
        os.kill(b_pid, signal.SIGKILL)  # b's own stop then needs no grace either
        assert machine(fake_smolvm, "stop", "--name", "b").returncode == 0
        assert machine(fake_smolvm, "delete", "--name", "b", "-f").returncode == 0
        assert stopping.poll() is None, "b's stop waited for a's"
        os.kill(a_pid, signal.SIGKILL)
        _, err = stopping.communicate(timeout=30)
        assert stopping.returncode == 0, err
    finally:
        if stopping.poll() is None:
            stopping.kill()
            stopping.communicate()
    assert list(fake_smolvm.state()["machines"]) == ["a"]
    assert fake_smolvm.state()["machines"]["a"]["state"] == "stopped"
