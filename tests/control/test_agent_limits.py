"""The agent VM's limits and its death, end to end (issue 27 items 4 and 6): a real daemon,
``bottlenetctl``, the fake smolvm (a TEST DOUBLE) with ``exec-netns`` and its models of smolvm's
guest agent, which serves 8 connections at once (the 9th waits; ``ls`` then says
``unreachable``), and of a VM's death, which ends every attached session with ``connection to
VM lost`` (exit 1) and every guest process. Needs root (``unshare``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from bottlenet.bottles.sessions import SESSION_CAP
from bottlenet.control.blocking import BlockingControlClient
from bottlenet.control.execsession import ExecSession
from bottlenet.control.records import EventRecord
from bottlenet.errors import Busy
from tests import netguard
from tests.fakes import FAKE_SMOLVM, FAST_PATH
from vmctl.uids import registered_vm_uid

from .daemon_helpers import ENV, REPO
from .test_bridge import create, daemon, fetch, page_server
from .vmdaemon import VMDaemon, cmdline, pids_running, wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not netguard.active(), reason="exec-netns needs root and the netguard"
)

#: The workload ends with code 5 once the host drops ``stop`` into the guest's /tmp.
WORKLOAD = 'workload = ["sh", "-c", "while [ ! -e /tmp/stop ]; do sleep 0.1; done; exit 5"]'


def machines(d: VMDaemon, bottle: str | None = None) -> list[dict[str, Any]]:
    """``machine ls --json`` as smolvm's own state ping sees the machines (``bottle``'s)."""
    r = subprocess.run(
        [FAKE_SMOLVM, "machine", "ls", "--json"],
        env={"PATH": FAST_PATH, "SMOLVM_DATA_DIR": d.fake.path},
        capture_output=True,
        timeout=30,
        check=True,
    )
    found: list[dict[str, Any]] = json.loads(r.stdout)
    return [m for m in found if bottle is None or m["labels"].get("bottlenet.bottle") == bottle]


def agent_vm(d: VMDaemon, bottle: str) -> str:
    [name] = [
        m["name"] for m in machines(d, bottle) if m["labels"].get("bottlenet.role") == "agent"
    ]
    return name


@pytest.fixture(scope="module")
def paged() -> Iterator[VMDaemon]:
    """One daemon (with the bridge's page server) for the tests that each make their own
    bottle in it: starting a second one for the same setup was waste."""
    with page_server() as port:
        d = daemon(port).start()
        try:
            yield d
        finally:
            assert not d.cleanup()


def event(c: BlockingControlClient, bottle: str, kind: str) -> EventRecord:
    """The next ``kind`` event of ``bottle`` (``c`` watched it before the cause)."""
    for e in c.events(bottle, idle=60):
        if e.kind == kind:
            return e
    raise AssertionError("unreachable")


def status(d: VMDaemon, bottle: str) -> dict[str, Any]:
    r = d.ctl("--json", "bottle", "status", bottle)
    record: dict[str, Any] = json.loads(r.stdout)["bottle"]
    return record


def test_ten_sessions_past_the_cap_are_busy_and_bottlenet_keeps_its_own(paged: VMDaemon) -> None:
    """Ten concurrent ``bottle exec`` sessions: the ones past the cap get BUSY naming it at
    once; the VM stays reachable, the bridge still carries a fetch and the workload waiter
    still reports the exit; no call hangs."""
    d = paged
    held: list[ExecSession] = []
    try:
        r = create(d, "b1", extra=WORKLOAD)
        assert r.returncode == 0, (r.stderr, d.log())
        busy = []
        for _ in range(10):
            client = d.client(timeout=30)
            try:
                held.append(client.open_exec("b1", ["sleep", "300"], fds=False))
            except Busy as e:
                busy.append(str(e))
                client.close()
        assert (len(held), len(busy)) == (SESSION_CAP, 10 - SESSION_CAP), busy
        assert all(f"already has {SESSION_CAP} exec/logs sessions open" in m for m in busy)
        assert {m["state"] for m in machines(d, "b1")} == {"running"}, machines(d, "b1")
        held.pop().close()
        got = wait_for(lambda: _fetched(d), 60, "a fetch through the bridge")
        assert got.stdout == b"page for http://pages.test/hello\n", got
        with d.client(timeout=60) as c:
            c.watch("b1")
            stop = os.path.join(d.fake.vm_dir(agent_vm(d, "b1")), "guest-tmp", "stop")
            open(stop, "w").close()
            assert event(c, "b1", "workload_exited").exit_code == 5
        record = status(d, "b1")
        assert (record["state"], record["workload_exit_code"]) == ("exited", 5), record
    finally:
        for session in held:
            session.close()


def _fetched(d: VMDaemon) -> Any:
    """A fetch once the closed session's slot is free again (the daemon frees it when the
    session's smolvm child has ended)."""
    got = fetch(d, "b1")
    return got if got.returncode == 0 else None


def test_an_agent_vm_that_dies_takes_its_sessions_and_degrades_the_bottle(
    paged: VMDaemon,
) -> None:
    """The agent VM crashes (its VMM killed): an open ``bottle exec`` ends with smolvm's
    ``connection to VM lost`` (exit 1) rather than hanging, the bottle turns degraded naming
    the agent VM at once (no bridge restarts against a dead VM), and the workload waiter says
    it lost the workload."""
    d = paged
    r = create(d, "b2", extra=WORKLOAD)
    assert r.returncode == 0, (r.stderr, d.log())
    ctl = subprocess.Popen(
        d.ctl_argv("bottle", "exec", "b2", "--", "sh", "-c", "echo up; exec sleep 300"),
        env=ENV,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert ctl.stdout is not None and ctl.stdout.readline() == b"up\n"
    with d.client(timeout=60) as c:
        c.watch("b2")
        os.killpg(d.machine_pid(agent_vm(d, "b2")), signal.SIGKILL)
        _, err = ctl.communicate(timeout=60)
        assert ctl.returncode == 1 and b"connection to VM lost" in err, err
        degraded = event(c, "b2", "degraded")
    assert (degraded.detail or "").startswith("agent VM bn-b2-agent is stopped"), degraded
    assert status(d, "b2")["state"] == "degraded"
    wait_for(
        lambda: "bottle b2: its workload waiter ended without an exit code (agent VM" in d.log(),
        60,
        "the waiter to say it lost the workload",
    )
    assert not [
        line for line in d.log().splitlines() if "bottle b2:" in line and "restarting it in" in line
    ]


#: In the guest: one round trip through the bridged port (the fake sidecar's service echoes).
PING = (
    "import socket; s = socket.create_connection(('127.0.0.1', 3128), timeout=20); "
    "s.sendall(b'ping'); print(s.recv(4) or b'EOF')"
)


def test_a_bridged_connection_the_host_never_sees_gets_eof_and_a_named_cause() -> None:
    """Issue 27 item 3, per-VM uids (the fake's ``uid-drop``: its VMM connects each mounted
    socket as its own uid, and a connect it cannot make hangs in the guest as libkrun's does).
    The endpoint's grant is broken after the create: a round trip through the bridge ends
    with EOF in a few seconds rather than waiting out its own timeout, and the daemon's log
    names the endpoint and the grant problem."""
    d = VMDaemon()
    d.fake.set_faults("exec-netns", "uid-drop")
    d.start()
    try:
        d.create_vm_bottle("b1")
        ping = ["bottle", "exec", "b1", "--", "python3", "-I", "-c", PING]
        assert d.ctl(*ping).stdout == b"b'ping'\n"
        endpoint = os.path.join(d.state, "bottles", "b1", "egress.sock")
        os.chmod(endpoint, 0o600)  # the agent VMM's uid may no longer connect
        got = d.ctl(*ping)
        assert got.stdout == b"b'EOF'\n", got
        log = d.log()  # the daemon logs why before the bridge ends the connection
        assert "bridged connection(s) to egress (guest port 3128) never reached" in log
        assert f"bottlenet's listener at {endpoint} never saw the connection" in log
        agent_uid = registered_vm_uid(d.fake.vm_dir("bn-b1-agent"))
        assert f"cannot write the socket (0600 0:{agent_uid})" in log
    finally:
        assert not d.cleanup()


#: A guest command that ignores stdin and never writes (its sleep is found by its odd length).
QUIET = ["sh", "-c", "echo started; exec sleep 3017"]
#: QUIET's sleep as /proc shows it (found on the host, an orphan included).
SLEEP = b"sleep\x003017\x00"
#: The workload waiter's argv as the guest kit runs it (``workload wait DIR``).
WAITER = b"\x00workload\x00wait\x00/tmp/.bottlenet-workload-"


def test_time_limit_and_daemon_stop_end_quiet_guest_commands() -> None:
    """Issue 27 item 5: smolvm ends a session by killing only ``crun exec``; the session
    wrapper ends the command itself. A quiet command past its ``time_limit`` ends (exit
    124), and at the daemon's stop another one and the workload waiter's loop end too."""
    d = VMDaemon().start()
    try:
        d.create_vm_bottle("b1", workload=["sleep", "301"])
        with d.client(timeout=60) as c:
            session = c.open_exec("b1", QUIET, fds=False, time_limit=3)
            wait_for(lambda: pids_running(SLEEP), 30, "the quiet command")
            wait_for(lambda: "ended: exit 124" in d.log(), 60, "the time limit")
            wait_for(lambda: not pids_running(SLEEP), 30, "the timed-out command to end")
            session.close()
        ctl = subprocess.Popen(
            d.ctl_argv("bottle", "exec", "b1", "--", *QUIET),
            env=ENV,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert ctl.stdout is not None and ctl.stdout.readline() == b"started\n"
        waiter = wait_for(
            lambda: [p for p in d.guest_pids() if WAITER in cmdline(p)],
            30,
            "the workload waiter",
        )
        d.stop()
        ctl.communicate(timeout=60)
        wait_for(lambda: not pids_running(SLEEP), 30, "the command to end with the daemon")
        wait_for(lambda: not set(waiter) & set(d.guest_pids()), 30, "the waiter to end")
    finally:
        assert not d.cleanup()
