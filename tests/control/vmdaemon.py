"""A real daemon process driving the fake smolvm (``tests/fakes/smolvm``, a TEST DOUBLE: its
"VMs" are host processes, its ``exec`` runs on the host; with ``exec-netns`` in a network-less
namespace, which needs root), plus ``bottlenetctl`` as a person runs it.

Output goes to a log file (a pipe nobody reads would block a chatty daemon).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from bottlenet.control.blocking import BlockingControlClient
from tests.fakes import FAKE_SMOLVM, FakeSmolvm

from .daemon_helpers import ENV, REPO, daemon_argv

SPEC_TOML = """\
mode = "socket"
[sidecar]
image = "registry.example/sidecar:1"
[[sidecar.service]]
name = "egress"
guest_port = 3128
env = ["HTTPS_PROXY=http://{{host}}:{{port}}"]
[agent]
image = "{image}"
env = ["LANG=C.UTF-8"]
"""


def cmdline(pid: int) -> bytes:
    """A process's command line as ``/proc`` has it, NUL-terminated words (empty: it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def pids_running(line: bytes) -> list[int]:
    """Every process on the host whose command line is exactly ``line`` (an orphan too)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and cmdline(int(p)) == line]


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll ``condition`` until it is truthy (a bounded wait on an outside process's state)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def read_until_closed(sock: socket.socket, timeout: float = 30.0) -> None:
    """Read and discard until the daemon closes ``sock`` (an end of stream or a reset)."""
    sock.settimeout(timeout)
    while True:
        try:
            if not sock.recv(4096):
                return
        except ConnectionResetError:
            return


class VMDaemon:
    """``start()``, ``ctl(...)``, ``stop()``/``kill()``; ``cleanup()`` leaves nothing behind."""

    def __init__(self, *extra: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="bnx-", dir="/tmp")
        os.chmod(self.dir, 0o700)
        self.fake = FakeSmolvm(os.path.join(self.dir, "fake"))
        self.fake.set_faults("exec-netns")  # the version the run plays (tests.fakes.PLAYED)
        self.state = os.path.join(self.dir, "state")
        self.control = os.path.join(self.dir, "c.sock")
        self.image = os.path.join(self.dir, "agent.tar")
        with open(self.image, "wb"):
            pass
        self.spec = os.path.join(self.dir, "spec.toml")
        with open(self.spec, "w") as f:
            f.write(SPEC_TOML.format(image=self.image))
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> VMDaemon:
        argv = daemon_argv(
            self.state,
            f"unix:{self.control}",
            "--smolvm",
            FAKE_SMOLVM,
            "--smolvm-data-dir",
            self.fake.path,
            "--uid-ledger",
            self.fake.uid_ledger,
            *self.extra,
        )
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, env=ENV, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )
        wait_for(self._answers, 60, "the daemon to answer")
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"daemon exited {self.proc.returncode}: {self.log()}")
        try:
            with BlockingControlClient(self.control, timeout=2) as c:
                c.ping()
            return True
        except Exception:
            return False

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def client(self, timeout: float = 10) -> BlockingControlClient:
        return BlockingControlClient(self.control, timeout=timeout)

    def ctl_argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "bottlenet.cli", "--control", self.control, *args]

    def ctl(self, *args: str, input: bytes | None = None, timeout: float = 120) -> Any:
        return subprocess.run(
            self.ctl_argv(*args),
            env=ENV,
            cwd=REPO,
            input=input,
            capture_output=True,
            timeout=timeout,
        )

    def create(self, name: str, spec: str) -> subprocess.CompletedProcess[bytes]:
        """``bottlenetctl --json bottle create NAME`` of the spec text ``spec`` (written to
        ``NAME.toml`` in the daemon's directory)."""
        path = os.path.join(self.dir, f"{name}.toml")
        with open(path, "w") as f:
            f.write(spec)
        result: subprocess.CompletedProcess[bytes] = self.ctl(
            "--json", "bottle", "create", name, "--spec", path
        )
        return result

    def create_vm_bottle(
        self, name: str = "b1", workload: Sequence[str] = (), user: str | None = None
    ) -> dict[str, Any]:
        spec = SPEC_TOML.format(image=self.image)
        if workload:
            spec += f"workload = {json.dumps(list(workload))}\n"
            if user is not None:
                spec += f"user = {json.dumps(user)}\n"
        r = self.create(name, spec)
        assert r.returncode == 0, (r.stdout, r.stderr, self.log())
        record: dict[str, Any] = json.loads(r.stdout)
        return record

    def machine_pid(self, name: str) -> int:
        pid: int = self.fake.state()["machines"][name]["pid"]
        return pid

    def exec_pids(self, machine: str | None = None) -> list[int]:
        """Live "guest" processes started by the fake's exec (never the VMs), in ``machine``
        only when given."""
        from tests.fakes import process_alive

        want = "exec:" if machine is None else f"exec:{machine}"
        return [
            p
            for p, s, kind in self.fake.spawned()
            if (kind == want if machine else kind.startswith(want)) and process_alive(p, s)
        ]

    def guest_pids(self, machine: str | None = None) -> list[int]:
        """The "guest" processes (in ``machine`` only when given) and every live descendant of
        theirs (an exec's command runs under vmctl's session wrapper, so the command itself
        is a child of the exec's pid)."""
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as fh:
                        parents[int(entry)] = int(fh.read().rpartition(")")[2].split()[1])
                except (OSError, ValueError, IndexError):
                    pass
        found = set(self.exec_pids(machine))
        grew = True
        while grew:
            more = {p for p, pp in parents.items() if pp in found} - found
            grew = bool(more)
            found |= more
        return sorted(found)

    def agent_argvs(self, bottle: str) -> dict[int, list[bytes]]:
        """The argv of every live process in ``bottle``'s agent "VM" (by :meth:`guest_pids`)."""
        argvs = {pid: cmdline(pid) for pid in self.guest_pids(f"bn-{bottle}-agent")}
        return {pid: line.split(b"\0") for pid, line in argvs.items() if line}

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cleanup(self) -> list[int]:
        self.stop()
        survivors = self.fake.cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)
        return survivors


def ctl_env() -> dict[str, str]:
    return dict(ENV)


def run_in_pty(argv: Sequence[str]) -> tuple[int, int]:
    """Fork ``argv`` on a new pseudo-terminal: (pid, master fd)."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.chdir(REPO)
        os.execve(argv[0], list(argv), ENV)
    return pid, fd
