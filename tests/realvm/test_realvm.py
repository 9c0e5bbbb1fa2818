"""The launch gate in real guest kernels (QEMU, software emulation): the real-VM tier.

Each variant boots once (one QEMU per core, at least two at a time), inside ``unshare -n``
(only ``lo``), with the daemon's real forward listener witnessing the own-endpoint check; every
check below reads the result of that one boot. The verdict lines of each run are written to
``$BOTTLENET_REALVM_REPORT`` (if set) for the CI log. See tests/realvm/host.py for the guests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.realvm.bridgehost import ROUNDS
from tests.realvm.build import KIT_ENV, Kit, find_kit, krunfw_missing, missing_tools
from tests.realvm.host import CONTROL_PORT, METRICS_PORT, OUTSIDE, UDP_PORT, VARIANTS

pytestmark = pytest.mark.realvm
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _kit_or_why_not() -> Kit | str:
    missing = missing_tools()
    if missing:
        return f"QEMU tier needs {', '.join(missing)} (Debian: qemu-system-x86 busybox-static cpio)"
    if os.geteuid() != 0:
        return "the real-VM tier needs root for unshare -n"
    kit = find_kit()
    if kit is None:
        why = "no real-VM kit: run python -m tests.realvm.build first (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI installs everything: a missing kit is a broken CI, not a skip
        return why
    return kit


def _boot(name: str, kit: Kit) -> dict[str, Any]:
    out = tempfile.NamedTemporaryFile(suffix=f"-{name}.json", delete=False)
    out.close()
    argv = [
        "unshare",
        "--net",
        "--mount",
        "--propagation",
        "private",
        sys.executable,
        "-m",
        "tests.realvm.host",
        name,
        out.name,
    ]
    env = {**os.environ, "PYTHONPATH": REPO, KIT_ENV: os.path.dirname(kit.initrd)}
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    if p.returncode != 0:
        raise AssertionError(
            f"real-VM run {name} failed (exit {p.returncode}):\n{p.stderr[-3000:]}"
        )
    with open(out.name) as fh:
        result: dict[str, Any] = json.load(fh)
    os.unlink(out.name)
    return result


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, dict[str, Any]]]:
    kit = _kit_or_why_not()
    if isinstance(kit, str):
        pytest.skip(kit)
    # the bridge run is the longest: it starts first, the gate's runs share the other slot;
    # the libkrunfw guests (tests/realvm/kitvm.py) run where their tools are
    names = [n for n in VARIANTS if not VARIANTS[n].get("kit") or not krunfw_missing()]
    order = sorted(names, key=lambda name: not VARIANTS[name].get("bridge"))
    started = time.monotonic()
    # one QEMU per core (each is one emulation thread), at least two
    workers = min(len(order), max(2, os.cpu_count() or 2))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = dict(zip(order, pool.map(lambda name: _boot(name, kit), order), strict=True))
    wall = time.monotonic() - started
    results = {name: done[name] for name in names}
    report = os.environ.get("BOTTLENET_REALVM_REPORT")
    if report:
        with open(report, "w") as fh:
            fh.write(
                f"real-VM tier: {len(results)} boots in {wall:.1f} s wall "
                f"(kernel {next(iter(results.values()))['kernel']})\n"
            )
            for name, r in results.items():
                fh.write(
                    f"== {name} (kernel {r['kernel']}): {r['wall']} s, probe exit "
                    f"{r['probe_exit']}, witnessed {r['witnessed']}\n"
                )
                fh.write("\n".join(r["lines"]) + "\n")
    yield results


def test_isolated_vm_passes_with_the_own_endpoint_witnessed_on_the_host(runs: Any) -> None:
    r = runs["isolated"]
    assert r["lines"] == ["PASS"], r
    assert r["probe_exit"] == 0
    assert r["witnessed"] == ["unix:/run/bottle/egress.sock"]  # the daemon's real listener
    # nothing but the bottle's own relay reached a host service
    for key in (f"127.0.0.1:{CONTROL_PORT}", f"127.0.0.1:{METRICS_PORT}", f"{OUTSIDE}:443"):
        assert r["host_accepts"][key] == 0, key
    assert r["console"][0] == "RVM-IFACES lo"
    assert r["udp_echoes"] == 0  # no datagram reached the host's UDP service


def test_leaky_vm_fails_naming_every_leak(runs: Any) -> None:
    r = runs["leaky"]
    assert not r["passed"] and r["probe_exit"] == 1
    problems = r["problems"]
    assert any(
        p.startswith("network interface eth0 in a socket-mode guest (a device, not a dummy link;"
                     " up; address 10.0.2.15/24") for p in problems
    ), problems  # fmt: skip
    assert (
        "leak: tcp:10.0.2.2:18080 (host port 18080 via the default gateway 10.0.2.2) is reachable"
        in problems
    )
    assert (
        f"leak: tcp:10.0.2.2:{CONTROL_PORT} (host port {CONTROL_PORT} via the default gateway"
        " 10.0.2.2) is reachable" in problems
    )
    assert f"leak: tcp:{OUTSIDE}:443 (the outside address) is reachable" in problems
    assert "leak: the default gateway 10.0.2.2 answers ICMP echo" in problems  # it can ping
    # UDP to a host service through slirp's gateway, and slirp's IPv6 router answering ICMPv6
    # (the guest kernel took the route from slirp's router advertisement)
    assert (
        f"leak: udp:10.0.2.2:{UDP_PORT} (host UDP port {UDP_PORT} via the default gateway"
        " 10.0.2.2) is reachable" in problems
    )
    assert "leak: the default gateway fe80::2%eth0 answers ICMPv6 echo" in problems
    assert r["udp_echoes"] >= 1
    # the host side saw the guest on the daemon's control port stand-in: a real leak
    assert r["host_accepts"][f"127.0.0.1:{CONTROL_PORT}"] >= 1


def test_a_leak_through_a_nameserver_address_only_is_found(runs: Any) -> None:
    r = runs["nsonly"]
    assert not r["passed"]
    assert (
        "leak: tcp:10.0.2.2:18080 (host port 18080 via the nameserver 10.0.2.2) is reachable"
        in r["problems"]
    )
    # no IPv4 gateway: the host is reached through the nameserver address only (the kernel's
    # IPv6 autoconfiguration still takes slirp's router, which the ICMPv6 check names)
    assert not any("default gateway 10." in p for p in r["problems"])
    assert "leak: the default gateway fe80::2%eth0 answers ICMPv6 echo" in r["problems"]


def test_a_second_interface_and_a_host_marker_seen_through_a_mount_fail(runs: Any) -> None:
    r = runs["nic-and-mount"]
    assert not r["passed"]
    assert any(
        p.startswith("network interface eth0 in a socket-mode guest (a device, not a dummy link;")
        for p in r["problems"]
    ), r["problems"]
    assert any(
        p.startswith("leak: host file ")
        and "/state/.bottlenet-gate-marker-" in p
        and p.endswith(" is visible in the guest")
        for p in r["problems"]
    )
    assert not any(" is reachable" in p for p in r["problems"])  # restrict=on: no path to the host


def test_a_connect_tool_that_cannot_detect_connections_fails_the_gate(runs: Any) -> None:
    r = runs["blind"]  # the leaky NIC again, but python3's connect() always fails
    assert not r["passed"] and r["probe_exit"] == 3
    assert r["problems"] == ["probe tool cannot detect connections (control tcp, unix failed)"]
    assert r["witnessed"] == []


def test_bottlenets_bridge_carries_real_clients_through_a_real_proxy(runs: Any) -> None:
    """A guest with no NIC and bottlenet's bridge: urllib and curl, with only the stamped
    proxy variables, fetch the allowed server, are refused the denied one (by tinyproxy,
    behind the daemon's real forward), tunnel TLS with CONNECT, and cannot dial directly."""
    r = runs["bridge"]
    res = r["results"]
    assert r["probe_exit"] == 0 and r["console"][0] == "RVM-IFACES lo", r
    assert res["bridge"] == ["BNB_ready_1_"]
    assert res["urllib-allowed"] == ["200 allowed_page"]
    assert res["curl-allowed"] == ["200 allowed_page"]
    assert res["urllib-refused"] == ["403"] and res["curl-refused"] == ["403"]
    assert r["denied_hits"] == 0  # the proxy refused: the denied server never saw a request
    assert res["urllib-connect"] == ["200 secret_page"]
    assert res["curl-connect"] == ["200 secret_page"]
    assert res["direct"] == ["101 Network_is_unreachable"]  # ENETUNREACH: no route at all
    assert res["curl-direct"] == ["7"]  # curl: could not connect
    assert r["outside_accepts"] == 0
    # The cost was measured on both paths (the ratios go to the report; no timing assertion).
    assert [row.split()[0] for row in res["cost"]] == ["bridge", "least", "socket"] * ROUNDS
    # and the bridge's hop alone, against the least relay there can be
    assert [row.split()[0] for row in res["local"]] == ["direct", "least", "bridge"] * ROUNDS


def test_transparent_egress_in_the_kernel_users_boot(runs: Any) -> None:
    """libkrunfw's kernel (smolvm's own), no NIC: the layer installs by netlink; the gate's
    canaries are redirected and refused (witnessed on the host); clients that ignore proxy
    variables get the allowed page through the real proxy, raw IPv4 and IPv6 dials reach it
    as CONNECT ip:port and are reset, UDP and ICMP fail at once; once a guest root removes the
    rules, egress is gone and the bottle's own socket still answers."""
    r = runs["egress"]
    res = r["results"]
    assert r["kernel"].startswith("6.18."), r["kernel"]  # libkrunfw's, not Debian's
    assert res["layer"] == ["BNE_ready_"], r
    assert r["check_passed"], r["check_problems"]
    assert [n.split(": ")[1] for n in r["check_notes"]] == ["redirected and refused"] * 3
    assert res["env"] == ["0"]  # the clients ran with an empty environment
    assert res["urllib"] == ["200 allowed_page"]
    assert res["wget"] == ["0 allowed_page_"]
    assert res["curl"] == ["0 allowed_page_"]
    assert res["resolve"][0].startswith("198.1")  # a fake address from 198.18.0.0/15
    assert res["urllib-denied"] == ["ConnectionResetError"]  # tinyproxy refused the name
    assert r["denied_hits"] == 0
    assert res["raw-v4"] == ["after-connect Connection_reset_by_peer"]
    assert res["raw-v6"] == ["after-connect Connection_reset_by_peer"]
    for line in (
        "CONNECT 203.0.113.7:443 HTTP/1.1",
        "CONNECT [2001:db8::1]:443 HTTP/1.1",
        "CONNECT denied.test:18181 HTTP/1.1",
        "CONNECT allowed.test:18180 HTTP/1.1",
    ):
        assert line in r["proxy_lines"], r["proxy_lines"]
    assert res["udp"] == ["sendto Operation_not_permitted"]
    assert res["udp6"] == ["sendto Operation_not_permitted"]
    assert res["ping"][0].startswith("1 ") and "not_permitted" in res["ping"][0]
    assert r["outside_accepts"] == 0  # nothing reached the outside address but as CONNECT
    assert res["remove"] == ["0"]
    assert res["after-v4"] == ["connect TimeoutError"]  # the SYN loops via lo
    assert res["after-v6"] == ["connect Network_is_unreachable"]
    assert res["after-own"] == ["200"]  # the bottle's own socket: nothing else lost
    assert "BNE conn 203.0.113.7:443 refused" in r["layer_conns"]
    assert "BNE conn allowed.test:18180 ok" in r["layer_conns"]


def test_a_kernel_without_nf_tables_names_what_is_missing(runs: Any) -> None:
    """Debian's kernel with its nf_tables modules not loaded: the layer says which piece is
    missing and the daemon's create error names it with its kernel options."""
    r = runs["egress-nonft"]
    assert r["transcript"] == ["BNE missing netlink"], r
    assert r["probe_exit"] == 5
    assert r["error"] == (
        "the agent VM's kernel lacks nf_tables over netlink (CONFIG_NETFILTER,"
        " CONFIG_NETFILTER_NETLINK, CONFIG_NF_TABLES); transparent egress needs nf_tables"
        " with nat and redir built in"
    )


def _kit_run(runs: Any, name: str) -> dict[str, Any]:
    if name not in runs:
        why = f"{name}: needs {', '.join(krunfw_missing())}"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI installs them: a missing one is a broken CI, not a skip
        pytest.skip(why)
    return runs[name]  # type: ignore[no-any-return]


def test_a_busybox_only_guest_runs_the_gate_and_the_bridge_on_the_kit(runs: Any) -> None:
    """libkrunfw's kernel (the one smolvm's users boot), an image of a static busybox and no
    python3 or libc: bottlenet's kit runs the gate (PASS, witnessed on the host) and the
    bridge, and busybox wget reaches the proxy through it (allowed, and refused by it)."""
    r = _kit_run(runs, "kit-busybox")
    assert r["lines"] == ["PASS"] and r["probe_exit"] == 0, r
    assert "link dummy0 dummy 82" in r["links"], r["links"]  # libkrunfw's dummy0, passed
    assert r["witnessed"] == ["unix:/run/bottle/egress.sock"]
    assert r["bridge"] == ["BNB ready 1"]
    steps = r["steps"]
    assert steps["wget-allowed"][0] == 0 and any("allowed page" in x for x in r["output"]), r
    assert steps["wget-denied"][0] == 1 and r["denied_hits"] == 0  # tinyproxy refused it
    assert "wget: server returned error: HTTP/1.1 403 Filtered" in r["output"]
    assert steps["exec-static"][0] == 0 and "hello from a static program" in r["output"]
    assert r["host_accepts"][f"127.0.0.1:{CONTROL_PORT}"] == 0


def test_a_busybox_only_guest_gets_transparent_egress_from_the_kit(runs: Any) -> None:
    """The same guest (no python3, no libc): the kit's ``egress run`` installs the routes and
    nf_tables rules by netlink in libkrunfw's kernel and listens; busybox ``wget`` with no
    proxy variable reaches tinyproxy as ``CONNECT allowed.test:18180`` (the name from the
    layer's resolver) and gets the page, and a raw IP dial arrives as ``CONNECT
    203.0.113.7:443``, which tinyproxy refuses (the client sees a reset)."""
    r = _kit_run(runs, "kit-busybox")
    steps, out = r["steps"], " ".join(r["output"])
    assert "BNE ready" in r["output"], r["output"]
    assert steps["wget-transparent"][0] == 0, r
    assert "BNE conn allowed.test:18180 ok" in out, out
    assert steps["wget-raw-ip"][0] == 1 and "BNE conn 203.0.113.7:443 refused" in out, out
    assert "wget: error getting response: Connection reset by peer" in r["output"]


def test_a_guest_with_no_shell_at_all_runs_the_gate_and_an_exec(runs: Any) -> None:
    """The same kernel, an image with no shell at all (a static program only): the gate
    passes on the kit, and a static program runs under the kit's session wrapper."""
    r = _kit_run(runs, "kit-noshell")
    assert r["lines"] == ["PASS"] and r["probe_exit"] == 0, r
    assert r["witnessed"] == ["unix:/run/bottle/egress.sock"]
    assert r["steps"]["exec-static"][0] == 0 and "hello from a static program" in r["output"]
    assert r["steps"]["no-shell"][0] == 127  # there is no /bin/sh to run
    assert r["kernel"].startswith("6.18."), r["kernel"]  # libkrunfw's, not Debian's


def test_the_kernels_dummy0_passes_down_and_fails_once_up_with_an_address(runs: Any) -> None:
    """libkrunfw's kernel, booted with libkrun's own command line, has dummy0 (its built-in
    dummy driver): down with nothing on it, the gate passes it (kind dummy by rtnetlink, no
    address, no route); brought up with 203.0.113.1/24 as libkrun's init does when its
    transparent socket impersonation is on, the gate fails naming dummy0 and what it carries."""
    r = _kit_run(runs, "kit-noshell")
    assert "iface dummy0" in r["links"] and "link dummy0 dummy 82" in r["links"], r["links"]
    assert r["lines"] == ["PASS"]
    assert "RVM-UP dummy0 ok" in r["console"], r["console"]
    (problem,) = r["tsi_problems"]
    assert problem.startswith(
        "network interface dummy0 in a socket-mode guest (dummy; up; address 203.0.113.1/24"
    ), problem
    assert "routes unicast 203.0.113.0/24" in problem, problem
