"""End to end, no reactor in the test: the real daemon process, the blocking client, bottlenetctl.

The daemon is ``python -m twisted bottlenet --state-dir ... --control unix:...`` (see
``daemon_helpers``), exactly as a unit file starts it.

Creates a forward-only bottle, adds a forward to a local echo server, moves bytes through it,
reads the stats and destroys the bottle.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from bottlenet.control.blocking import BlockingControlClient
from bottlenet.errors import NotFound
from tests.netio import roundtrip

from .daemon_helpers import CLEAN_EXIT, ENV, start_daemon, stop, wait_ready


@pytest.fixture
def tmp() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="bne-")
    yield d
    subprocess.run(["rm", "-rf", d], check=False)


def test_blocking_client_end_to_end(tmp: str, echo_server: int) -> None:
    state = os.path.join(tmp, "state")
    path = os.path.join(tmp, "run", "control.sock")
    proc = start_daemon(state, f"unix:{path}")
    try:
        wait_ready(path, proc)
        with BlockingControlClient(path, timeout=5) as c:
            assert c.hello().protocol == 1
            bottle = c.create_bottle("e2e")
            ep = c.add_forward("e2e", "echo", f"127.0.0.1:{echo_server}")
            assert ep.host == bottle.alias and ep.port
            payload = os.urandom(100_000)
            assert roundtrip(ep.host, ep.port, payload) == payload
            for _ in range(50):
                (stats,) = c.all_stats("e2e")
                if stats.active == 0:
                    break
                time.sleep(0.02)
            assert (stats.accepted, stats.bytes_in, stats.bytes_out) == (1, 100_000, 100_000)
            c.destroy_bottle("e2e")
            with pytest.raises(NotFound):
                c.bottle_status("e2e")
            with pytest.raises(OSError):
                socket.create_connection((ep.host, ep.port), timeout=2).close()
    finally:
        out = stop(proc)
    assert proc.returncode in CLEAN_EXIT, out
    assert "Traceback" not in out
    assert not os.path.exists(path)  # the daemon removed its own socket


def test_bottlenetctl_end_to_end(tmp: str, echo_server: int) -> None:
    state = os.path.join(tmp, "state")
    path = os.path.join(tmp, "run", "control.sock")
    proc = start_daemon(state, f"unix:{path}")

    def ctl(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "bottlenet.cli", "--control", path, *argv],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=60,
        )

    try:
        wait_ready(path, proc)
        assert ctl("bottle", "create", "cli").returncode == 0
        added = ctl("forward", "add", "cli", "echo", "--to", f"127.0.0.1:{echo_server}")
        assert added.returncode == 0, added.stderr
        host, port = added.stdout.strip().rsplit(":", 1)
        assert roundtrip(host, int(port), b"hello bottle") == b"hello bottle"
        time.sleep(0.1)
        stats = json.loads(ctl("stats", "cli", "--json").stdout)
        assert stats[0]["bytes_in"] == len(b"hello bottle")
        table = ctl("forward", "ls").stdout
        assert f"{host}:{port}" in table and "echo" in table
        assert ctl("bottle", "rm", "cli").returncode == 0
        missing = ctl("bottle", "rm", "cli")
        assert missing.returncode == 1 and missing.stderr.startswith("error: NOT_FOUND: ")
    finally:
        stop(proc)
