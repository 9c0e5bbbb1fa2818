"""Transparent egress end to end (issue 37): a real daemon, the fake smolvm's ``exec-netns``
stand-in (a TEST DOUBLE: each network-less "VM" has a network namespace of its own, so the
layer's routes and nf_tables rules run on the host's kernel, in that namespace), and a
recording CONNECT server behind the sidecar's egress socket.

A guest client with no proxy variables dials 203.0.113.7:443 and [2001:db8::1]:443 and a
name; each reaches the named service as CONNECT. A bottle without the key keeps today's
behaviour; a kernel without nf_tables (the fake's ``no-nftables``: a seccomp filter) fails
the create naming what is missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator

import pytest

from tests import netguard
from tests.netio import ConnectProxy

from .vmdaemon import SPEC_TOML, VMDaemon, wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not netguard.active(), reason="exec-netns needs root and the netguard"
)

#: The suite's VM spec with no bridge (an env-free client gets nothing from one) and ``extra``.
SPEC = SPEC_TOML + 'bridge = "none"\n{extra}\n'

#: In the guest, with an empty environment: a raw dial, then what the far end said.
DIAL = (
    "import socket, sys\n"
    "try:\n"
    "    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)\n"
    "    s.sendall(b'x'); print('read', s.recv(100))\n"
    "except OSError as e:\n"
    "    print('error', e.strerror)\n"
)


@pytest.fixture(scope="module")
def recorder() -> Iterator[ConnectProxy]:
    """A CONNECT server on 127.0.0.1 behind the sidecar's egress socket: it keeps each
    request line and refuses every target (403)."""
    r = ConnectProxy(0, lambda target: None)
    yield r
    r.close()


def daemon(recorder: ConnectProxy, *faults: str) -> VMDaemon:
    d = VMDaemon()
    relay = {"/run/bottlenet/egress.sock": f"127.0.0.1:{recorder.port}"}
    d.fake.set_faults("exec-netns", *faults, expose_relay=relay)
    return d.start()


def create(d: VMDaemon, name: str, extra: str) -> subprocess.CompletedProcess[bytes]:
    return d.create(name, SPEC.format(image=d.image, extra=extra))


def dial(d: VMDaemon, bottle: str, host: str, port: int) -> str:
    r = d.ctl("bottle", "exec", bottle, "--", "env", "-i", "python3", "-I", "-c", DIAL, host,
              str(port))  # fmt: skip
    return r.stdout.decode().strip()


@pytest.fixture(scope="module")
def shared(recorder: ConnectProxy) -> Iterator[VMDaemon]:
    d = daemon(recorder)
    try:
        yield d
    finally:
        assert not d.cleanup()


def test_raw_dials_reach_the_named_service_as_connect(
    shared: VMDaemon, recorder: ConnectProxy
) -> None:
    """Created (gate PASS, the layer proven by canaries the host saw); an env-free client's
    dials to 203.0.113.7:443, [2001:db8::1]:443 and a name arrive at the proxy as CONNECT."""
    d = shared
    r = create(d, "t1", 'transparent_egress = "egress"')
    assert r.returncode == 0, (r.stderr, d.log())  # type: ignore[attr-defined]
    b = json.loads(r.stdout)  # type: ignore[attr-defined]
    assert b["probe"] == "PASS"
    assert "transparent egress running (via egress, 0 connects)" in b["bridge"]
    # the canaries were answered by the daemon's witness, never by the sidecar's proxy
    assert recorder.lines == []
    for host, port, line in (
        ("203.0.113.7", 443, "CONNECT 203.0.113.7:443 HTTP/1.1"),
        ("2001:db8::1", 443, "CONNECT [2001:db8::1]:443 HTTP/1.1"),
        ("pypi.example", 8443, "CONNECT pypi.example:8443 HTTP/1.1"),
    ):
        out = dial(d, "t1", host, port)
        assert "reset by peer" in out or out == "read b''", out
        assert wait_for(lambda line=line: line in recorder.lines, 30, line)
    status = d.ctl("bottle", "status", "t1").stdout.decode()
    assert "transparent egress running (via egress, 3 connects)" in status, status
    # bottle stats: one row per target (refused by the proxy), no payload, no canary
    rows = {r["label"]: r for r in json.loads(d.ctl("--json", "stats", "t1").stdout)}
    for target in ("203.0.113.7:443", "[2001:db8::1]:443", "pypi.example:8443"):
        row = rows[f"transparent:{target}"]
        assert (row["accepted"], row["refused"], row["failed"]) == (0, 1, 0), row
    assert "egress" in rows  # the forward's own row is still there
    assert not any("gate.bottlenet.invalid" in label for label in rows)


def test_a_bottle_without_the_key_has_no_layer(shared: VMDaemon, recorder: ConnectProxy) -> None:
    """No ``transparent_egress``: no route at all, as before (ENETUNREACH), nothing sent."""
    d = shared
    before = len(recorder.lines)
    r = create(d, "plain", "")
    assert r.returncode == 0, (r.stderr, d.log())  # type: ignore[attr-defined]
    assert "transparent egress" not in json.loads(r.stdout)["bridge"]  # type: ignore[attr-defined]
    assert dial(d, "plain", "203.0.113.7", 443) == "error Network is unreachable"
    assert len(recorder.lines) == before


def test_a_kernel_without_nf_tables_fails_the_create_naming_it(recorder: ConnectProxy) -> None:
    """The fake's ``no-nftables``: the create fails with EGRESS_LAYER_FAILED naming nf_tables'
    netlink and its kernel options; nothing is left."""
    d = daemon(recorder, "no-nftables")
    try:
        r = create(d, "nonft", 'transparent_egress = "egress"')
        assert r.returncode != 0
        err = r.stderr.decode()  # type: ignore[attr-defined]
        assert "EGRESS_LAYER_FAILED" in err, err
        assert "kernel lacks nf_tables over netlink" in err and "CONFIG_NF_TABLES" in err, err
        assert "torn down" in err, err
        assert d.ctl("--json", "bottle", "list").stdout.strip() in (b"[]", b"")
    finally:
        assert not d.cleanup()


def layer_pids(d: VMDaemon, bottle: str) -> list[int]:
    """The processes running the layer's program in ``bottle``'s agent "VM"."""
    # the kit's ``egress run`` (not the session wrapper around it)
    return [
        pid
        for pid, argv in d.agent_argvs(bottle).items()
        if b"egress" in argv and b"run" in argv and b"session" not in argv
    ]


def test_a_killed_layer_is_restarted_and_carries_again(
    shared: VMDaemon, recorder: ConnectProxy
) -> None:
    """The layer dies (SIGKILL in the guest): the daemon starts it again (an event, the status
    says so) and the next dial reaches the proxy as CONNECT."""
    d = shared
    r = create(d, "t2", 'transparent_egress = "egress"')
    assert r.returncode == 0, (r.stderr, d.log())  # type: ignore[attr-defined]
    (pid,) = layer_pids(d, "t2")
    with d.client(timeout=60) as c:
        c.watch("t2")
        os.kill(pid, signal.SIGKILL)
        for event in c.events("t2", idle=60):
            assert event.kind != "degraded", event
            if event.kind == "bridge_restarted":
                assert "egress layer restarted" in (event.detail or "")
                break
    assert wait_for(lambda: layer_pids(d, "t2") and pid not in layer_pids(d, "t2"), 30, "a layer")
    out = dial(d, "t2", "198.51.100.99", 4443)
    assert "reset by peer" in out or out == "read b''", out
    assert wait_for(lambda: "CONNECT 198.51.100.99:4443 HTTP/1.1" in recorder.lines, 30, "CONNECT")
    status = d.ctl("bottle", "status", "t2").stdout.decode()
    assert "transparent egress running (via egress, 1 connects), restarted 1x" in status, status


def test_a_daemon_restart_starts_the_layer_again(recorder: ConnectProxy) -> None:
    """The daemon stops (its sessions end, the layer with them; the rules stay in the guest)
    and starts again: recovery starts a new layer, which carries the next dial."""
    d = daemon(recorder)
    try:
        assert create(d, "kept", 'transparent_egress = "egress"').returncode == 0, d.log()
        (old,) = layer_pids(d, "kept")
        d.stop()
        wait_for(lambda: old not in layer_pids(d, "kept"), 30, "the old layer to end")
        d.start()
        wait_for(lambda: layer_pids(d, "kept"), 30, "a new layer")
        with d.client() as c:
            wait_for(
                lambda: "transparent egress running" in (c.bottle_status("kept").bridge or ""),
                30,
                "the layer to run",
            )
        out = dial(d, "kept", "198.51.100.98", 4443)
        assert "reset by peer" in out or out == "read b''", out
        line = "CONNECT 198.51.100.98:4443 HTTP/1.1"
        assert wait_for(lambda: line in recorder.lines, 30, line)
    finally:
        assert not d.cleanup()
