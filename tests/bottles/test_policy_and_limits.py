"""SetEgressPolicy, BUSY, --max-bottles and a restart's port re-check, in process (unit seam).

These ran through an in-process daemon and the fake smolvm executable (12 s); they are rules of
the control server, the registry, the egress push and recovery, so the daemon's own control
server answers AMP boxes over a rig's registry on a clock (``tests/bottles/wire.py``) with the
in-memory smolvm (a TEST DOUBLE) whose sidecar keeps its policy file as the image contract says
(docs/sidecar.md). The process-level proofs stay in ``test_daemon_restart.py``: a kill -9
restart (bytes through the restored listeners, no orphan) and ``bottlenetctl egress set``.
The rest of a restart's rules are ``test_recovery.py``'s.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
from collections.abc import Callable, Iterator, Sequence

import pytest
from twisted.logger import capturedLogs

from bottlenet.bottles.egress import WRITE_ARGV
from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.bottles.states import Lifecycle
from bottlenet.bottles.store import State, StateStore
from bottlenet.control import calls
from bottlenet.errors import (
    AlreadyExists,
    BottlenetError,
    Busy,
    InvalidArgument,
    ResourceExhausted,
)
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import MemorySmolvm, Rig, exits
from tests.bottles.wire import Wire
from vmctl.ports import check_port_owner
from vmctl.smolvm import ExecResult

Rigs = Callable[..., Rig]


class Sidecar:
    """The sidecar image's side of the egress contract: the write puts stdin at the policy
    path (a host path here), the reload exits 0 unless the test says it fails."""

    def __init__(self) -> None:
        self.reload_ok = True

    def __call__(self, name: str, argv: Sequence[str], stdin: bytes | None) -> ExecResult | None:
        if list(argv[: len(WRITE_ARGV)]) == WRITE_ARGV:
            with open(argv[len(WRITE_ARGV)], "wb") as f:
                f.write(stdin or b"")
            return exits(0)
        if list(argv) == ["/bin/true"]:  # spec_doc's reload
            return exits(0 if self.reload_ok else 1)
        return None


@pytest.fixture
def wired(rigs: Rigs) -> Iterator[Callable[..., Wire]]:
    made: list[Wire] = []

    def make(**kw: object) -> Wire:
        made.append(Wire(rigs(**kw)))
        return made[-1]

    yield make
    for wire in made:
        wire.close()


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_set_policy_then_failed_reload_keeps_previous(wired: Callable[..., Wire], tmp: str) -> None:
    """A policy is normalised (IDNA), written and reloaded; a failed reload is SMOLVM_FAILED and
    keeps the previous one (record, state file, the sidecar's file); bad lists are refused."""
    wire = wired()
    sidecar = Sidecar()
    wire.rig.smolvm.on_exec = sidecar
    wire(calls.create_bottle("e1", spec=json.dumps(spec_doc(tmp))))
    policy = os.path.join(tmp, "policy.txt")

    hosts = wire(calls.set_egress_policy("e1", ["example.org", "*.pypi.org", "bücher.de"]))
    assert hosts == ("example.org", "*.pypi.org", "xn--bcher-kva.de")
    assert read(policy) == "example.org\n*.pypi.org\nxn--bcher-kva.de\n"
    assert wire(calls.bottle_status("e1")).policy == hosts

    sidecar.reload_ok = False  # the sidecar's reload now fails
    with pytest.raises(BottlenetError) as cm:
        wire(calls.set_egress_policy("e1", ["evil.example"]))
    assert cm.value.code == "SMOLVM_FAILED" and "reload" in str(cm.value)
    assert wire(calls.bottle_status("e1")).policy == hosts
    assert wire.rig.state()["e1"]["policy"] == list(hosts)
    assert read(policy) == "example.org\n*.pypi.org\nxn--bcher-kva.de\n"  # put back

    for bad in (["UPPER.example"], ["1.2.3.4"], ["a" * 300], ["x.example"] * 2 + [""]):
        with pytest.raises(InvalidArgument):
            wire(calls.set_egress_policy("e1", bad))
    with pytest.raises(InvalidArgument):
        wire(calls.set_egress_policy("e1", [f"h{i}.example" for i in range(257)]))


def test_policy_needs_a_vm_bottle(wired: Callable[..., Wire]) -> None:
    """A forward-only bottle has no sidecar: SetEgressPolicy and VerifyBottle are refused."""
    wire = wired()
    wire(calls.create_bottle("plain"))
    with pytest.raises(InvalidArgument):
        wire(calls.set_egress_policy("plain", ["example.org"]))
    with pytest.raises(InvalidArgument):
        wire(calls.verify_bottle("plain"))


def test_busy_and_max_bottles(wired: Callable[..., Wire], tmp: str) -> None:
    """While a create runs, a second operation on its name is BUSY; every bottle counts
    against the limit (RESOURCE_EXHAUSTED); the finished name is ALREADY_EXISTS."""
    wire = wired(max_bottles=2)
    rig = wire.rig
    gate = rig.smolvm.hold("start", "bn-m1-sidecar")
    first = calls.create_bottle("m1", spec=json.dumps(spec_doc(tmp)))
    tag = wire.send(first)
    assert not wire.answered(tag) and rig.registry.state_of("m1") is Lifecycle.CREATING
    with pytest.raises(Busy):
        wire(calls.destroy_bottle("m1"))
    with pytest.raises(Busy):
        wire(calls.create_bottle("m1"))
    wire(calls.create_bottle("m2"))  # forward-only counts too
    with pytest.raises(ResourceExhausted):
        wire(calls.create_bottle("m3"))
    gate.callback(None)
    assert wire.answer(tag, first).state == "ready"
    with pytest.raises(AlreadyExists) as cm:
        wire(calls.create_bottle("m1"))
    assert cm.value.code == "ALREADY_EXISTS"
    wire(calls.destroy_bottle("m1"))
    wire(calls.create_bottle("m3"))


@pytest.fixture
def vmm() -> Iterator[int]:
    """A live process standing in for the sidecar's VMM: it holds no socket."""
    child = subprocess.Popen(["sleep", "600"])
    yield child.pid
    child.kill()
    child.wait()


def test_restart_tears_down_bottle_whose_raw_port_someone_else_holds(
    rigs: Rigs, tmp: str, vmm: int
) -> None:
    """docs/bottles.md recovery step 3: a raw port is trusted again only if the sidecar's VM
    process still owns it; a squatter holds the port the state file names, so the bottle is
    torn down (never re-bound to relay into the squatter) and the log says why, once."""
    first = rigs(smolvm=MemorySmolvm(pid=vmm))
    doc = spec_doc(tmp, mode="socket", listen="tcp")  # raw ports: the TCP opt-in
    first.run(first.registry.create_bottle("q1", spec=parse_bottle_spec("q1", doc)))
    first.close()
    squatter = socket.create_server(("127.0.0.1", 0))
    try:
        # Edit the stored state as a whole (snapshot + journal), written back as a snapshot.
        store = StateStore(first.state_dir)
        state = store.load()
        bottles = copy.deepcopy(dict(state.bottles))
        record = bottles["q1"]
        endpoints = record["vm"]["endpoints"] if "vm" in record else record["endpoints"]
        endpoints[0]["raw_port"] = squatter.getsockname()[1]
        store.save(State(state.instance_id, bottles))
        store.close()
        rig = rigs(smolvm=first.smolvm)
        rig.use(check_port=check_port_owner)  # the daemon's own check
        with capturedLogs() as events:
            rig.recover()
    finally:
        squatter.close()
    assert rig.registry.list_bottles() == [] and rig.smolvm.machines == {}
    why = [e for e in events if "torn down at recovery" in e.get("log_format", "")]
    assert len(why) == 1
    assert "no longer held by its sidecar (foreign)" in why[0]["why"]
