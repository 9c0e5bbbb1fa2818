"""The real daemon process (``python -m twisted bottlenet``) against the fake smolvm.

kill -9 and restart must restore every live bottle's listeners on the same addresses and
ports and leave no orphan (and a clean stop keeps the VMs); SIGTERM in the middle of a create
must leave no half bottle once the daemon has restarted. ``bottlenetctl``'s output needs no
daemon process: its ``main`` runs against the daemon in process (``DaemonCase``). The
restart's rules (what recovery keeps, tears down, re-checks) are ``test_recovery.py``'s and
``test_policy_and_limits.py``'s. The fake smolvm is a test double (no VM, no KVM).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bottlenet.bottles.store import StateStore
from bottlenet.cli.main import main
from bottlenet.control.blocking import BlockingControlClient
from tests.bottles.harness import DaemonCase, in_thread, spec_doc
from tests.fakes import FAKE_SMOLVM, FakeSmolvm
from tests.netguard import GATE_STAND_INS
from tests.netio import ping_tcp, ping_unix

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Daemon:
    def __init__(self, tmp: str, fake: FakeSmolvm) -> None:
        self.tmp = tmp
        self.fake = fake
        self.state = os.path.join(tmp, "s")
        self.control = os.path.join(tmp, "c.sock")
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def start(self, *extra: str) -> subprocess.Popen[bytes]:
        self.runs += 1
        log = open(os.path.join(self.tmp, f"daemon-{self.runs}.log"), "wb")
        env = {**os.environ, "PYTHONPATH": REPO}
        env.pop("XDG_RUNTIME_DIR", None)
        argv = [sys.executable, "-m", "twisted", "--log-format=text", "bottlenet"]
        argv += ["--state-dir", self.state, "--control", f"unix:{self.control}", *GATE_STAND_INS]
        argv += ["--smolvm", FAKE_SMOLVM, "--smolvm-data-dir", self.fake.path]
        argv += ["--uid-ledger", self.fake.uid_ledger, *extra]
        self.proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self.proc

    def log(self) -> str:
        with open(os.path.join(self.tmp, f"daemon-{self.runs}.log"), errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}: {self.log()}")
            try:
                with self.client() as c:
                    c.ping()
                return
            except Exception:
                time.sleep(0.05)
        raise AssertionError("daemon never answered:\n" + self.log())

    def client(self, timeout: float = 30) -> BlockingControlClient:
        return BlockingControlClient(self.control, timeout=timeout)

    def kill(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(30)

    def state_file(self) -> dict[str, Any]:
        # The stored state as a restarted daemon would see it (snapshot + journal).
        return StateStore(self.state).load().to_json()


@pytest.fixture
def daemon(fake_smolvm: FakeSmolvm) -> Iterator[Daemon]:
    tmp = tempfile.mkdtemp(prefix="bnr-", dir="/tmp")
    d = Daemon(tmp, fake_smolvm)
    yield d
    if d.proc is not None and d.proc.poll() is None:
        d.proc.kill()
        d.proc.wait(10)
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def fake_smolvm() -> Iterator[FakeSmolvm]:
    # short: smolvm binds sockets below its state dir (vmctl.smolvm.MAX_STATE_DIR)
    fake = FakeSmolvm(tempfile.mkdtemp(prefix="bnf-", dir="/tmp"))
    yield fake
    survivors = fake.cleanup()
    shutil.rmtree(fake.path, ignore_errors=True)
    assert survivors == []


def test_kill9_restart_restores_listeners_on_same_ports(daemon: Daemon) -> None:
    """kill -9, restart: every listener answers on its old address, no orphan, VMs kept."""
    daemon.start("--unsafe-skip-isolation-probe")
    daemon.wait_ready()
    with daemon.client() as c:
        # v1's sidecar serves raw TCP (the opt-in), v2's exposed UNIX sockets (the default)
        v1 = c.create_bottle("v1", spec=json.dumps(spec_doc(daemon.tmp, listen="tcp")))
        v2 = c.create_bottle("v2", spec=json.dumps(spec_doc(daemon.tmp, egress=False)))
        c.create_bottle("plain", alias="127.77.0.7")
        raw = daemon.state_file()["bottles"]["v1"]["endpoints"][0]["raw_port"]
        fwd = c.add_forward("plain", "web", f"127.0.0.1:{raw}")
    sockets = [e.host_path for b in (v1, v2) for e in b.endpoints]
    assert all(p is not None and ping_unix(p) == b"ping" for p in sockets)
    assert fwd.port is not None and ping_tcp("127.77.0.7", fwd.port) == b"ping"
    machines = sorted(daemon.fake.state()["machines"])
    pids = sorted(daemon.fake.live_pids())
    assert len(pids) == 4

    daemon.kill(signal.SIGKILL)
    started = time.monotonic()
    daemon.start("--unsafe-skip-isolation-probe")
    pending = {("unix", p) for p in sockets} | {("tcp", fwd.port)}
    # Restored as soon as every endpoint answers; the 60 s bound only stops a hang. How fast
    # a restart restores is a benchmark figure, not an assertion (a loaded machine took 6 s).
    while pending and time.monotonic() - started < 60:
        for kind, where in list(pending):
            try:
                ok = (
                    ping_unix(where, timeout=2)
                    if kind == "unix"
                    else ping_tcp("127.77.0.7", where, timeout=2)
                )
            except OSError:
                continue
            if ok == b"ping":
                pending.discard((kind, where))
        time.sleep(0.02)
    assert not pending, daemon.log()
    daemon.wait_ready()
    with daemon.client() as c:
        again = c.bottle_status("v1")
        assert [e.endpoint for e in again.endpoints] == [e.endpoint for e in v1.endpoints]
        assert [f.endpoint for f in c.all_forwards("plain")] == [fwd.forward.endpoint]
    # no orphan: the same machines and VM processes, nothing more
    assert sorted(daemon.fake.state()["machines"]) == machines
    assert sorted(daemon.fake.live_pids()) == pids
    daemon.kill(signal.SIGTERM)
    assert sorted(daemon.fake.live_pids()) == pids  # the VMs outlive a clean stop too


def test_sigterm_during_create_leaves_no_half_bottle(daemon: Daemon) -> None:
    """SIGTERM mid-create: a clean stop, the create fails; the restart leaves no half bottle."""
    daemon.fake.set_faults("slow-start", slow_start=1.0)
    daemon.start("--unsafe-skip-isolation-probe")
    daemon.wait_ready()
    errors: list[BaseException] = []

    def create() -> None:
        try:
            with daemon.client() as c:
                c.create_bottle("half", spec=json.dumps(spec_doc(daemon.tmp)))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=create)
    t.start()
    # The create is in flight once the sidecar's VM process exists: its start waits out the
    # fake's slow start (the daemon's stop waits for it), and the agent's start would too.
    deadline = time.monotonic() + 30
    while not daemon.fake.live_pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert daemon.fake.live_pids(), daemon.log()
    daemon.kill(signal.SIGTERM)
    t.join(30)
    assert errors, "the create cannot have succeeded"
    assert daemon.proc is not None and daemon.proc.returncode is not None
    assert "Main loop terminated" in daemon.log()  # a clean stop, not a crash

    daemon.fake.set_faults()
    daemon.start("--unsafe-skip-isolation-probe")
    daemon.wait_ready()
    # Recovery deletes the orphan machine, then the unclaimed directory: wait for both (the
    # directory went after the machines, and a loaded host showed that window).
    half = os.path.join(daemon.state, "bottles", "half")
    deadline = time.monotonic() + 30
    while (daemon.fake.state()["machines"] or os.path.exists(half)) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert daemon.fake.state()["machines"] == {}, daemon.log()
    assert daemon.fake.live_pids() == []
    assert daemon.state_file()["bottles"] == {}
    assert not os.path.exists(half), daemon.log()
    with daemon.client() as c:
        assert c.list_bottles().total == 0
    assert "deleting orphan machine" in daemon.log()
    daemon.kill(signal.SIGTERM)


class CtlTests(DaemonCase):
    async def test_bottlenetctl_spec_egress_verify(self) -> None:
        """bottlenetctl's own output (its ``main`` in a thread, the daemon in process): create
        prints the stamped env, the mount flags and a warning; egress set writes the policy
        file; status shows it; verify exits 1 naming the failed check; rm leaves no machine."""
        toml = os.path.join(self.tmp, "t1.toml")
        with open(toml, "w") as f:
            f.write(
                f"""mode = "socket"
[sidecar]
image = "registry.example/sidecar:1"
[[sidecar.service]]
name = "egress"
guest_port = 3128
env = ["HTTPS_PROXY=http://{{host}}:{{port}}"]
[sidecar.egress]
allow_hosts = ["pypi.org"]
policy_path = "{self.tmp}/policy.txt"
reload = ["/bin/true"]
[agent]
image = "{self.tmp}/agent.tar"
bridge = "none"  # the plain fake execs on the host: no mounted socket for a bridge there
"""
            )
        with open(os.path.join(self.tmp, "agent.tar"), "wb") as f:
            f.write(b"\0" * 1024)
        await self.start("--unsafe-skip-isolation-probe")
        base = ["--control", self.control, "--timeout", "60"]

        def run(args: tuple[str, ...]) -> tuple[int, str, str]:
            out, err = io.StringIO(), io.StringIO()
            code = main([*base, *args], env={}, out=out, err=err)
            return code, out.getvalue(), err.getvalue()

        async def ctl(*args: str) -> tuple[int, str, str]:
            result: tuple[int, str, str] = await in_thread(run, args)
            return result

        code, out, err = await ctl("bottle", "create", "t1", "--spec", toml)
        assert code == 0, err
        assert "HTTPS_PROXY" in out and "--mount-socket" in out and "WARNING" in out
        assert (await ctl("egress", "set", "t1", "example.org", "*.pypi.org"))[0] == 0
        with open(os.path.join(self.tmp, "policy.txt")) as f:
            assert f.read() == "example.org\n*.pypi.org\n"
        code, out, err = await ctl("--json", "bottle", "status", "t1")
        assert json.loads(out)["bottle"]["policy"] == ["example.org", "*.pypi.org"]
        code, out, err = await ctl("bottle", "verify", "t1")  # the plain fake isolates nothing
        assert code == 1 and "ISOLATION_FAILED" in err and "own endpoint" in err
        assert (await ctl("bottle", "rm", "t1"))[0] == 0
        assert self.machines() == {}
