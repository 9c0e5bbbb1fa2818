"""An in-process daemon (the tap's real service tree) against the fake smolvm, over AMP.

Everything here runs against ``tests/fakes/smolvm``, a TEST DOUBLE: no real smolvm, no VM.
The fake's ``exec`` runs commands on the host.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from bottlenet.bottles.model import Bottle, BottleVMs, TCPEndpoint
from bottlenet.bottles.recovery import RecoveryService
from bottlenet.bottles.registry import BottleRegistry
from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.bottles.store import StateStore
from bottlenet.control.client import ControlClient, connect_control
from bottlenet.ops.listening import ListeningService
from bottlenet.probe.judge import ProbeResult
from bottlenet.probe.plan import IsolationMode
from bottlenet.tap import BottlenetService, Options, build_service
from tests import netguard
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


def sleep(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


async def _settled(d: Deferred[Any]) -> None:
    """Wait until ``d`` has fired, whatever its outcome (``d`` keeps its result)."""
    done: Deferred[None] = Deferred()
    d.addBoth(lambda result: (done.callback(None), result)[1])
    await done


class DaemonCase(FakeSmolvmMixin, TestCase):
    """A fresh state dir, control socket and fake smolvm per test."""

    timeout = 60

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

    async def start(self, *extra: str) -> ControlClient:
        if "--unsafe-skip-isolation-probe" not in extra and not netguard.active():
            # With the fake, the gate's probe runs on the host: only the suite's own network
            # namespace keeps its outside and DNS checks from leaving the machine.
            self.skipTest("the launch gate with the fake smolvm needs the netguard (root)")
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

    async def stop(self) -> None:
        for c in self.clients:
            c.close()
        self.clients = []
        root, self.root = self.root, None
        if root is not None and root.running:
            await root.stopService()

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
