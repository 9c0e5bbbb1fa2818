"""The daemon with ``--metrics``: the recorders are fed by smolvm calls and control commands.

The daemon runs in process (``tests/bottles/harness.py``: the tap's real service tree, the fake
smolvm, a TEST DOUBLE). ``--metrics tcp:0:interface=127.0.0.1`` logs the port it bound; the test
drives a control command, a relay and the fake smolvm's ``--version`` (which the daemon runs at
start), then scrapes ``/metrics`` and parses it with ``prometheus_client``.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bottlenet.control.blocking import BlockingControlClient
from bottlenet.errors import AlreadyExists
from tests.bottles.harness import DaemonCase, in_thread
from tests.netio import echo_server, roundtrip

METRICS_ON = re.compile(r"metrics: listening on 127\.0\.0\.1:(\d+)")
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape_until(port: int, key: tuple[str, tuple[tuple[str, str], ...]]) -> Samples:
    """Scrape until ``key`` is there (the smolvm probe runs while the daemon starts)."""
    deadline = time.monotonic() + 30
    while True:
        samples = scrape(port)
        if key in samples or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def drive(control: str, echo_port: int) -> None:
    """A created bottle, a refused duplicate, a forward and one relay, as a client does them."""
    with BlockingControlClient(control, timeout=10) as c:
        c.create_bottle("m")
        with pytest.raises(AlreadyExists):
            c.create_bottle("m")
        ep = c.add_forward("m", "echo", f"127.0.0.1:{echo_port}")
        assert ep.host is not None and ep.port is not None
        payload = os.urandom(10_000)
        assert roundtrip(ep.host, ep.port, payload) == payload


def get_metrics_over_unix(path: str) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


class MetricsDaemonTests(DaemonCase):
    async def test_metrics_count_smolvm_calls_control_commands_bottles_and_relays(self) -> None:
        """Scraped /metrics count the start-up smolvm probe, each control command by result,
        the bottle and the relay's connection and bytes."""
        await self.start("--metrics", "tcp:0:interface=127.0.0.1", vm_bottles=False)
        found = METRICS_ON.search(self.log_text())
        assert found is not None, self.log_text()
        port = int(found.group(1))
        version = (("result", "ok"), ("subcommand", "version"))
        count = "bottlenet_smolvm_call_duration_seconds_count"
        before = await in_thread(scrape_until, port, (count, version))
        assert before[(count, version)] >= 1  # the start-up probe (recovery may race it)
        commands = "bottlenet_control_commands_total"
        create_ok = (commands, (("command", "CreateBottle"), ("result", "OK")))
        create_dup = (commands, (("command", "CreateBottle"), ("result", "ALREADY_EXISTS")))
        assert create_ok not in before

        with echo_server() as echo_port:
            await in_thread(drive, self.control, echo_port)

        fwd = (("bottle", "m"), ("forward", "echo"))
        accepted = ("bottlenet_relays_accepted_total", fwd)
        after = await in_thread(scrape_until, port, accepted)
        assert after[create_ok] == 1
        assert after[create_dup] == 1
        assert after[(commands, (("command", "AddForward"), ("result", "OK")))] == 1
        assert after[accepted] == 1
        assert after[("bottlenet_relay_bytes_total", (fwd[0], ("direction", "in"), fwd[1]))] > 0
        assert after[("bottlenet_bottles", (("state", "ready"),))] == 1
        assert after[(count, version)] >= before[(count, version)]
        assert after[("bottlenet_metrics_invalid_series", ())] == 0
        await self.stop()
        assert self.failures_logged() == []

    async def test_metrics_default_to_a_private_unix_socket(self) -> None:
        """Issue 13 item 6: no --metrics: /metrics is a 0600 socket in the 0700 state dir, so no
        other local user reads bottle names or byte counts; TCP needs an explicit --metrics."""
        await self.start(vm_bottles=False)
        path = os.path.join(self.state_dir, "metrics.sock")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(self.state_dir).st_mode) == 0o700
        got = await in_thread(get_metrics_over_unix, path)
        assert got.startswith(b"HTTP/1.0 200") or got.startswith(b"HTTP/1.1 200"), got[:80]
        assert b"bottlenet_build_info" in got
