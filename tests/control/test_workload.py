"""The workload: running, then exited with its code (the bottle says so and stays up), its
output through ``bottle logs``, across a daemon restart. The daemon runs in process
(``tests/bottles/harness.py``: the tap's real service tree; a restart is a fresh tree on the same
state dir) against the fake smolvm (a TEST DOUBLE) with ``exec-netns``: each exec of the agent VM
sees that machine's own /tmp (kept across its execs, as a VM's filesystem), not the host's, so the
test tells its workload to end the way a launcher would, by an exec in the bottle that makes the
file the workload waits for. ``bottlenetctl`` runs as a person runs it where its output is
checked."""

from __future__ import annotations

import io
import json
import os
import select
import subprocess
import time
from typing import Any

from bottlenet.control.blocking import BlockingControlClient
from bottlenet.control.client import ControlClient
from bottlenet.control.records import EventRecord
from tests.bottles.harness import DaemonCase, in_thread

from .daemon_helpers import ENV, REPO
from .vmdaemon import wait_for


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    """One line of ``proc``'s stdout, or an AssertionError after ``timeout`` seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no line from the watcher in {timeout} s"
    return proc.stdout.readline()


def read_until_exited(watcher: subprocess.Popen[bytes], timeout: float = 60) -> list[Any]:
    """``events --json`` lines until the workload_exited one (blocking: off the reactor)."""
    kinds: list[Any] = []
    deadline = time.monotonic() + timeout
    while not kinds or kinds[-1]["kind"] != "workload_exited":
        line = read_line(watcher, max(0.0, deadline - time.monotonic()))
        assert line, kinds
        kinds.append(json.loads(line))
    return kinds


def logs_of(control: str, name: str) -> bytes:
    """The workload's output as ``bottle logs`` reads it."""
    out, err = io.BytesIO(), io.BytesIO()
    with BlockingControlClient(control, timeout=10) as c:
        c.logs(name, stdout=out, stderr=err)
    return out.getvalue()


class WorkloadTests(DaemonCase):
    timeout = 480  # VM bottles through the fake and bottlenetctl processes: slow when loaded

    def setUp(self) -> None:
        super().setUp()
        if os.geteuid() != 0:
            self.skipTest("exec-netns (unshare) needs root")
        self.fake.set_faults("exec-netns", version="1.32.2")

    async def status(self, name: str) -> dict[str, Any]:
        """``bottlenetctl --json bottle status NAME``'s bottle."""
        r = await self.ctl("--json", "bottle", "status", name)
        assert r.returncode == 0, r.stderr
        bottle: dict[str, Any] = json.loads(r.stdout)["bottle"]
        return bottle

    async def release(self, name: str, gate: str) -> None:
        """Make ``gate`` in the bottle's agent VM (the file its workload waits for)."""
        r = await self.ctl("bottle", "exec", name, "--", "/bin/sh", "-c", f': > "{gate}"')
        assert r.returncode == 0, r.stderr

    async def release_and_wait_exit(
        self, client: ControlClient, name: str, gate: str
    ) -> EventRecord:
        """Subscribe to the bottle's events, release its workload, wait for workload_exited."""
        stream = await client.events(name)
        await self.release(name, gate)
        async for event in stream:
            if event.kind == "workload_exited":
                return event
        raise AssertionError("the event stream ended")

    async def test_workload_exit_turns_the_bottle_exited_and_keeps_it_up(self) -> None:
        """A workload's exit makes the bottle ``exited`` with its code (an event says so); both
        VMs stay up, and logs, exec and status still answer."""
        await self.start()
        gate = "/tmp/bottlenet-test-go"
        script = (
            "echo hello from the agent; echo oops >&2; "
            f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 4"
        )
        watcher = subprocess.Popen(
            self.ctl_argv("events", "--json", "--bottle", "b1"),
            env=ENV,
            cwd=REPO,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: select() sees every line not yet read
        )
        try:
            await self.when_logged("watches events")
            record = await self.create_vm_bottle("b1", workload=["/bin/sh", "-c", script])
            assert record["workload"] == "running"
            assert (await self.status("b1"))["workload"] == "running"
            await in_thread(
                wait_for,
                lambda: b"hello from the agent" in logs_of(self.control, "b1"),
                30,
                "the workload's output",
            )
            await self.release("b1", gate)
            kinds = await in_thread(read_until_exited, watcher)
            event = kinds[-1]
            assert (event["state"], event["exit_code"]) == ("exited", 4)
            assert event["detail"] == "workload exited with code 4"
        finally:
            watcher.kill()
            watcher.wait()
            if watcher.stdout is not None:
                watcher.stdout.close()
        b = await self.status("b1")
        assert (b["state"], b["workload"], b["workload_exit_code"]) == ("exited", "exited", 4)
        # nothing was torn down: both machines run, exec and logs still work
        assert sorted(self.machines()) == ["bn-b1-agent", "bn-b1-sidecar"]
        r = await self.ctl("bottle", "logs", "b1")
        assert (r.returncode, r.stdout) == (0, b"hello from the agent\noops\n"), r.stderr
        r = await self.ctl("bottle", "logs", "b1", "--tail", "1")
        assert r.stdout == b"oops\n"
        assert (await self.ctl("bottle", "exec", "b1", "--", "true")).returncode == 0
        text = (await self.ctl("bottle", "status", "b1")).stdout.decode()
        assert "workload" in text and "exited (code 4)" in text
        assert (await self.ctl("bottle", "rm", "b1")).returncode == 0

    async def test_a_restarted_daemon_still_sees_the_workload_end(self) -> None:
        """After a daemon restart the running workload is found again and its exit is seen."""
        client = await self.start()
        gate = "/tmp/bottlenet-test-go2"
        script = f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 9"
        await self.create_vm_bottle("b2", workload=["/bin/sh", "-c", script])
        await self.stop()
        client = await self.start()  # returns once recovery is done
        assert (await self.status("b2"))["workload"] == "running"
        await self.release_and_wait_exit(client, "b2", gate)
        b = await self.status("b2")
        assert b["state"] == "exited"
        assert b["workload_exit_code"] == 9

    async def test_t12_a_workload_with_a_user_cannot_forge_its_exit(self) -> None:
        """T12: a workload run as agent.user cannot write its exit file (the directory is the
        guest root's, the code is written by its root parent): the bottle stays running until
        the workload really ends, and then has its real code."""
        client = await self.start()
        guest = "/tmp/.bottlenet-workload-bn-b3-agent"
        gate = "/tmp/bottlenet-test-go3"
        script = (
            f"id -u; (echo 0 > {guest}/exit.tmp && mv {guest}/exit.tmp {guest}/exit) 2>/dev/null "
            f"&& echo forged || echo forge refused; "
            f"while [ ! -e {gate} ]; do sleep 0.05; done; exit 5"
        )
        await self.create_vm_bottle("b3", workload=["/bin/sh", "-c", script], user="65534")
        logs = await in_thread(
            wait_for,
            lambda: (out := logs_of(self.control, "b3")) and b"forge" in out and out,
            30,
            "the workload's forge attempt",
        )
        assert logs == b"65534\nforge refused\n"
        r = await self.ctl(
            "bottle", "exec", "b3", "--", "/bin/sh", "-c", f'[ ! -e "{guest}/exit" ]'
        )
        assert r.returncode == 0, "an exit file exists while the workload runs"
        assert (await self.status("b3"))["workload"] == "running"
        await self.release_and_wait_exit(client, "b3", gate)
        b = await self.status("b3")
        assert b["state"] == "exited"
        assert b["workload_exit_code"] == 5

    async def test_logs_usage_and_errors(self) -> None:
        """``bottle logs``: a bottle with no workload, an unknown bottle and a negative --tail
        are each a clear error (exit 1)."""
        await self.start()
        await self.create_vm_bottle("b1")  # no workload in its spec
        r = await self.ctl("bottle", "logs", "b1")
        assert r.returncode == 1 and b"runs no workload" in r.stderr
        r = await self.ctl("bottle", "logs", "nope")
        assert r.returncode == 1 and b"NOT_FOUND" in r.stderr
        r = await self.ctl("bottle", "logs", "b1", "--tail", "-1")
        assert r.returncode == 1 and b"INVALID_ARGUMENT" in r.stderr
