"""The probe room: plan validation, the generated script, the judge, the witness and the CLI.

The script is also run for real here, on the host's python3, but only inside a network
namespace of its own (``unshare -n``) so nothing it dials can leave the machine.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from bottlenet.errors import InvalidArgument
from bottlenet.probe.__main__ import main as cli_main
from bottlenet.probe.judge import expected_deny, expected_icmp, judge
from bottlenet.probe.plan import ProbePlan, Target, host_id_hash
from bottlenet.probe.script import render
from bottlenet.probe.witness import Witness, WitnessFactory

NONCE = "0123456789abcdef" * 2
OWN = "unix:/run/bottle/egress.sock"


def plan(**kw: Any) -> ProbePlan:
    base: dict[str, Any] = {
        "mode": "socket",
        "nonce": NONCE,
        "own": (OWN,),
        "deny": ("tcp:127.77.0.4:43001",),
        "host_ports": (18080,),
        "outside": "198.18.0.1:9",
        "dns": ("gate.invalid",),
    }
    base.update(kw)
    return ProbePlan(**base)


def transcript(
    p: ProbePlan,
    *,
    ifaces: tuple[str, ...] = ("lo",),
    paths: tuple[str, ...] = (),
    override: dict[str, str] | None = None,
    end: str = "pass",
    links: tuple[str, ...] = (),
) -> bytes:
    """A well-formed transcript for ``p`` in which everything is blocked (unless overridden);
    ``links``: the rtnetlink report's lines (``link NAME KIND FLAGS``, ``addr``, ``route``)."""
    o = override or {}
    lines = ["begin 1"] + [f"iface {i}" for i in ifaces] + ["tool image"] + list(links)
    lines += ["control tcp ok", "control unix ok", "control icmp ok"]
    lines += [f"own {t} {o.get(str(t), 'ok')}" for t in p.own]
    pairs = [tuple(x.split(" ")) for x in paths]
    lines += [f"path {k} {a}" for k, a in pairs]
    lines += [f"deny {t} {o.get(t, 'blocked')}" for t in expected_deny(p, pairs)]  # type: ignore[arg-type]
    icmp = expected_icmp(p, pairs)  # type: ignore[arg-type]
    lines += ["control icmp6 ok"] if any(":" in a for a in icmp) else []
    lines += [f"icmp {a} {o.get('icmp ' + a, 'blocked')}" for a in icmp]
    lines += [f"dns {n} {o.get(n, 'blocked')}" for n in p.dns]
    lines += [f"absent {a} {o.get(a, 'ok')}" for a in p.absent]
    lines += ["id machine-id " + o.get("machine-id", "none"), "id hostname none"]
    lines += [f"ro {d} {o.get(d, 'ok')}" for d in p.ro] + [f"rw {d} ok" for d in p.rw]
    lines.append(f"end {end}")
    return "".join(f"BNP {p.nonce} {ln}\n" for ln in lines).encode()


# -- plan ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        "tcp:localhost:80",
        "tcp:1.2.3.4",
        "tcp:1.2.3.4:0",
        "tcp:::1:80",
        "tcp:[1.2.3.4]:80",
        "unix:relative",
        "unix:/a b",
        "unix:/a/../b",
        "udp:1.2.3.4:53",
        "tcp:1.2.3.4:80;reboot",
    ],
)
def test_endpoints_are_validated(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        Target.parse(bad)


def test_endpoints_round_trip_canonically() -> None:
    assert str(Target.parse("tcp:[::1]:80")) == "tcp:[::1]:80"
    assert str(Target.parse("unix:/run/x.sock")) == "unix:/run/x.sock"


@pytest.mark.parametrize(
    "kw",
    [
        {"mode": "tsi"},
        {"nonce": "XYZ"},
        {"nonce": "ab"},
        {"dns": ("Example.COM",)},
        {"dns": ("$(x)",)},
        {"absent": ("/a'b",)},
        {"host_ports": (0,)},
        {"outside": "unix:/x"},
        {"host_ids": ("abc",)},
    ],
)
def test_plan_refuses_bad_values(kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        plan(**kw)


# -- script --------------------------------------------------------------------------------


def test_script_embeds_the_plan_and_nothing_else() -> None:
    s = render(plan(absent=("/state/.marker",))).decode()
    assert s.startswith("#!/bin/sh\n")
    assert f"N={NONCE}\n" in s
    assert "'/state/.marker'" in s and "'tcp:127.77.0.4:43001'" in s
    assert s.count("BOTTLENET_PROBE_PY") == 2  # one quoted heredoc: no shell expansion inside
    assert "PLAN = {}" not in s


needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("python3") is None,
    reason="running the script needs root for unshare -n (its own network namespace)",
)


def run_in_netns(script: bytes, *setup: str) -> tuple[int, bytes]:
    """The script under ``sh -s`` in a new network namespace (lo up, nothing else)."""
    pre = "; ".join(["ip link set lo up", *setup])
    p = subprocess.run(
        # A pid namespace too, whose first process is this shell: when it exits the kernel
        # kills every background helper of ``setup`` (``kill $(jobs -p)`` in a non-interactive
        # sh found no jobs, and each run left its proxy behind).
        [
            "unshare",
            "--net",
            "--pid",
            "--fork",
            "/bin/sh",
            "-c",
            f"{pre}; /bin/sh -s",
        ],
        input=script,
        capture_output=True,
        timeout=120,
        check=False,
    )
    return p.returncode, p.stdout


@needs_netns
def test_script_in_a_network_less_namespace_passes_without_witness() -> None:
    p = plan(own=(), witness=False)
    code, out = run_in_netns(render(p))
    v = judge(p, out, exit_code=code, witnessed=None)
    assert v.passed, v.lines()
    assert code == 0


@needs_netns
def test_script_finds_a_reachable_port_and_a_visible_marker(tmp_path: Any) -> None:
    marker = str(tmp_path / ".bottlenet-gate-marker-x")
    open(marker, "w").close()
    p = plan(own=(), witness=False, host_ports=(18999,), absent=(marker,))
    ready = tmp_path / "ready"
    listener = (
        'python3 -c \'import socket, sys, time; s = socket.create_server(("127.0.0.1", 18999));'
        f' open(sys.argv[1], "w").close(); time.sleep(60)\' {ready} >/dev/null 2>&1 &'
        f" while [ ! -e {ready} ]; do sleep 0.05; done"
    )
    code, out = run_in_netns(render(p), listener)
    v = judge(p, out, exit_code=code, witnessed=None)
    assert not v.passed and code == 1
    assert (
        "leak: tcp:127.0.0.1:18999 (host port 18999 via the loopback 127.0.0.1) is reachable"
        in v.problems
    )
    assert f"leak: host file {marker} is visible in the guest" in v.problems


@needs_netns
def test_script_finds_host_services_on_loopback6_over_tcp_and_udp(tmp_path: Any) -> None:
    """The real guest program finds a TCP listener and a UDP echo on [::1] (netns only)."""
    p = plan(own=(), witness=False, host_ports=(18999,), udp_ports=(18998,))
    ready = tmp_path / "ready"
    services = (
        "python3 -c 'import socket, sys\n"
        's = socket.create_server(("::1", 18999), family=socket.AF_INET6)\n'
        "u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n"
        'u.bind(("::1", 18998))\n'
        'open(sys.argv[1], "w").close()\n'
        "while True:\n"
        "    d, a = u.recvfrom(512)\n"
        f"    u.sendto(d, a)' {ready} >/dev/null 2>&1 &"
        f" while [ ! -e {ready} ]; do sleep 0.05; done"
    )
    code, out = run_in_netns(render(p), services)
    v = judge(p, out, exit_code=code, witnessed=None)
    assert code == 1
    assert v.problems == (
        "leak: tcp:[::1]:18999 (host port 18999 via the loopback ::1) is reachable",
        "leak: udp:[::1]:18998 (host UDP port 18998 via the loopback ::1) is reachable",
    )


@needs_netns
def test_script_without_python3_says_so(tmp_path: Any) -> None:
    p = plan(own=(), witness=False)
    code, out = run_in_netns(render(p), f"export PATH={tmp_path}")
    assert code == 4
    v = judge(p, out, exit_code=code, witnessed=None)
    assert v.problems[-1] == "the probe found no python3 in the guest (and no kit)"


# -- judge ---------------------------------------------------------------------------------


def test_a_complete_blocked_transcript_with_the_witness_passes() -> None:
    p = plan()
    assert judge(p, transcript(p), exit_code=0, witnessed=[OWN]).passed


def test_a_forged_pass_without_the_host_witness_fails() -> None:
    """A guest /bin/sh that knows the nonce and prints a perfect transcript still fails."""
    p = plan()
    v = judge(p, transcript(p), exit_code=0, witnessed=[])
    assert v.problems == (
        f"own endpoint {OWN} was not witnessed on the host "
        "(no connection carrying this run's nonce)",
    )


def test_a_bare_result_pass_and_a_replayed_transcript_fail() -> None:
    p = plan()
    assert not judge(p, b"RESULT PASS\n", exit_code=0, witnessed=[OWN]).passed
    other = plan(nonce="f" * 32)
    v = judge(p, transcript(other), exit_code=0, witnessed=[OWN])  # another run's transcript
    assert not v.passed
    assert "the probe did not finish (no end line)" in v.problems


def test_unknown_lines_fail_and_are_never_echoed() -> None:
    p = plan()
    hostile = transcript(p).replace(
        b"BNP " + NONCE.encode() + b" tool image\n",
        b"\x1b[2J$(reboot) tool image\nBNP " + NONCE.encode() + b" leak \x07\n",
    )
    v = judge(p, hostile, exit_code=0, witnessed=[OWN])
    assert not v.passed
    assert v.problems == ("2 transcript line(s) not bound to this run or of no known form",)
    assert not any("reboot" in x or "\x1b" in x for x in v.problems)


def test_missing_checks_and_lines_after_the_end_fail() -> None:
    p = plan()
    lines = transcript(p).split(b"\n")
    dropped = b"\n".join(ln for ln in lines if b" deny tcp:198.18.0.1:9 " not in ln)
    v = judge(p, dropped, exit_code=0, witnessed=[OWN])
    assert v.problems == ("check missing: deny tcp:198.18.0.1:9",)
    late = transcript(p) + f"BNP {NONCE} deny tcp:127.0.0.1:1 reachable\n".encode()
    assert not judge(p, late, exit_code=0, witnessed=[OWN]).passed


def test_every_path_to_the_host_is_required_and_leaks_are_named() -> None:
    p = plan()
    paths = ("gw 10.0.2.2", "ns 10.0.2.3", "gw fe80::2%eth0")
    t = transcript(
        p,
        ifaces=("eth0", "lo"),
        links=("link eth0 - 11043", "addr eth0 10.0.2.15/24", "route eth0 unicast 0.0.0.0/0"),
        paths=paths,
        override={
            "tcp:10.0.2.2:18080": "reachable",
            "icmp 10.0.2.2": "answers",
            "gate.invalid": "resolves",
            "tcp:[fe80::2%eth0]:18080": "reachable",
            "icmp fe80::2%eth0": "answers",
        },
        end="fail",
    )
    v = judge(p, t, exit_code=1, witnessed=[OWN])
    assert v.problems == (
        "network interface eth0 in a socket-mode guest (a device, not a dummy link; up; address"
        " 10.0.2.15/24; routes unicast 0.0.0.0/0): only lo, or a dummy link that is down with"
        " no address and no route, is allowed",
        "leak: tcp:10.0.2.2:18080 (host port 18080 via the default gateway 10.0.2.2) is reachable",
        "leak: tcp:[fe80::2%eth0]:18080 (host port 18080 via the default gateway fe80::2%eth0)"
        " is reachable",
        "leak: the default gateway 10.0.2.2 answers ICMP echo",
        "leak: the default gateway fe80::2%eth0 answers ICMPv6 echo",
        "leak: DNS name gate.invalid resolves",
    )
    # a guest that leaves out the gateway's checks is incomplete, not clean
    partial = b"\n".join(ln for ln in t.split(b"\n") if b"10.0.2.2:18080" not in ln)
    assert "check missing: deny tcp:10.0.2.2:18080" in judge(p, partial, witnessed=[OWN]).problems


def test_alias_mode_allows_interfaces() -> None:
    p = plan(mode="alias")
    assert judge(p, transcript(p, ifaces=("eth0", "lo")), exit_code=0, witnessed=[OWN]).passed


def test_a_blind_tool_fails_with_its_own_message() -> None:
    p = plan()
    t = transcript(p).replace(b"control unix ok", b"control unix fail")
    v = judge(p, t, exit_code=0, witnessed=[OWN])
    assert v.problems == ("probe tool cannot detect connections (control unix failed)",)


def test_host_identity_and_volumes() -> None:
    mid = host_id_hash(NONCE, "1234abcd")
    p = plan(host_ids=(mid,), ro=("/work/ro",), rw=("/work/rw",))
    t = transcript(p, override={"machine-id": mid, "/work/ro": "writable"}, end="fail")
    v = judge(p, t, exit_code=1, witnessed=[OWN], rw_seen=[])
    assert v.problems == (
        "read-only volume /work/ro accepts writes",
        "the guest's machine-id is the host's",
        "read-write volume /work/rw: the guest's file did not reach the host",
    )
    assert judge(p, transcript(p), exit_code=0, witnessed=[OWN], rw_seen=["/work/rw"]).passed


def test_exit_status_must_agree_with_the_transcript() -> None:
    p = plan()
    v = judge(p, transcript(p), exit_code=1, witnessed=[OWN])
    assert v.problems == ("the probe's exit status 1 does not match its transcript",)


# -- witness -------------------------------------------------------------------------------


def witness_conn(w: Witness, used: list[int], clock: Clock) -> tuple[Any, StringTransport]:
    f = WitnessFactory(clock, w, OWN, on_used=lambda: used.append(1), timeout=5)
    proto = f.buildProtocol(None)
    tr = StringTransport()
    proto.makeConnection(tr)
    return proto, tr


def test_witness_records_the_nonce_once_and_closes() -> None:
    clock, used, w = Clock(), [], Witness(NONCE)
    proto, tr = witness_conn(w, used, clock)
    proto.dataReceived(f"BNP-WITNESS {NONCE} ".encode())
    assert w.seen == set()
    proto.dataReceived(f"{OWN}\n".encode())
    assert w.seen == {OWN} and tr.disconnecting and used == [1]
    assert tr.value() == b""  # it never answers: nothing to parse on the guest's side


def test_witness_refuses_a_wrong_nonce_garbage_and_silence() -> None:
    clock, used, w = Clock(), [], Witness(NONCE)
    proto, _ = witness_conn(w, used, clock)
    proto.dataReceived(f"BNP-WITNESS {'f' * 32} {OWN}\n".encode())
    proto2, _ = witness_conn(w, used, clock)
    proto2.dataReceived(b"x" * 600)  # no newline, over the limit
    _, tr3 = witness_conn(w, used, clock)
    clock.advance(5)
    assert tr3.disconnecting
    assert w.seen == set() and w.mismatched == 3


def test_witness_after_the_window_counts_nothing() -> None:
    clock, used, w = Clock(), [], Witness(NONCE)
    w.close()
    proto, _ = witness_conn(w, used, clock)
    proto.dataReceived(f"BNP-WITNESS {NONCE} {OWN}\n".encode())
    assert w.seen == set()


# -- CLI -----------------------------------------------------------------------------------

ARGS = [
    "--own",
    OWN,
    "--deny",
    "tcp:127.77.0.4:43001",
    "--port",
    "18080",
    "--outside",
    "198.18.0.1:9",
    "--dns",
    "gate.invalid",
    "--nonce",
    NONCE,
]


def run_cli(
    argv: list[str], stdin: bytes = b"", capsys: Any = None, monkeypatch: Any = None
) -> tuple[int, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    code = cli_main(argv)
    return code, capsys.readouterr().out


def test_cli_script_is_exactly_the_gates_script(capsys: Any, monkeypatch: Any) -> None:
    out = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out))
    assert cli_main(["script", *ARGS]) == 0
    sys.stdout.flush()
    assert out.getvalue() == render(plan())


def test_cli_judge_exit_codes(capsys: Any, monkeypatch: Any) -> None:
    good = transcript(plan())
    assert run_cli(["judge", *ARGS, "--witnessed", OWN], good, capsys, monkeypatch) == (0, "PASS\n")
    code, out = run_cli(["judge", *ARGS], good, capsys, monkeypatch)
    assert code == 1 and out.startswith("FAIL\n  - own endpoint")
    code, out = run_cli(["judge", *ARGS, "--no-witness"], good, capsys, monkeypatch)
    assert code == 0 and "note: own endpoints not witnessed on the host" in out
    assert run_cli(["judge", *ARGS[:-2]], good, capsys, monkeypatch)[0] == 2  # no nonce
    assert run_cli(["judge", *ARGS, "--own", "tcp:x:1"], good, capsys, monkeypatch)[0] == 2
    with pytest.raises(SystemExit) as e:
        cli_main(["judge", "--mode", "nope"])
    assert e.value.code == 2


def test_cli_runs_as_a_module() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "bottlenet.probe", "judge", *ARGS, "--witnessed", OWN],
        input=transcript(plan()),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert (p.returncode, p.stdout) == (0, b"PASS\n")


# -- egress CONNECT --------------------------------------------------------------------------


def connect_plan(**kw: Any) -> ProbePlan:
    return plan(
        connect_via=OWN, connect_ok=("pypi.org:443",), connect_no=("gate.invalid:443",), **kw
    )


def test_connect_through_the_egress_proxy_is_judged() -> None:
    p = connect_plan()
    base = transcript(p).replace(
        f"BNP {NONCE} id machine-id".encode(),
        f"BNP {NONCE} connect pypi.org:443 answered\nBNP {NONCE} connect gate.invalid:443 R\n"
        f"BNP {NONCE} id machine-id".encode(),
    )
    assert judge(p, base.replace(b" R\n", b" refused\n"), exit_code=0, witnessed=[OWN]).passed
    open_proxy = judge(p, base.replace(b" R\n", b" answered\n"), witnessed=[OWN])
    assert open_proxy.problems[0] == (
        f"leak: the egress proxy {OWN} lets CONNECT gate.invalid:443 through"
        " (not on the allow-list)"
    )
    dead = base.replace(b"pypi.org:443 answered", b"pypi.org:443 unreachable")
    assert judge(p, dead.replace(b" R\n", b" refused\n"), witnessed=[OWN]).problems[0] == (
        f"the egress proxy {OWN} did not answer CONNECT pypi.org:443"
        " (on the allow-list): unreachable"
    )
    assert (
        "check missing: connect pypi.org:443" in judge(p, transcript(p), witnessed=[OWN]).problems
    )


PROXY = """
import socket, sys
srv = socket.socket(socket.AF_UNIX); srv.bind(sys.argv[1]); srv.listen(8)
open(sys.argv[1] + ".ready", "w").close()
while True:
    c, _ = srv.accept()
    line = c.recv(512).split(b"\\r\\n")[0]
    ok = sys.argv[2] == "open" or b" pypi.org:443 " in line
    answer = b"200 Connection established" if ok else b"403 Forbidden"
    c.sendall(b"HTTP/1.1 " + answer + b"\\r\\n\\r\\n")
    c.close()
"""


@needs_netns
@pytest.mark.parametrize("kind", ["allow-list", "open"])
def test_script_checks_connect_through_a_proxy(tmp_path: Any, kind: str) -> None:
    via = f"/tmp/bnp-proxy-{os.getpid()}-{kind}.sock"
    (tmp_path / "proxy.py").write_text(PROXY)
    p = plan(
        own=(),
        witness=False,
        connect_via=f"unix:{via}",
        connect_ok=("pypi.org:443",),
        connect_no=("gate.invalid:443",),
    )
    start = (
        f"python3 {tmp_path / 'proxy.py'} {via} {kind} >/dev/null 2>&1 &"
        f" while [ ! -e {via}.ready ]; do sleep 0.05; done"
    )
    try:
        code, out = run_in_netns(render(p), start)
    finally:
        for f in (via, via + ".ready"):
            if os.path.exists(f):
                os.unlink(f)
    # the background proxy ended with the namespace's shell (no helper outlives a test)
    assert not subprocess.run(["pgrep", "-f", via], capture_output=True).stdout
    v = judge(p, out, exit_code=code, witnessed=None)
    if kind == "open":
        assert v.problems == (
            f"leak: the egress proxy unix:{via} lets CONNECT gate.invalid:443 through"
            " (not on the allow-list)",
        )
    else:
        assert v.passed, v.lines()
