"""An in-process daemon (the tap's real service tree) against the fake smolvm, over AMP.

Everything here runs against ``tests/fakes/smolvm``, a TEST DOUBLE: no real smolvm, no VM.
The fake's ``exec`` runs commands on the host.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IAddress
from twisted.internet.task import deferLater
from twisted.logger import LogEvent, formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase

from bottlenet.bottles.model import Bottle, BottleVMs, TCPEndpoint
from bottlenet.bottles.recovery import RecoveryService
from bottlenet.bottles.registry import BottleRegistry
from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.bottles.store import StateStore
from bottlenet.control.client import ControlClient, connect_control
from bottlenet.control.context import ControlContext, UnixAdmission
from bottlenet.control.peercred import default_allowed_uids
from bottlenet.control.server import ControlServerFactory, ControlServerProtocol
from bottlenet.ops.listening import ListeningService
from bottlenet.probe.judge import ProbeResult
from bottlenet.probe.plan import IsolationMode
from bottlenet.tap import BottlenetService, Options, build_service, control_service
from tests import netguard
from tests.control.daemon_helpers import ENV as PROCESS_ENV
from tests.control.daemon_helpers import REPO
from tests.control.fakes import FakeBackend
from tests.fakes import FAKE_SMOLVM, FakeSmolvmMixin

GATE_STAND_INS = netguard.GATE_STAND_INS

SIDECAR_IMAGE = "registry.example/sidecar:1"


def spec_doc(
    tmp: str,
    *,
    mode: str = "socket",
    egress: bool = True,
    reload: tuple[str, ...] = ("/bin/true",),
    workload: tuple[str, ...] = (),
    listen: str | None = None,
    user: str | None = None,
    bridge: str | None = "none",
    services: tuple[tuple[str, int, list[str]], ...] = (
        ("egress", 3128, ["HTTPS_PROXY=http://{host}:{port}"]),
        ("git", 9418, ["GIT_GATE_URL=http://{host}:{port}/", "GIT_GATE_SOCKET={socket}"]),
    ),
) -> dict[str, Any]:
    """A bottle spec; the egress policy file is a host path (the fake execs on the host).

    ``bridge`` is ``none`` unless asked: with the fake's plain ``exec`` on the host, the
    bridge would bind host ports and find no mounted socket (tests/bottles/test_bridge_fake.py
    runs it under ``exec-netns``)."""
    sidecar: dict[str, Any] = {
        "image": SIDECAR_IMAGE,
        "service": [{"name": n, "guest_port": p, "env": env} for n, p, env in services],
    }
    if listen is not None:
        sidecar["listen"] = listen
    if egress:
        sidecar["egress"] = {
            "allow_hosts": ["pypi.org", "*.github.com"],
            "policy_path": os.path.join(tmp, "policy.txt"),
            "reload": list(reload),
        }
    image = os.path.join(tmp, "agent.tar")
    if not os.path.exists(image):  # smolvm reads a local archive at create
        with open(image, "wb") as f:
            f.write(b"\0" * 1024)
    agent: dict[str, Any] = {"image": image, "env": ["LANG=C.UTF-8"]}
    if workload:
        agent["workload"] = list(workload)
    if user is not None:
        agent["user"] = user
    if bridge is not None:
        agent["bridge"] = bridge
    return {"mode": mode, "sidecar": sidecar, "agent": agent}


def socket_bottle(tmp: str, name: str = "b1", **vms: Any) -> Bottle:
    """A socket-mode VM bottle value with one endpoint (``vms`` overrides BottleVMs fields)."""
    fields: dict[str, Any] = {
        "spec": parse_bottle_spec(name, spec_doc(tmp)),
        "mode": IsolationMode.SOCKET,
        "mechanism": "socket: x",
        "sidecar_vm": f"bn-{name}-sidecar",
        "agent_vm": f"bn-{name}-agent",
        "sidecar_pid": 123,
        "endpoints": (TCPEndpoint("egress", 3128, "/s/e.sock", "/run/bottle/e.sock", 40001),),
        "env": (("A", "b"),),
        "policy": ("pypi.org",),
        "probe_skipped": True,
        "probe": ProbeResult.SKIPPED,
    }
    fields.update(vms)
    return Bottle(name=name, alias=None, created_at=1.5, vms=BottleVMs(**fields))


def in_thread(f: Any, *args: Any) -> Deferred[Any]:
    """Blocking socket helpers run off the reactor thread (the relay needs the reactor)."""
    from twisted.internet.threads import deferToThread

    return deferToThread(f, *args)


def bottlenetctl(*args: str) -> Deferred[subprocess.CompletedProcess[bytes]]:
    """``bottlenetctl ARGS`` as a person runs it, in its own process (waited for off the
    reactor, which keeps serving the in-process daemon meanwhile)."""
    argv = [sys.executable, "-m", "bottlenet.cli", *args]
    return in_thread(
        lambda: subprocess.run(argv, env=PROCESS_ENV, cwd=REPO, capture_output=True, timeout=120)
    )


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


async def _settled(d: Deferred[Any]) -> None:
    """Wait until ``d`` has fired, whatever its outcome (``d`` keeps its result)."""
    done: Deferred[None] = Deferred()
    d.addBoth(lambda result: (done.callback(None), result)[1])
    await done


class DaemonCase(FakeSmolvmMixin, TestCase):
    """A fresh state dir, control socket and fake smolvm per test."""

    #: A hang detector, not a timing target: a test here starts a daemon (some two) and runs
    #: up to a dozen ``bottlenetctl`` processes, 5-10 s on a quiet machine; CI's run of main
    #: once passed 60 s in one of them.
    timeout = 120

    def setUp(self) -> None:
        self.setUpFake()
        self.tmp = tempfile.mkdtemp(prefix="bnb-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        # As root (per-VM uids) every VMM must pass through the state dir's parents; smolvm
        # opens them itself when its data dir is under the state dir, the fake's is not.
        os.chmod(self.tmp, 0o701)
        self.state_dir = os.path.join(self.tmp, "s")
        self.control = os.path.join(self.tmp, "c.sock")
        self.root: BottlenetService | None = None
        self.clients: list[ControlClient] = []
        self.logged: list[LogEvent] = []
        self._log_waits: list[tuple[str, Deferred[None]]] = []
        globalLogPublisher.addObserver(self._observe)
        self.addCleanup(globalLogPublisher.removeObserver, self._observe)

    def _observe(self, event: LogEvent) -> None:
        self.logged.append(event)
        text = formatEvent(event)
        waits, self._log_waits = self._log_waits, []
        for needle, d in waits:
            if needle in text:  # fired on the next turn: no test code runs inside an observer
                reactor.callLater(0, d.callback, None)
            else:
                self._log_waits.append((needle, d))

    def log_text(self) -> str:
        """Every line logged since setUp (what the daemon process would have written)."""
        return "\n".join(formatEvent(e) for e in self.logged)

    def when_logged(self, needle: str) -> Deferred[None]:
        """Fires when a line containing ``needle`` is logged (at once if one already was)."""
        if needle in self.log_text():
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._log_waits.append((needle, d))
        return d

    def failures_logged(self) -> list[str]:
        """Logged failures (a daemon process would have printed a Traceback for each)."""
        return [formatEvent(e) for e in self.logged if "log_failure" in e]

    async def start(self, *extra: str, vm_bottles: bool = True) -> ControlClient:
        """Start the daemon in process. ``vm_bottles=False``: the test creates no VM bottle, so
        the launch gate never probes and the netguard is not needed."""
        gated = vm_bottles and "--unsafe-skip-isolation-probe" not in extra
        if gated and not netguard.active():
            # With the fake, the gate's probe runs on the host: only the suite's own network
            # namespace keeps its outside and DNS checks from leaving the machine.
            self.skipTest("the launch gate with the fake smolvm needs the netguard (root)")
        # The environment a daemon process gets (tests/control/daemon_helpers.py): this
        # interpreter's directory first on PATH, so the fake smolvm's ``env python3`` is this
        # Python, not a version manager's shim script (~150 ms a call). The daemon copies
        # its environment when it is built; the test's own is restored after.
        self._use_path(PROCESS_ENV["PATH"])
        options = Options()
        options.parseOptions(
            [
                *GATE_STAND_INS,
                "--state-dir",
                self.state_dir,
                "--control",
                f"unix:{self.control}",
                "--smolvm",
                FAKE_SMOLVM,
                "--smolvm-data-dir",
                self.fake.path,
                "--uid-ledger",
                self.fake.uid_ledger,
                *extra,
            ]
        )
        root = build_service(options, reactor)
        root.startService()
        self.root = root
        self.addCleanup(self.stop)
        # Wait for the events (recovery done, its state saved; the control socket
        # listening), not for a guessed time: a 4 s poll ran out on a loaded machine.
        # Recovery may tear bottles down and fail; its outcome is the test's to check.
        for svc in root:
            if isinstance(svc, RecoveryService):
                await _settled(svc.ready)
            elif isinstance(svc, ListeningService):
                await svc.when_listening()
        client = await connect_control(reactor, self.control, timeout=30)
        self.clients.append(client)
        return client

    def _use_path(self, path: str) -> None:
        saved = os.environ.get("PATH")
        if saved == path:
            return
        os.environ["PATH"] = path

        def restore() -> None:
            if saved is None:
                os.environ.pop("PATH", None)
            else:
                os.environ["PATH"] = saved

        self.addCleanup(restore)

    async def stop(self) -> None:
        for c in self.clients:
            c.close()
        self.clients = []
        root, self.root = self.root, None
        if root is not None and root.running:
            await root.stopService()

    def ctl_argv(self, *args: str) -> list[str]:
        """``bottlenetctl --control C ARGS``'s argv (for a test that runs it itself)."""
        return [sys.executable, "-m", "bottlenet.cli", "--control", self.control, *args]

    def ctl(self, *args: str) -> Deferred[subprocess.CompletedProcess[bytes]]:
        """``bottlenetctl --control C ARGS`` in its own process."""
        return bottlenetctl("--control", self.control, *args)

    async def create_vm_bottle(
        self, name: str = "b1", workload: Sequence[str] = (), user: str | None = None
    ) -> dict[str, Any]:
        """``bottlenetctl --json bottle create NAME --spec FILE.toml`` for a socket-mode VM
        bottle with one sidecar service (and a workload, as ``user``, if given): its record."""
        from tests.control.vmdaemon import SPEC_TOML

        image = os.path.join(self.tmp, "agent.tar")
        if not os.path.exists(image):
            open(image, "wb").close()
        spec = os.path.join(self.tmp, f"{name}.toml")
        with open(spec, "w") as f:
            f.write(SPEC_TOML.format(image=image))
            if workload:
                f.write(f"workload = {json.dumps(list(workload))}\n")
            if user is not None:
                f.write(f"user = {json.dumps(user)}\n")
        r = await self.ctl("--json", "bottle", "create", name, "--spec", spec)
        assert r.returncode == 0, (r.stdout, r.stderr, self.log_text())
        record: dict[str, Any] = json.loads(r.stdout)
        return record

    @property
    def registry(self) -> BottleRegistry:
        assert self.root is not None
        return self.root.registry

    def spec_json(self, **kw: Any) -> str:
        return json.dumps(spec_doc(self.tmp, **kw))

    def state_file(self) -> dict[str, Any]:
        # The stored state as a restarted daemon would see it (snapshot + journal).
        return StateStore(self.state_dir).load().to_json()

    def machines(self) -> dict[str, Any]:
        machines: dict[str, Any] = self.fake.state()["machines"]
        return machines


class _TrackingFactory(ControlServerFactory):
    """The daemon's control factory, remembering its connections (a test can drop them all)."""

    built: list[ControlServerProtocol]

    def buildProtocol(self, addr: IAddress | None) -> ControlServerProtocol | None:
        proto = super().buildProtocol(addr)
        if proto is not None:
            self.built.append(proto)
        return proto


class ControlSocketCase(TestCase):
    """The daemon's own control listener and server factory in process, over ``FakeBackend``:
    for tests of a client (``bottlenetctl``) that need a daemon to answer, not bottles."""

    timeout = 60

    def setUp(self) -> None:
        d = tempfile.mkdtemp(prefix="bcs-", dir="/tmp")
        self.addCleanup(shutil.rmtree, d, True)
        self.path = os.path.join(d, "control.sock")
        self.backend = FakeBackend()
        self.listener: ListeningService | None = None
        self.addCleanup(self.go_away)

    async def serve(self) -> None:
        """Listen on ``self.path`` (again, after :meth:`go_away`) and wait until it does."""
        backend: Any = self.backend
        factory = _TrackingFactory(
            ControlContext(backend=backend, server_version="0.1.0", clock=reactor),
            UnixAdmission(default_allowed_uids()),
        )
        factory.built = []
        self._factory = factory
        self.listener = control_service(reactor, f"unix:{self.path}", factory, self.fail)
        self.listener.startService()
        await self.listener.when_listening()

    async def go_away(self) -> None:
        """What a daemon's exit does to its clients: no listener, every connection dropped."""
        listener, self.listener = self.listener, None
        if listener is None:
            return
        stopped = listener.stopService()
        if stopped is not None:
            await stopped
        for proto in self._factory.built:
            transport: Any = proto.transport
            if transport is not None:
                transport.abortConnection()
