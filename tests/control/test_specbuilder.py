"""The typed spec builder agrees with the daemon's spec parser, and imports no daemon room."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.control.specbuilder import Agent, BottleSpec, Egress, Service, Sidecar
from bottlenet.errors import InvalidArgument


def full(tmp: str = "/tmp") -> BottleSpec:
    return BottleSpec(
        mode="socket",
        sidecar=Sidecar(
            image="registry.example/bottle-sidecar:1",
            services=[
                Service("egress", 3128, env=["HTTPS_PROXY=http://{host}:{port}"]),
                Service("supervise", 7000, env=["MCP_SUPERVISE_SOCKET={socket}"]),
            ],
            egress=Egress(
                ["pypi.org", "*.GitHub.com".lower(), "bücher.example"],
                "/etc/bottle/egress-allow",
                ["/usr/local/bin/egress-reload"],
            ),
            cpus=2,
        ),
        agent=Agent(
            image="/var/lib/bottles/agent.tar",
            env=["LANG=C.UTF-8"],
            workload=["/usr/local/bin/run-agent", "--flag"],
            volumes=[f"{tmp}:/work"],
            mem=1024,
            user="1000:1000",
        ),
    )


def test_the_daemon_reads_what_the_builder_writes() -> None:
    spec = full()
    parsed = parse_bottle_spec("agent1", json.loads(spec.to_json()))
    assert parsed.mode == "socket"
    assert parsed.sidecar is not None and parsed.agent is not None
    assert [(s.name, s.guest_port, s.env) for s in parsed.sidecar.services] == [
        ("egress", 3128, ("HTTPS_PROXY=http://{host}:{port}",)),
        ("supervise", 7000, ("MCP_SUPERVISE_SOCKET={socket}",)),
    ]
    assert parsed.sidecar.egress is not None
    assert parsed.sidecar.egress.allow_hosts == (
        "pypi.org",
        "*.github.com",
        "xn--bcher-kva.example",
    )
    assert spec.sidecar is not None and spec.sidecar.egress is not None
    assert spec.sidecar.egress.allow_hosts == parsed.sidecar.egress.allow_hosts
    assert (parsed.sidecar.cpus, parsed.agent.mem) == (2, 1024)
    assert parsed.agent.workload == ("/usr/local/bin/run-agent", "--flag")
    assert (parsed.agent.user, parsed.sidecar.listen) == ("1000:1000", "unix")
    tcp = Sidecar("img", [Service("a", 1)], listen="tcp")
    tcp_parsed = parse_bottle_spec("b", {"sidecar": tcp.to_doc(), "agent": {"image": "i"}})
    assert tcp_parsed.sidecar is not None and tcp_parsed.sidecar.listen == "tcp"
    assert parse_bottle_spec("fwd", json.loads(BottleSpec(mode="none").to_json())).mode == "none"


BAD: list[tuple[str, Any]] = [
    ("allow-host", lambda: Egress(["PyPI.org"], "/p", ["/r"])),
    ("policy_path", lambda: Egress([], "relative/p", ["/r"])),
    ("reload", lambda: Egress([], "/p", ["reload"])),
    ("forward label", lambda: Service("Bad Name", 80)),
    ("guest_port", lambda: Service("egress", 0)),
    ("placeholders are", lambda: Service("egress", 80, env=["X={nope}"])),
    ("no format spec", lambda: Service("egress", 80, env=["X={host:>100000000}"])),
    ("UTS 46 form", lambda: Egress(["\uff50ypi.org"], "/p", ["/r"])),
    (
        "more than 262144 bytes",
        lambda: Sidecar(
            "img",
            # each value fits its own bound (30 sockets), all of them together do not
            [
                Service(f"s{i}", 80, env=[f"V{j}=" + "{socket}" * 30 for j in range(10)])
                for i in range(16)
            ],
        ),
    ),
    ("KEY=VALUE", lambda: Agent("/a.tar", env=["1X=y"])),
    ("HOST:GUEST", lambda: Agent("/a.tar", volumes=["nocolon"])),
    ("agent.cpus", lambda: Agent("/a.tar", cpus=99)),
    ("agent.user", lambda: Agent("/a.tar", user="root; rm")),
    ("sidecar.listen", lambda: Sidecar("img", [Service("a", 1)], listen="udp")),
    ("unique", lambda: Sidecar("img", [Service("a", 1), Service("a", 2)])),
    ("1-16 services", lambda: Sidecar("img", [])),
    ("mode", lambda: BottleSpec(mode="magic")),
    ("agent: missing", lambda: BottleSpec(mode="auto", sidecar=Sidecar("i", [Service("a", 1)]))),
]


@pytest.mark.parametrize(("needle", "build"), BAD)
def test_bad_values_fail_on_construction(needle: str, build: Any) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        build()


def test_same_message_as_the_daemon() -> None:
    doc = json.loads(full().to_json())
    doc["sidecar"]["egress"]["allow_hosts"] = ["PyPI.org"]
    with pytest.raises(InvalidArgument) as daemon:
        parse_bottle_spec("b", doc)
    with pytest.raises(InvalidArgument) as builder:
        Egress(["PyPI.org"], "/p", ["/r"])
    assert builder.value.message in daemon.value.message


def test_the_builder_imports_no_daemon_room() -> None:
    """Only the two pure leaf modules of the rooms, no reactor, no smolvm driver."""
    code = (
        "import sys, bottlenet.control.specbuilder\n"
        "leaves = {'bottlenet.bottles', 'bottlenet.bottles.specrules', 'bottlenet.forward',"
        " 'bottlenet.forward.spec'}\n"
        "bad = [m for m in sys.modules if m.startswith(('bottlenet.bottles', 'bottlenet.forward',"
        " 'bottlenet.ops', 'vmctl', 'twisted')) and m not in leaves]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
