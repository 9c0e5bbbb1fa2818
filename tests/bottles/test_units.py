"""Pure pieces of VM bottles: mode decision, probe verdicts, names, env, records, watch, CLI."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
from twisted.internet.task import Clock

from bottlenet.bottles import states
from bottlenet.bottles.agentenv import stamp_env
from bottlenet.bottles.bottle import VMBottle
from bottlenet.bottles.events import DEGRADED, WORKLOAD_EXITED
from bottlenet.bottles.isolation import ALIAS_UNAVAILABLE, MECH_SOCKET, choose_isolation
from bottlenet.bottles.model import (
    Bottle,
    BottleState,
    SocketEndpoint,
    TCPEndpoint,
    endpoint_from_json,
    machine_name,
)
from bottlenet.bottles.probe import GateSettings, plan_gate
from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.bottles.states import Lifecycle
from bottlenet.bottles.store import StateError
from bottlenet.bottles.watch import PidWatcher, pid_alive
from bottlenet.bottles.workload import WorkloadState
from bottlenet.cli.main import main
from bottlenet.errors import Busy, IsolationUnavailable, SmolvmFailed
from bottlenet.probe.judge import ProbeResult
from bottlenet.probe.plan import IsolationMode
from tests.bottles.harness import socket_bottle, spec_doc
from tests.bottles.memsmolvm import Rig
from vmctl.errors import SmolvmFailed as VmSmolvmFailed
from vmctl.smolvm import SmolvmVersion
from vmctl.spec import Volume, validate_name


def v(text: str) -> SmolvmVersion:
    return SmolvmVersion.parse(f"smolvm {text}\n".encode())


@pytest.mark.parametrize(
    ("requested", "local", "expected"),
    [
        ("socket", True, MECH_SOCKET),
        ("auto", True, MECH_SOCKET),
        ("auto", False, None),  # registry image: no socket mode, and alias cannot be enforced
        ("alias", True, None),  # fails closed whatever the image
        ("alias", False, None),
    ],
)
def test_choose_isolation(requested: str, local: bool, expected: str | None) -> None:
    def choose() -> str:
        return choose_isolation(requested, v("1.32.2"), "linux", local_agent_image=local).mechanism

    if expected is None:
        with pytest.raises(IsolationUnavailable):
            choose()
    else:
        assert choose() == expected


def test_alias_mode_fails_closed_and_says_why() -> None:
    with pytest.raises(IsolationUnavailable) as info:
        choose_isolation("alias", v("1.32.2"), "linux", local_agent_image=True)
    assert info.value.message == ALIAS_UNAVAILABLE
    for why in ("TSI", "loopback", "127.0.0.1", "socket"):
        assert why in info.value.message


def test_platform() -> None:
    with pytest.raises(IsolationUnavailable, match="socket mode needs"):
        choose_isolation("socket", v("1.32.2"), "freebsd", local_agent_image=True)
    plan = choose_isolation("socket", v("1.32.2"), "darwin", local_agent_image=True)
    assert "--mount-socket" in plan.describe()


def test_machine_names_follow_smolvm_rules() -> None:
    assert machine_name("web1", "sidecar") == "bn-web1-sidecar"
    odd = machine_name("a--b", "agent")
    assert odd.startswith("bn_") and odd.endswith("-agent")
    assert machine_name("a--b", "agent") != machine_name("a---b", "agent")
    for name in ("web1", "a--b", "x" * 63, "0-"):
        for role in ("sidecar", "agent"):
            validate_name(machine_name(name, role))


ENDPOINTS = (
    TCPEndpoint("egress", 3128, "/s/egress.sock", "/run/bottle/egress.sock", 40001),
    TCPEndpoint("git", 9418, "/s/git.sock", "/run/bottle/git.sock", 40002),
)


def test_gate_plan_covers_every_required_check() -> None:
    """Own sockets, raw ports, the daemon's and the well-known ports, the outside address,
    DNS, markers and volumes are all in the plan."""
    plan = plan_gate(
        ENDPOINTS,
        mode=IsolationMode.SOCKET,
        nonce="ab" * 16,
        other_bottle="127.77.0.4:43001",
        settings=GateSettings(
            outside="198.18.0.1:9", dns_name="gate.invalid", host_ports=(9100,), udp_ports=(9101,)
        ),
        absent=("/s/.bottlenet-gate-marker-x",),
        volumes=[Volume("/h/ro", "/work/ro", True), Volume("/h/rw", "/work/rw")],
    )
    assert [str(t) for t in plan.own] == [
        "unix:/run/bottle/egress.sock",
        "unix:/run/bottle/git.sock",
    ]
    assert [str(t) for t in plan.deny] == ["tcp:127.77.0.4:43001"]
    # raw ports, the daemon's own services, then the well-known host ports
    assert plan.host_ports[:3] == (40001, 40002, 9100) and 22 in plan.host_ports
    assert plan.udp_ports == (9101, 53, 123, 161, 443, 5353)  # extra, then the well-known ones
    assert str(plan.outside) == "tcp:198.18.0.1:9" and plan.dns == ("gate.invalid",)
    assert plan.absent == ("/s/.bottlenet-gate-marker-x",)
    assert (plan.ro, plan.rw) == (("/work/ro",), ("/work/rw",))
    assert plan.mode == "socket" and plan.witness


def test_stamped_env_uses_agent_endpoints_only(tmp_path: object) -> None:
    """The env names the guest ports (served by the bridge) and mounted sockets, never a raw
    port."""
    spec = parse_bottle_spec("b1", spec_doc(str(tmp_path)))
    env = dict(stamp_env(spec, IsolationMode.SOCKET, ENDPOINTS))
    assert env["HTTPS_PROXY"] == "http://127.0.0.1:3128"
    assert env["GIT_GATE_URL"] == "http://127.0.0.1:9418/"
    assert env["GIT_GATE_SOCKET"] == "/run/bottle/git.sock"
    assert env["BOTTLENET_BRIDGES"] == "3128=/run/bottle/egress.sock 9418=/run/bottle/git.sock"
    assert env["BOTTLENET_MODE"] == "socket"
    assert env["BOTTLENET_BOTTLE"] == "b1" and env["LANG"] == "C.UTF-8"
    assert not any(str(e.raw_port) in value for e in ENDPOINTS for value in env.values())


def test_vm_record_round_trips(tmp_path: object) -> None:
    bottle = socket_bottle(str(tmp_path))
    record = json.loads(json.dumps(bottle.to_state()))
    assert record["spec"] == spec_doc(str(tmp_path))  # the document the spec was read from
    again = Bottle.from_state("b1", record, unix_root=str(tmp_path))
    assert again == bottle and again.require_vms().spec == bottle.require_vms().spec
    with pytest.raises(StateError, match="bottle b1: probe: missing"):
        Bottle.from_state("b1", {**record, "probe": None}, unix_root=str(tmp_path))
    with pytest.raises(StateError, match="bottle b1: sidecar_pid: must be an integer"):
        Bottle.from_state("b1", {**record, "sidecar_pid": True}, unix_root=str(tmp_path))
    with pytest.raises(StateError, match="stored spec no longer valid"):
        Bottle.from_state("b1", {**record, "spec": {"mode": "x"}}, unix_root=str(tmp_path))
    with pytest.raises(StateError, match="bottle b1: kind: unknown"):
        Bottle.from_state("b1", {**record, "kind": "other"}, unix_root=str(tmp_path))


def test_vm_record_keeps_todays_strings(tmp_path: object) -> None:
    """The typed values are written as the same plain strings the state file always held."""
    bottle = socket_bottle(
        str(tmp_path), probe=ProbeResult.PASS, probe_skipped=False, workload=WorkloadState.RUNNING
    )
    text = json.dumps(bottle.to_state())
    assert '"mode": "socket"' in text and '"probe": "PASS"' in text
    assert '"workload": "running"' in text
    record = json.loads(text)
    again = Bottle.from_state("b1", record, unix_root=str(tmp_path)).require_vms()
    assert (again.mode, again.probe, again.workload) == (
        IsolationMode.SOCKET,
        ProbeResult.PASS,
        WorkloadState.RUNNING,
    )
    assert [sorted(e) for e in record["endpoints"]] == [
        ["guest_path", "guest_port", "path", "raw_port", "service", "sidecar_path"]
    ]
    for key, value in (("probe", "MAYBE"), ("mode", "tunnel"), ("workload", "paused")):
        with pytest.raises(StateError, match=f"bottle b1: {key}: must be one of"):
            Bottle.from_state("b1", {**record, key: value}, unix_root=str(tmp_path))


def test_both_endpoint_kinds_round_trip() -> None:
    """A sidecar socket and a raw port endpoint each come back as their own kind."""
    sock = SocketEndpoint("git", 9418, "/s/git.sock", "/run/bottle/git.sock", "/s/sidecar/git.sock")
    raw = TCPEndpoint("egress", 3128, "/s/e.sock", "/run/bottle/egress.sock", 40001)
    assert sock.to_json()["raw_port"] == 0 and raw.to_json()["sidecar_path"] is None
    assert [endpoint_from_json(e.to_json()) for e in (sock, raw)] == [sock, raw]
    assert sock.agent_address() == "unix:/run/bottle/git.sock"


def test_an_old_state_record_with_alias_keys_still_loads(tmp_path: object) -> None:
    """A record written before alias mode was removed (``host``/``port`` null) still loads;
    an alias-mode endpoint is a typed StateError, not a traceback."""
    bottle = socket_bottle(str(tmp_path))
    record = json.loads(json.dumps(bottle.to_state()))
    old = {**record, "endpoints": [{**e, "host": None, "port": None} for e in record["endpoints"]]}
    assert Bottle.from_state("b1", old, unix_root=str(tmp_path)) == bottle
    alias = {
        **record,
        "mode": "alias",
        "endpoints": [{**e, "host": "127.77.0.3", "port": 43001} for e in record["endpoints"]],
    }
    with pytest.raises(StateError, match=r"endpoints\[0\]\.host: an alias-mode endpoint"):
        Bottle.from_state("b1", alias, unix_root=str(tmp_path))


def test_watch_fallback_timer_fires_once_when_pid_dies() -> None:
    clock = Clock()  # no addReader: the slow timer path
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    fired: list[int] = []
    watch = PidWatcher(clock, interval=5).watch(proc.pid, lambda: fired.append(1))
    clock.advance(5)
    assert fired == [] and pid_alive(proc.pid)
    proc.kill()
    proc.wait()
    clock.advance(5)
    clock.advance(5)
    assert fired == [1] and not watch.active


def test_cli_spec_file_is_sent_as_json(tmp_path: object) -> None:
    spec = os.path.join(str(tmp_path), "b.toml")
    with open(spec, "w") as f:
        f.write('mode = "none"\n')
    bad = os.path.join(str(tmp_path), "bad.toml")
    with open(bad, "w") as f:
        f.write("mode = \n")
    err = io.StringIO()
    env = {"BOTTLENET_CONTROL": os.path.join(str(tmp_path), "nothing.sock")}
    assert main(["bottle", "create", "x", "--spec", bad], env=env, err=err) == 2
    assert "not valid TOML" in err.getvalue()
    assert main(["bottle", "create", "x", "--spec", spec], env=env, err=io.StringIO()) == 3
    from bottlenet.cli.main import SpecFileError, read_spec

    assert json.loads(read_spec(spec)) == {"mode": "none"}
    with pytest.raises(SpecFileError, match="not valid TOML"):
        read_spec(bad)


def test_map_vmctl_tells_precheck_from_smolvm_failure() -> None:
    from bottlenet.bottles.vmerrors import map_vmctl
    from bottlenet.errors import InvalidArgument, SmolvmFailed, SmolvmUnavailable
    from vmctl import errors as v

    assert isinstance(map_vmctl(v.DeviceBudgetExceeded("5 devices > 4")), InvalidArgument)
    assert isinstance(map_vmctl(v.DeviceBudget("krun_start_enter returned: -22")), SmolvmFailed)
    assert isinstance(map_vmctl(v.SmolvmUnavailable("no smolvm")), SmolvmUnavailable)


def test_gate_plan_checks_connect_through_the_declared_proxy() -> None:
    sock = TCPEndpoint("egress", 3128, "/s/e.sock", "/run/bottle/egress.sock", 40001)
    plan = plan_gate(
        [sock],
        mode="socket",
        nonce="ab" * 16,
        other_bottle=None,
        settings=GateSettings(dns_name="gate.invalid"),
        proxy=sock,
        allow_hosts=("*.github.com", "pypi.org"),
    )
    assert str(plan.connect_via) == "unix:/run/bottle/egress.sock"
    assert (plan.connect_ok, plan.connect_no) == (("pypi.org:443",), ("gate.invalid:443",))
    # a gate name the allow-list admits is not a refusal check: a reserved name is used instead
    allowed = plan_gate(
        [sock],
        mode="socket",
        nonce="ab" * 16,
        other_bottle=None,
        settings=GateSettings(dns_name="x.github.com"),
        proxy=sock,
        allow_hosts=("*.github.com",),
    )
    assert (allowed.connect_ok, allowed.connect_no) == ((), ("bottlenet-gate.invalid:443",))


def test_a_bottle_machine_walks_its_declared_lifecycle(rigs: Callable[..., Rig], tmp: str) -> None:
    """Create, an operation, workload exit, teardown failure: each input lands where declared
    (the table says BUSY while an operation holds a bottle kept as it is)."""
    rig = rigs()
    seen: list[str] = []
    rig.events.subscribe(lambda e: seen.append(e.kind))
    reg, starting = rig.registry, rig.smolvm.hold("start", "bn-b1-agent")
    spec = parse_bottle_spec("b1", spec_doc(tmp, workload=("/agent", "run")))
    creating = rig.start(reg.create_bottle("b1", spec=spec))
    assert reg.state_of("b1") is Lifecycle.CREATING
    with pytest.raises(Busy):  # a second operation: BUSY
        rig.run(reg.destroy_bottle("b1"))
    starting.callback(None)
    rig.result(creating)
    assert reg.state_of("b1") is Lifecycle.READY
    checking = rig.smolvm.hold("exec", "bn-b1-agent")
    verifying = rig.start(reg.verify_bottle("b1"))
    assert reg.state_of("b1") is Lifecycle.BUSY
    with pytest.raises(Busy):
        rig.run(reg.verify_bottle("b1"))
    checking.callback(None)
    rig.result(verifying)
    owner = reg.owner("b1", VMBottle)
    owner.workload_ended(0)
    owner.workload_ended(0)
    assert reg.state_of("b1") is Lifecycle.EXITED and seen.count(WORKLOAD_EXITED) == 1
    deleting = rig.smolvm.hold("delete", "bn-b1-agent")
    rig.smolvm.fail_on("delete", "bn-b1-agent", VmSmolvmFailed("delete failed"))
    destroying = rig.start(reg.destroy_bottle("b1"))
    assert reg.state_of("b1") is Lifecycle.DESTROYING
    with pytest.raises(Busy):
        rig.run(reg.verify_bottle("b1"))
    deleting.callback(None)
    with pytest.raises(SmolvmFailed):
        rig.result(destroying)
    assert reg.state_of("b1") is Lifecycle.DEGRADED and seen.count(DEGRADED) == 1  # news
    rig.run(owner.degrade("again"))
    owner.workload_ended(3)  # degraded stays degraded
    assert seen.count(DEGRADED) == 1 and reg.get_bottle("b1").detail == (
        "teardown incomplete: SMOLVM_FAILED"
    )
    rig.smolvm.faults.clear()
    rig.run(reg.destroy_bottle("b1"))
    assert reg.state_of("b1") is None and owner.phase() is Lifecycle.GONE


def test_a_create_that_fails_leaves_its_machine_gone(rigs: Callable[..., Rig], tmp: str) -> None:
    """A create that never commits ends gone; a restored degraded bottle fails no teardown
    twice (no second DEGRADED)."""
    rig = rigs()
    rig.smolvm.fail_on("start", "bn-b1-sidecar", VmSmolvmFailed("no start"))
    spec = parse_bottle_spec("b1", spec_doc(tmp))
    with pytest.raises(SmolvmFailed):
        rig.run(rig.registry.create_bottle("b1", spec=spec))
    assert rig.registry.state_of("b1") is None and rig.registry.held() == 0
    rig.smolvm.faults.clear()
    rig.run(rig.registry.create_bottle("b1", spec=spec))
    rig.run(rig.registry.owner("b1", VMBottle).degrade("test"))
    rig.close()
    again = rigs(smolvm=rig.smolvm)
    again.smolvm.fail_on("delete", "bn-b1-agent", VmSmolvmFailed("delete failed"))
    again.recover()  # its teardown at recovery fails: kept degraded
    assert again.registry.state_of("b1") is Lifecycle.DEGRADED
    seen: list[str] = []
    again.events.subscribe(lambda e: seen.append(e.kind))
    with pytest.raises(SmolvmFailed):
        again.run(again.registry.destroy_bottle("b1"))
    assert again.registry.state_of("b1") is Lifecycle.DEGRADED and DEGRADED not in seen


def test_the_registry_gate_releases_every_waiter_once_restored() -> None:
    """restoring -> serving: changes wait, then all run; a gate that serves answers at once."""
    gate = states.registry_gate()
    assert gate.serving() and gate.when_serving().called and gate.restored() is None
    gate.restore()
    gate.restore()  # the service and the pass both say so: still one restore
    waiting = [gate.when_serving(), gate.when_serving()]
    assert not gate.serving() and not any(d.called for d in waiting)
    done = gate.restored()
    assert done is not None and gate.serving() and gate.restored() is None
    done.fire(None)
    assert all(d.called for d in waiting)


@pytest.mark.parametrize("state", ["creating", "busy", "Ready", ""])
def test_a_record_keeps_only_a_kept_state(tmp_path: object, state: str) -> None:
    """The state file holds ready, degraded or exited; anything else is a StateError."""
    record = json.loads(json.dumps(socket_bottle(str(tmp_path)).to_state()))
    assert record["state"] == "ready"  # the string, unchanged
    for kept in ("ready", "degraded", "exited"):
        again = Bottle.from_state("b1", {**record, "state": kept}, unix_root=str(tmp_path))
        assert again.state is BottleState(kept)
    with pytest.raises(StateError, match="not a state a bottle is kept in"):
        Bottle.from_state("b1", {**record, "state": state}, unix_root=str(tmp_path))
