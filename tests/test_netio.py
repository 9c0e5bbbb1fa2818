"""The shared real-process helpers themselves (tests/netio.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.netio import OutputReader, echo_server, refusing_socket, roundtrip

# Both lines reach the pipe in one write, then the child stays quiet (as a daemon does).
TWO_LINES = "import sys, time; sys.stdout.write('starting\\nlistening on 7\\n'); sys.stdout.flush(); time.sleep(30)"  # noqa: E501


def test_a_line_that_arrives_with_another_is_not_lost() -> None:
    proc = subprocess.Popen([sys.executable, "-c", TWO_LINES], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        reader = OutputReader(proc.stdout.fileno())
        assert reader.wait_for(rb"starting", 20)
        assert reader.wait_for(rb"listening on (\d+)", 2).group(1) == b"7"
        with pytest.raises(AssertionError, match="listening"):
            reader.wait_for(rb"listening on", 0.3)  # each match is consumed once
    finally:
        proc.kill()
        proc.wait()


def test_roundtrip_of_more_than_the_socket_buffers_hold() -> None:
    payload = os.urandom(8 << 20)
    with echo_server() as port:
        assert roundtrip("127.0.0.1", port, payload, timeout=30) == payload
        assert roundtrip("127.0.0.1", port, b"") == b""


def test_a_refusing_port_refuses_and_cannot_be_taken_while_held() -> None:
    """A connect to it is refused, and no listener can bind its port while it is held."""
    import errno
    import socket

    held = refusing_socket()
    try:
        port = held.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with pytest.raises(OSError) as taken:
            socket.create_server(("127.0.0.1", port)).close()
        assert taken.value.errno == errno.EADDRINUSE
    finally:
        held.close()
