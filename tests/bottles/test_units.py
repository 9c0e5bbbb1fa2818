"""Pure pieces of VM bottles: mode decision, probe verdicts, names, env, records, watch, CLI."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from twisted.internet.task import Clock

from bottlenet.bottles.agentenv import stamp_env
from bottlenet.bottles.isolation import (
    MECH_IPTABLES,
    MECH_SOCKET,
    MECH_TSI_ALLOW,
    choose_isolation,
    tsi_allow_list_enforced,
)
from bottlenet.bottles.model import Bottle, Endpoint, machine_name
from bottlenet.bottles.probe import ProbePlan, judge, plan_probe
from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.bottles.store import StateError
from bottlenet.bottles.watch import PidWatcher, pid_alive
from bottlenet.cli.main import main
from bottlenet.errors import IsolationUnavailable
from tests.bottles.harness import socket_bottle, spec_doc
from vmctl.smolvm import SmolvmVersion
from vmctl.spec import validate_name


def v(text: str) -> SmolvmVersion:
    return SmolvmVersion.parse(f"smolvm {text}\n".encode())


@pytest.mark.parametrize(
    ("requested", "version", "fallback", "local", "expected"),
    [
        ("socket", "1.9.2", False, True, MECH_SOCKET),
        ("auto", "1.9.2", False, True, MECH_SOCKET),
        ("auto", "1.9.2", True, False, MECH_IPTABLES),  # registry image: no socket mode
        ("alias", "1.9.2", True, True, MECH_IPTABLES),
        ("alias", "1.1.2", False, True, MECH_TSI_ALLOW),
        ("auto", "1.1.2", False, True, MECH_TSI_ALLOW),  # no --mount-socket before 1.6.4
        ("alias", "1.9.2", False, True, None),
        ("socket", "1.6.3", True, True, None),
        ("auto", "1.9.2", False, False, None),
    ],
)
def test_choose_isolation(
    requested: str, version: str, fallback: bool, local: bool, expected: str | None
) -> None:
    def choose() -> str:
        return choose_isolation(
            requested, v(version), "linux", iptables_fallback=fallback, local_agent_image=local
        ).mechanism

    if expected is None:
        with pytest.raises(IsolationUnavailable):
            choose()
    else:
        assert choose() == expected


def test_version_table_and_platform() -> None:
    assert tsi_allow_list_enforced(v("1.1.2")) and not tsi_allow_list_enforced(v("1.1.3"))
    with pytest.raises(IsolationUnavailable, match="socket mode needs"):
        choose_isolation(
            "socket", v("1.9.2"), "freebsd", iptables_fallback=False, local_agent_image=True
        )
    plan = choose_isolation(
        "socket", v("1.9.2"), "darwin", iptables_fallback=False, local_agent_image=True
    )
    assert "--mount-socket" in plan.describe(None)


def test_machine_names_follow_smolvm_rules() -> None:
    assert machine_name("web1", "sidecar") == "bn-web1-sidecar"
    odd = machine_name("a--b", "agent")
    assert odd.startswith("bn_") and odd.endswith("-agent")
    assert machine_name("a--b", "agent") != machine_name("a---b", "agent")
    for name in ("web1", "a--b", "x" * 63, "0-"):
        for role in ("sidecar", "agent"):
            validate_name(machine_name(name, role))


ENDPOINTS = (
    Endpoint("egress", 3128, 40001, host="127.77.0.3", port=43001),
    Endpoint("git", 9418, 40002, host="127.77.0.3", port=43002),
)


def test_probe_plan_covers_every_required_check() -> None:
    plan = plan_probe(ENDPOINTS, other_bottle="127.77.0.4:43001", host_services=(9100, 40001))
    assert plan.own == ("tcp:127.77.0.3:43001", "tcp:127.77.0.3:43002")
    assert plan.deny == (
        "tcp:127.0.0.1:40001",
        "tcp:127.0.0.1:40002",
        "tcp:127.0.0.1:9100",
        "tcp:127.77.0.4:43001",
        "tcp:1.1.1.1:443",
    )
    assert plan.dns == ("example.com",)
    assert plan.argv()[:3] == ["/bin/sh", "-s", "--"]


def test_probe_verdicts_name_only_known_leaks() -> None:
    plan = ProbePlan(("unix:/run/bottle/egress.sock",), ("tcp:127.0.0.1:40001",), ("example.com",))
    ok = (
        b"ok own unix:/run/bottle/egress.sock connects\n"
        b"ok blocked tcp:127.0.0.1:40001\nRESULT PASS\n"
    )
    assert judge(plan, 0, ok).passed
    leak = b"LEAK tcp:127.0.0.1:40001 is reachable\nLEAK dns example.com resolves\nRESULT FAIL\n"
    verdict = judge(plan, 1, leak)
    assert not verdict.passed
    assert verdict.problems == (
        "leak: tcp:127.0.0.1:40001 is reachable",
        "leak: DNS name example.com resolves",
    )
    hostile = (
        b"LEAK \x1b[2J$(reboot) is reachable\nLEAK tcp:6.6.6.6:1;rm is reachable\nRESULT FAIL\n"
    )
    assert judge(plan, 1, hostile).problems == ("leak",)
    assert not judge(plan, 1, b"RESULT PASS\n").passed  # exit code counts too
    assert not judge(plan, 0, b"").passed
    assert "no python3" in judge(plan, 3, b"RESULT FAIL\n").describe()


def test_probe_script_against_real_sockets(tmp_path: object) -> None:
    """probe.sh itself (python3 path): a listening own socket passes, a closed deny port too."""
    import socket

    from bottlenet.bottles.probe import probe_script

    path = os.path.join(str(tmp_path), "own.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    plan = ProbePlan((f"unix:{path}",), (f"tcp:127.0.0.1:{port}",), ())
    r = subprocess.run(plan.argv(), input=probe_script(), capture_output=True, timeout=30)
    srv.close()
    assert judge(plan, r.returncode, r.stdout).passed, r.stdout


def test_stamped_env_uses_agent_endpoints_only(tmp_path: object) -> None:
    spec = parse_bottle_spec("b1", spec_doc(str(tmp_path), mode="alias"))
    env = dict(stamp_env(spec, "alias", ENDPOINTS))
    assert env["HTTPS_PROXY"] == "http://127.77.0.3:43001"
    assert env["GIT_GATE_URL"] == "http://127.77.0.3:43002/"
    assert env["GIT_GATE_SOCKET"] == ""
    assert env["BOTTLENET_BOTTLE"] == "b1" and env["LANG"] == "C.UTF-8"
    assert not any(str(e.raw_port) in value for e in ENDPOINTS for value in env.values())


def test_vm_record_round_trips(tmp_path: object) -> None:
    bottle = socket_bottle(str(tmp_path))
    record = json.loads(json.dumps(bottle.to_state()))
    assert record["spec"] == spec_doc(str(tmp_path))  # the document the spec was read from
    again = Bottle.from_state("b1", record, unix_root=str(tmp_path))
    assert again == bottle and again.machine().spec == bottle.machine().spec
    with pytest.raises(StateError, match="bottle b1: probe: missing"):
        Bottle.from_state("b1", {**record, "probe": None}, unix_root=str(tmp_path))
    with pytest.raises(StateError, match="bottle b1: sidecar_pid: must be an integer"):
        Bottle.from_state("b1", {**record, "sidecar_pid": True}, unix_root=str(tmp_path))
    with pytest.raises(StateError, match="stored spec no longer valid"):
        Bottle.from_state("b1", {**record, "spec": {"mode": "x"}}, unix_root=str(tmp_path))
    with pytest.raises(StateError, match="bottle b1: kind: unknown"):
        Bottle.from_state("b1", {**record, "kind": "other"}, unix_root=str(tmp_path))


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
    from bottlenet.bottles.lifecycle import map_vmctl
    from bottlenet.errors import InvalidArgument, SmolvmFailed, SmolvmUnavailable
    from vmctl import errors as v

    assert isinstance(map_vmctl(v.DeviceBudgetExceeded("5 devices > 4")), InvalidArgument)
    assert isinstance(map_vmctl(v.DeviceBudget("krun_start_enter returned: -22")), SmolvmFailed)
    assert isinstance(map_vmctl(v.SmolvmUnavailable("no smolvm")), SmolvmUnavailable)
