"""The suite's no-packet-leaves guard catches what it must (tests/netguard.py)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests import netguard

needs_ns = pytest.mark.skipif(not netguard.active(), reason="the namespace guard needs root")


def test_in_process_connect_to_an_outside_address_is_refused_and_recorded() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with pytest.raises(OSError, match="netguard"):
        s.connect(("192.0.2.1", 9))
    s.close()
    assert netguard.take() == ["connect to ('192.0.2.1', 9)"]


def test_loopback_is_allowed() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(srv.getsockname(), timeout=5)
    c.close()
    srv.close()
    assert netguard.take() == []


@needs_ns
def test_a_child_process_that_dials_out_is_seen() -> None:
    """A child (like the fake smolvm's exec on the host) is in the guarded namespace too."""
    code = (
        "import socket\n"
        "s = socket.socket()\n"
        "s.settimeout(0.5)\n"
        "try: s.connect(('192.0.2.7', 4242))\n"
        "except OSError: pass\n"
    )
    subprocess.run([sys.executable, "-I", "-c", code], check=True, timeout=30)
    assert "tcp 192.0.2.7:4242" in netguard.take()


@needs_ns
def test_name_lookups_go_to_loopback_only() -> None:
    with open("/etc/resolv.conf") as fh:
        assert fh.read() == "nameserver 127.0.0.1\n"
