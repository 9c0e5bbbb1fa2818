"""One scenario's state file and event stream, byte for byte, against a capture (a guard).

The scenario runs every path that writes a bottle's record or emits its event: a forward-only
bottle with forwards added and removed, VM bottles created (one with a workload), a workload
exit, a sidecar that dies (degraded), a teardown that fails and one that succeeds, a destroy,
and a restart that restores what is left. After each step the test takes the state file's
bytes (snapshot and journal) and every event since the last step. The capture in
``golden/scenario.json`` was made on the tree before the bottle owner moved the registry's
work onto each bottle (issue 29): a refactor may move code, not change these bytes.

Values that differ per run (the temp dir, bound ports, the clock of the host) are replaced
by stable names before the comparison; everything else is compared as written.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import zlib
from collections.abc import Callable
from typing import Any

import attrs
from attrs import define, field
from twisted.internet.defer import succeed
from twisted.internet.error import ProcessDone
from twisted.internet.interfaces import IProcessProtocol
from twisted.python.failure import Failure

from bottlenet.bottles.bottle import VMBottle
from bottlenet.bottles.events import BottleEvent
from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.bottles.store import State, StateStore
from bottlenet.errors import BottlenetError
from bottlenet.forward.spec import parse_target
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import MemorySmolvm, Rig
from vmctl.errors import SmolvmFailed

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "scenario.json")
#: Set to write the capture instead of comparing (only on the tree the capture stands for).
WRITE = os.environ.get("BOTTLENET_WRITE_GOLDEN") == "1"

Rigs = Callable[..., Rig]
INSTANCE = "golden0000000000"


class _Transport:
    """The attached exec's transport as the waiter sees it (signals are recorded)."""

    def __init__(self) -> None:
        self.signals: list[str] = []

    def signalProcess(self, sig: str) -> None:
        self.signals.append(sig)


@define
class WaitingSmolvm(MemorySmolvm):
    """The in-memory smolvm with attached execs: the test ends them (a workload waiter)."""

    attached: list[tuple[str, list[str], IProcessProtocol]] = field(factory=list)

    def spawn_exec(self, name: str, argv: list[str], protocol: IProcessProtocol, **kw: Any) -> Any:
        self.calls.append(("spawn_exec", name))
        self.attached.append((name, list(argv), protocol))
        protocol.makeConnection(_Transport())  # type: ignore[arg-type]
        return succeed(protocol)

    def end(self, machine: str, output: bytes) -> None:
        """The attached exec in ``machine`` prints ``output`` and exits 0."""
        for name, _argv, protocol in list(self.attached):
            if name == machine:
                self.attached.remove((name, _argv, protocol))
                protocol.childDataReceived(1, output)
                protocol.processEnded(Failure(ProcessDone(0)))
                return
        raise AssertionError(f"no attached exec in {machine}")


class Capture:
    """The state file's bytes and the events, step by step, with per-run values named."""

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.steps: list[dict[str, Any]] = []
        self.events: list[BottleEvent] = []
        self.ports: dict[str, str] = {}

    def listen(self, rig: Rig) -> None:
        rig.registry.events.subscribe(self.events.append)

    def _name_ports(self, text: str) -> str:
        def name(m: re.Match[str]) -> str:
            port = m.group(2)
            if port not in self.ports:
                self.ports[port] = f"<port{len(self.ports)}>"
            return m.group(1) + self.ports[port]

        # every TCP port a listener or a sidecar bound: they differ per run
        text = re.sub(r'((?:"port"|"raw_port"|"host_port"):\s*|[0-9]:)(\d{4,5})\b', name, text)
        # the in-memory smolvm's VMs run as this test's pid
        return re.sub(r'("sidecar_pid":\s*)\d+', r"\1<pid>", text)

    def normal(self, raw: str) -> str:
        return self._name_ports(raw.replace(self.tmp, "<tmp>"))

    def step(self, rig: Rig, what: str) -> None:
        files = {}
        for fname in sorted(os.listdir(rig.state_dir)):
            path = os.path.join(rig.state_dir, fname)
            if os.path.isfile(path) and fname.startswith("state"):
                with open(path, "rb") as f:
                    files[fname] = self.normal(_framed(f.read()).decode())
        events = [self.normal(json.dumps(attrs.asdict(e), sort_keys=True)) for e in self.events]
        self.events.clear()
        self.steps.append({"step": what, "files": files, "events": events})


def _framed(raw: bytes) -> bytes:
    """A journal's lines with each frame (length and CRC of the JSON) checked, then named:
    the JSON holds ports that differ per run, the frame follows from the JSON."""
    if not raw.startswith(b"{"):  # the snapshot is plain JSON
        lines = []
        for line in raw.splitlines():
            length, crc, body = line.split(b" ", 2)
            assert int(length) == len(body) and int(crc, 16) == zlib.crc32(body), line
            lines.append(b"<frame> " + body + b"\n")
        raw = b"".join(lines)
    return raw


def _spec(tmp: str, name: str, **kw: Any) -> Any:
    kw.setdefault("mode", "socket")
    kw.setdefault("listen", "tcp")
    return parse_bottle_spec(name, spec_doc(tmp, **kw))


def _error(rig: Rig, coro: Any) -> str:
    try:
        rig.run(coro)
    except BottlenetError as e:
        return f"{e.code}: {e.message}"
    raise AssertionError("the step was meant to fail")


def run_scenario(rigs: Rigs, tmp: str) -> list[dict[str, Any]]:
    """Every step of the scenario, captured."""
    cap = Capture(tmp)
    os.makedirs(os.path.join(tmp, "s"), mode=0o700)
    StateStore(os.path.join(tmp, "s")).save(State(INSTANCE, {}))
    rig = rigs(smolvm=WaitingSmolvm(), instance_id=INSTANCE)
    cap.listen(rig)
    reg = rig.registry
    alias = ipaddress.IPv4Address("127.79.0.7")
    rig.run(reg.create_bottle("plain", alias))
    cap.step(rig, "create forward-only")
    rig.run(reg.add_forward("plain", "web", parse_target("127.0.0.1:9")))
    rig.run(reg.add_forward("plain", "db", parse_target("127.0.0.1:7")))
    cap.step(rig, "add two forwards")
    rig.run(reg.remove_forward("plain", "db"))
    cap.step(rig, "remove a forward")
    rig.clock.advance(10)
    rig.run(reg.create_bottle("w1", spec=_spec(tmp, "w1", workload=("/agent", "run"))))
    cap.step(rig, "create a VM bottle with a workload")
    rig.clock.advance(10)
    rig.run(reg.create_bottle("v2", spec=_spec(tmp, "v2")))
    rig.run(reg.create_bottle("v3", spec=_spec(tmp, "v3")))
    cap.step(rig, "create two VM bottles")
    rig.clock.advance(1)
    rig.smolvm.end("bn-w1-agent", b"3\n")
    rig.settle()
    cap.step(rig, "the workload exits")
    rig.clock.advance(1)
    rig.registry.owner("v2", VMBottle).sidecar_exited()
    rig.settle()
    cap.step(rig, "the sidecar dies")
    rig.clock.advance(1)
    rig.smolvm.fail_on("delete", "bn-v3-agent", SmolvmFailed("delete failed"))
    failed = _error(rig, reg.destroy_bottle("v3"))
    cap.step(rig, f"a teardown fails: {failed}")
    rig.smolvm.faults.clear()
    rig.close()
    again = rigs(smolvm=rig.smolvm, instance_id=INSTANCE)
    again.clock.advance(100)
    cap.listen(again)
    again.recover()
    cap.step(again, "restart and restore")
    for name in [b.name for b in again.registry.list_bottles()]:
        again.run(again.registry.destroy_bottle(name))
    cap.step(again, "destroy after the restart")
    return cap.steps


def test_state_file_and_events_match_the_capture(rigs: Rigs, tmp: str) -> None:
    """The scenario writes the same state-file bytes and emits the same events as captured."""
    steps = run_scenario(rigs, tmp)
    if WRITE:
        os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
        with open(GOLDEN, "w", encoding="utf-8") as f:
            json.dump(steps, f, indent=1, sort_keys=True)
            f.write("\n")
    with open(GOLDEN, encoding="utf-8") as f:
        golden = json.load(f)
    assert [s["step"] for s in steps] == [s["step"] for s in golden]
    for got, want in zip(steps, golden, strict=True):
        assert got == want, got["step"]
