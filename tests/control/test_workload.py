"""The workload, end to end: running, then exited with its code (the bottle says so and stays
up), its output through ``bottle logs``, across a daemon restart, and T12 (a workload run as a
user cannot forge its exit). The daemon runs in process (``tests/bottles/harness.py``: the
tap's real service tree; a restart is a fresh tree on the same state dir) against the fake
smolvm (a TEST DOUBLE) with ``exec-netns``: the real wrapper and waiter run, and each exec of
the agent VM sees that machine's own /tmp (kept across its execs, as a VM's filesystem), not the
host's, so the test ends a workload by making the file it waits for in that directory (the
fake's ``guest-tmp``), as a launcher's exec in the bottle would. ``bottlenetctl`` runs as a
person runs it where its output is a stream or bytes (``events --json``, ``bottle logs``), and
through its own ``main`` in a thread for the rest (as ``tests/cli/test_cli.py`` does).

The registry's rules (the exit recorded once, exec/logs/removal of an exited bottle, the
waiter found again after a restart, logs of a bottle without a workload) are checked on a
clock in ``tests/bottles/test_workload_rules.py`` and ``test_bottle.py``."""

from __future__ import annotations

import io
import json
import os
import select
import subprocess
import time
from typing import Any

from bottlenet.cli.main import main, read_spec
from bottlenet.control.blocking import BlockingControlClient
from bottlenet.control.client import ControlClient
from bottlenet.control.records import BottleRecord, EventRecord
from tests.bottles.harness import DaemonCase, in_thread

from .daemon_helpers import ENV, REPO
from .vmdaemon import SPEC_TOML, wait_for


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


def logs_of(control: str, name: str, tail: int | None = None) -> bytes:
    """The workload's output as ``bottle logs`` reads it."""
    out, err = io.BytesIO(), io.BytesIO()
    with BlockingControlClient(control, timeout=10) as c:
        c.logs(name, stdout=out, stderr=err, tail=tail)
    return out.getvalue()


class WorkloadTests(DaemonCase):
    timeout = 480  # VM bottles through the fake and bottlenetctl processes: slow when loaded

    def setUp(self) -> None:
        super().setUp()
        if os.geteuid() != 0:
            self.skipTest("exec-netns (unshare) needs root")
        self.fake.set_faults("exec-netns")

    async def create(
        self, client: ControlClient, name: str, workload: str | None = None, user: str = ""
    ) -> BottleRecord:
        """A socket-mode VM bottle with one sidecar service (and ``workload``, a shell script
        run as ``user``, if given), created over the in-process client."""
        image = os.path.join(self.tmp, "agent.tar")
        open(image, "a").close()
        spec = os.path.join(self.tmp, f"{name}.toml")
        with open(spec, "w") as f:
            f.write(SPEC_TOML.format(image=image))
            if workload is not None:
                f.write(f"workload = {json.dumps(['/bin/sh', '-c', workload])}\n")
            if user:
                f.write(f"user = {json.dumps(user)}\n")
        return await client.create_bottle(name, spec=read_spec(spec))

    async def cli(self, *args: str) -> tuple[int, str, str]:
        """``bottlenetctl --control C ARGS`` run by the CLI's own ``main`` (in a thread, as
        ``tests/cli/test_cli.py`` does): its exit code, stdout and stderr."""
        out, err = io.StringIO(), io.StringIO()
        argv = ["--control", self.control, *args]
        code = await in_thread(lambda: main(argv, env={}, out=out, err=err))
        return code, out.getvalue(), err.getvalue()

    def guest_tmp(self, name: str) -> str:
        """The bottle's agent VM's /tmp as the host sees it (the fake's machine directory)."""
        return os.path.join(self.fake.vm_dir(f"bn-{name}-agent"), "guest-tmp")

    def release(self, name: str, gate: str) -> None:
        """Make ``gate`` in the bottle's agent VM's /tmp (the file its workload waits for)."""
        open(os.path.join(self.guest_tmp(name), gate), "w").close()

    async def release_and_wait_exit(
        self, client: ControlClient, name: str, gate: str
    ) -> EventRecord:
        """Subscribe to the bottle's events, release its workload, wait for workload_exited."""
        stream = await client.events(name)
        self.release(name, gate)
        async for event in stream:
            if event.kind == "workload_exited":
                return event
        raise AssertionError("the event stream ended")

    async def test_workload_exit_turns_the_bottle_exited_and_keeps_it_up(self) -> None:
        """A workload's exit makes the bottle ``exited`` with its code (``events --json`` says
        so); both VMs stay up, and ``bottle logs`` and ``bottle status`` still answer."""
        client = await self.start()
        gate = "bottlenet-test-go"
        script = (
            "echo hello from the agent; echo oops >&2; "
            f"while [ ! -e /tmp/{gate} ]; do sleep 0.05; done; exit 4"
        )
        watcher = subprocess.Popen(
            self.ctl_argv("events", "--json", "--bottle", "b1"),
            env=ENV,
            cwd=REPO,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: select() sees every line not yet read
        )
        try:
            record = await self.create(client, "b1", script)  # while the watcher starts
            assert (record.state, record.workload) == ("ready", "running")
            await in_thread(
                wait_for,
                lambda: b"hello from the agent" in logs_of(self.control, "b1"),
                30,
                "the workload's output",
            )
            await self.when_logged("watches events")  # before the workload can end
            self.release("b1", gate)
            kinds = await in_thread(read_until_exited, watcher)
            event = kinds[-1]
            assert (event["state"], event["exit_code"]) == ("exited", 4)
            assert event["detail"] == "workload exited with code 4"
        finally:
            watcher.kill()
            watcher.wait()
            if watcher.stdout is not None:
                watcher.stdout.close()
        b = await client.bottle_status("b1")
        assert (b.state, b.workload, b.workload_exit_code) == ("exited", "exited", 4)
        # nothing was torn down: both machines run, logs and status still answer
        assert sorted(self.machines()) == ["bn-b1-agent", "bn-b1-sidecar"]
        r = await self.ctl("bottle", "logs", "b1")
        assert (r.returncode, r.stdout) == (0, b"hello from the agent\noops\n"), r.stderr
        assert await in_thread(logs_of, self.control, "b1", 1) == b"oops\n"
        code, text, _ = await self.cli("bottle", "status", "b1")
        assert code == 0 and "workload" in text and "exited (code 4)" in text
        await client.destroy_bottle("b1")

    async def test_t12_a_workload_with_a_user_cannot_forge_its_exit(self) -> None:
        """T12: a workload run as agent.user cannot write its exit file (the directory is the
        guest root's, the code is written by its root parent): the bottle stays running, across
        a daemon restart too, until the workload really ends, and then has its real code."""
        client = await self.start()
        guest = "/tmp/.bottlenet-workload-bn-b3-agent"
        gate = "bottlenet-test-go3"
        script = (
            f"id -u; (echo 0 > {guest}/exit.tmp && mv {guest}/exit.tmp {guest}/exit) 2>/dev/null "
            f"&& echo forged || echo forge refused; "
            f"while [ ! -e /tmp/{gate} ]; do sleep 0.05; done; exit 5"
        )
        await self.create(client, "b3", script, user="65534")
        logs = await in_thread(
            wait_for,
            lambda: (out := logs_of(self.control, "b3")) and b"forge" in out and out,
            30,
            "the workload's forge attempt",
        )
        assert logs == b"65534\nforge refused\n"
        exit_file = os.path.join(self.guest_tmp("b3"), os.path.basename(guest), "exit")
        assert not os.path.exists(exit_file), "an exit file exists while the workload runs"
        await self.stop()
        client = await self.start()  # returns once recovery is done
        assert (await client.bottle_status("b3")).workload == "running"
        await self.release_and_wait_exit(client, "b3", gate)
        b = await client.bottle_status("b3")
        assert b.state == "exited"
        assert b.workload_exit_code == 5

    async def test_logs_usage_and_errors(self) -> None:
        """``bottle logs``: a bottle with no workload, an unknown bottle and a negative --tail
        are each a clear error (exit 1)."""
        client = await self.start()
        await self.create(client, "b1")  # no workload in its spec
        code, _, err = await self.cli("bottle", "logs", "b1")
        assert code == 1 and "runs no workload" in err
        code, _, err = await self.cli("bottle", "logs", "nope")
        assert code == 1 and "NOT_FOUND" in err
        code, _, err = await self.cli("bottle", "logs", "b1", "--tail", "-1")
        assert code == 1 and "INVALID_ARGUMENT" in err
