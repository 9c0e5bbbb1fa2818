"""The transparent egress layer on the host's kernel, in a network namespace of its own.

One run of ``tests/transparent/rig.py`` (lo only, a stand-in CONNECT proxy on a UNIX socket,
the layer as the daemon runs it, real clients with an empty environment); each test reads
one client's outcome from it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reset(outcome: list[str]) -> bool:
    """Reset by the far end: after the connect returned, or (a reset that came before the
    client's thread ran again) as the connect's own error."""
    return outcome[0] in ("2", "3") and outcome[1].endswith("Connection reset by peer")


@pytest.fixture(scope="module")
def rig() -> dict[str, Any]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("the layer's netns tests need root and unshare")
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        p = subprocess.run(
            ["unshare", "--net", sys.executable, "-m", "tests.transparent.rig", out],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        with open(out) as fh:
            result: dict[str, Any] = json.load(fh)
    finally:
        os.unlink(out)
    assert result["layer"] == "BNE ready", result
    return result


def test_clients_that_ignore_proxy_variables_reach_an_allowed_name(rig: dict[str, Any]) -> None:
    """urllib with an empty environment, curl --noproxy '*' and busybox wget get the page
    behind the proxy, through the fake resolver and the redirect."""
    assert rig["urllib"] == ["0", "HELLO host=example.test path=/no-proxy"]
    assert rig["curl"] == ["0", "HELLO host=example.test path=/curl"]
    if "wget" in rig:
        assert rig["wget"] == ["0", "HELLO host=example.test path=/wget"]
    assert rig["concurrent"] == 16


def test_raw_dials_reach_the_proxy_as_connect_ip_port_and_are_reset(rig: dict[str, Any]) -> None:
    """203.0.113.7:443 and [2001:db8::1]:443 arrive as CONNECT ip:port; refused, the client
    sees a reset after its connect (the redirect completes the handshake)."""
    assert "CONNECT 203.0.113.7:443 HTTP/1.1" in rig["proxy"]
    assert "CONNECT [2001:db8::1]:443 HTTP/1.1" in rig["proxy"]
    assert reset(rig["v4"]) and reset(rig["v6"])
    assert "CONNECT denied.test:8080 HTTP/1.1" in rig["proxy"]  # a name, never resolved
    assert "BNE conn 203.0.113.7:443 refused" in rig["reports"]
    assert "BNE conn [2001:db8::1]:443 refused" in rig["reports"]
    assert "BNE conn example.test:80 ok" in rig["reports"]


def test_udp_and_icmp_fail_at_once(rig: dict[str, Any]) -> None:
    """UDP (but DNS) and ICMP to the outside get EPERM from the filter chain."""
    assert rig["udp"] == ["1", "sendto Operation not permitted"]
    assert rig["udp6"] == ["1", "sendto Operation not permitted"]
    assert rig["ping"][0] != "0" and "not permitted" in rig["ping"][1]


def test_a_direct_connect_to_the_listener_is_refused(rig: dict[str, Any]) -> None:
    """Not redirected, it would loop: the listener resets it and asks no proxy."""
    assert reset(rig["direct"])
    assert "BNE conn - loop" in rig["reports"]
    assert not any("127.0.0.1" in r for r in rig["proxy"])


def test_a_root_that_removes_the_rules_loses_its_egress_and_nothing_else(
    rig: dict[str, Any],
) -> None:
    """After the table is deleted: IPv4 dials hang, IPv6 ones are unreachable, loopback works."""
    assert rig["remove"][0] == "0"
    assert rig["after-v4"][0] == "2"  # timed out (the SYN loops via lo)
    assert rig["after-v6"] == ["2", "connect Network is unreachable"]
    assert rig["after-loopback"] == ["0", "HELLO host=127.0.0.1:18090 path=/lo"]
    assert rig["layer_exit"] == 0  # its stdin ended: the lifeline
