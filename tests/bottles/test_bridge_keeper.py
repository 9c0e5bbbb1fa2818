"""The daemon's side of the bridge (``bottlenet.bottles.bridge``) on a Clock, with a stub of
vmctl's attached exec: start, why a start failed, the proof, restarts with back-off, and
giving up after repeated failure."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from bottlenet.bottles.bridge import (
    BACKOFF_FIRST,
    CHECK_AFTER,
    MAX_FAILURES,
    STABLE_SECONDS,
    START_TIMEOUT,
    BridgeKeeper,
    Bridges,
    BridgeSession,
    BridgeState,
    BridgeStatus,
)
from bottlenet.bottles.model import SocketEndpoint
from bottlenet.bridge.script import Bridge, render
from bottlenet.errors import BridgeFailed
from bottlenet.forward.table import ForwardCounters
from vmctl.smolvm import GUEST_ROOT, ExecResult, Machine

ENDPOINTS = (
    SocketEndpoint(
        "egress", 3128, "/s/egress.sock", "/run/bottle/egress.sock", "/s/sidecar/egress.sock"
    ),
)


class _Transport:
    def __init__(self) -> None:
        self.written = b""
        self.signals: list[str] = []

    def write(self, data: bytes) -> None:
        self.written += data

    def signalProcess(self, sig: str) -> None:
        self.signals.append(sig)


class StubSmolvm:
    """Attached execs are recorded sessions the test drives; plain execs answer exit 0."""

    def __init__(self) -> None:
        self.sessions: list[tuple[BridgeSession, _Transport]] = []
        self.execs: list[bytes | None] = []
        self.state = "running"

    def spawn_exec(
        self,
        name: str,
        argv: Sequence[str],
        protocol: Any,
        *,
        user: str | None = None,
        session: Sequence[str] = (),
    ) -> Deferred[Any]:
        assert list(argv) == ["/bin/sh", "-s"] and not session  # no kit: the image's sh
        # the bridge binds guest ports (below 1024 too): as root, whatever the image's USER
        assert user == GUEST_ROOT
        t = _Transport()
        protocol.makeConnection(t)
        self.sessions.append((protocol, t))
        return succeed(t)

    def status(self, name: str) -> Deferred[Machine]:
        return succeed(Machine(name, self.state))

    def exec(self, name: str, argv: Sequence[str], **kw: Any) -> Deferred[ExecResult]:
        assert kw.get("user") == GUEST_ROOT  # the reach check too
        self.execs.append(kw.get("stdin"))
        return succeed(ExecResult(0, b"", b"", 0.1))


class StubTable:
    def __init__(self) -> None:
        self.diverted: list[tuple[str, Any]] = []
        self.seen = 0  # connections the endpoint's listener saw (accepted or refused)

    def get(self, bottle: str, label: str) -> Any:
        return SimpleNamespace(counters=ForwardCounters(self.seen, 0, 0, 0, 0, 0))

    def divert(self, bottle: str, label: str, factory: Any) -> None:
        self.diverted.append((label, factory))


def ready(session: BridgeSession) -> None:
    session.childDataReceived(1, b"BNB ready 1\n")


def end(session: BridgeSession, code: int) -> None:
    reason = ProcessDone(0) if code == 0 else ProcessTerminated(exitCode=code)
    session.processEnded(Failure(reason))


@pytest.fixture
def rig() -> tuple[Clock, StubSmolvm, Bridges]:
    clock = Clock()
    smolvm = StubSmolvm()
    return clock, smolvm, Bridges(clock, smolvm, StubTable())  # type: ignore[arg-type]


def started(rig: tuple[Clock, StubSmolvm, Bridges]) -> BridgeKeeper:
    """The bridge of bottle b1, started and ready: its keeper (the bottle's owner holds it)."""
    _, smolvm, bridges = rig
    d = Deferred.fromCoroutine(bridges.start("b1", "bn-b1-agent", ENDPOINTS))
    session, _ = smolvm.sessions[-1]
    ready(session)
    assert d.called and isinstance(d.result, BridgeKeeper)
    return d.result


def test_start_feeds_the_script_and_keeps_stdin_open(rig: Any) -> None:
    """The session gets the exact script; stdin is never closed (the bridge's lifeline)."""
    _clock, smolvm, _bridges = rig
    kept = started(rig)
    _, t = smolvm.sessions[0]
    assert t.written == render([Bridge(3128, "/run/bottle/egress.sock")])
    assert kept.status().state is BridgeState.RUNNING


@pytest.mark.parametrize(
    ("out", "code", "why"),
    [
        (b"BNB notool\n", 4, "no python3 in the agent image"),
        (b"BNB bind 3128 EADDRINUSE\n", 3, "guest port 3128 could not be bound (EADDRINUSE)"),
        (b"BNB bind 3128 $(reboot)\n", 3, "it ended before it was ready (exit 3)"),
        (b"", 1, "it ended before it was ready (exit 1)"),
    ],
)
def test_a_failed_start_names_the_reason(rig: Any, out: bytes, code: int, why: str) -> None:
    """Only validated words of the guest's output reach the error."""
    _clock, smolvm, bridges = rig
    d = Deferred.fromCoroutine(bridges.start("b1", "bn-b1-agent", ENDPOINTS))
    session, _ = smolvm.sessions[0]
    session.childDataReceived(1, out)
    end(session, code)
    f = d.result
    d.addErrback(lambda _: None)
    assert isinstance(f.value, BridgeFailed) and why in f.value.message


def test_a_start_that_never_gets_ready_is_stopped(rig: Any) -> None:
    """No ready line within the start timeout: the session is ended."""
    clock, smolvm, bridges = rig
    Deferred.fromCoroutine(bridges.start("b1", "bn-b1-agent", ENDPOINTS)).addErrback(lambda _: None)
    _, t = smolvm.sessions[0]
    clock.advance(START_TIMEOUT)
    assert t.signals == ["TERM"]


def test_the_proof_fails_when_the_host_saw_nothing(rig: Any) -> None:
    """The reach check ran but the diverted listener saw no witness line: BRIDGE_FAILED."""
    _clock, smolvm, bridges = rig
    d = Deferred.fromCoroutine(bridges.prove("b1", "bn-b1-agent", ENDPOINTS))
    f = d.result
    d.addErrback(lambda _: None)
    assert isinstance(f.value, BridgeFailed)
    # the port, its service, and the cause the host can see (issue 27 item 3)
    assert f.value.message.endswith(
        "127.0.0.1:3128 (egress): bottlenet's listener at /s/egress.sock never saw the "
        "connection (a grant or uid problem)"
    )
    assert smolvm.execs and b"BNP-WITNESS" in (smolvm.execs[0] or b"")
    # diverted to the witness, then back to the relay
    assert [label for label, _ in bridges.table.diverted] == ["egress", "egress"]
    assert bridges.table.diverted[-1][1] is None


def test_a_dead_bridge_is_restarted_with_back_off(rig: Any) -> None:
    """It dies: after the back-off a new session starts; once ready, on_restarted is told."""
    clock, smolvm, bridges = rig
    kept = started(rig)
    told: list[str] = []
    kept = bridges.keep(
        kept, "b1", "bn-b1-agent", ENDPOINTS, on_restarted=told.append, on_failed=told.append
    )
    end(smolvm.sessions[0][0], 137)
    assert kept.status().state is BridgeState.RESTARTING
    assert len(smolvm.sessions) == 1
    clock.advance(BACKOFF_FIRST)
    assert len(smolvm.sessions) == 2
    ready(smolvm.sessions[1][0])
    assert told == ["bridge restarted in bn-b1-agent (1x)"]
    assert kept.status().state is BridgeState.RUNNING
    assert kept.status().restarts == 1


def test_repeated_failure_gives_up_and_says_why(rig: Any) -> None:
    """Every restart dies at once: after MAX_FAILURES the keeper stops and on_failed is told."""
    clock, smolvm, bridges = rig
    kept = started(rig)
    failed: list[str] = []
    kept = bridges.keep(
        kept, "b1", "bn-b1-agent", ENDPOINTS, on_restarted=failed.append, on_failed=failed.append
    )
    end(smolvm.sessions[0][0], 1)
    for _ in range(MAX_FAILURES * 2):
        clock.advance(60)
        session = smolvm.sessions[-1][0]
        if not session.ended.called:
            end(session, 4)
    assert len(smolvm.sessions) == MAX_FAILURES
    assert kept.status().state is BridgeState.FAILED
    assert len(failed) == 1 and failed[0].startswith("bridge failed: ")
    assert f"gave up after {MAX_FAILURES} failures" in failed[0]


def test_stop_ends_the_session_and_nothing_restarts(rig: Any) -> None:
    """A stopped bridge (destroy, degrade, daemon stop) is not restarted."""
    clock, smolvm, _bridges = rig
    kept = started(rig)
    kept.stop()
    session, t = smolvm.sessions[0]
    assert t.signals == ["TERM"]
    end(session, 143)
    clock.advance(3600)
    assert len(smolvm.sessions) == 1
    assert kept.status().state is BridgeState.STOPPED


def test_a_bridge_kept_with_no_keeper_is_started_again_unproven(rig: Any) -> None:
    """After a daemon restart the bottle holds no keeper: ``keep`` makes one and starts the
    bridge again (no reach check: the workload already runs); a stopped keeper is replaced."""
    _clock, smolvm, bridges = rig
    told: list[str] = []
    for old in (None, started(rig)):
        if old is not None:
            old.stop()
        before = len(smolvm.sessions)
        kept = bridges.keep(
            old, "b1", "bn-b1-agent", ENDPOINTS, on_restarted=told.append, on_failed=told.append
        )
        assert kept is not old and kept.status().state is BridgeState.RESTARTING
        assert len(smolvm.sessions) == before + 1 and smolvm.execs == []
        ready(smolvm.sessions[-1][0])
        assert kept.status() == BridgeStatus(BridgeState.RUNNING, restarts=1)
    assert told == ["bridge restarted in bn-b1-agent (1x)"] * 2


def _restarts_after(clock: Clock, smolvm: StubSmolvm, delay: float) -> bool:
    """The next restart comes exactly ``delay`` seconds on: not at half of it, at all of it
    (halves of the power-of-two delays are exact on the Clock)."""
    before = len(smolvm.sessions)
    clock.advance(delay / 2)
    if len(smolvm.sessions) != before:
        return False
    clock.advance(delay / 2)
    return len(smolvm.sessions) == before + 1


def test_a_bridge_that_ran_stable_between_deaths_is_never_given_up(rig: Any) -> None:
    """A run of STABLE_SECONDS resets the count (tests-3 R02): a bridge that dies now and then
    (here more than MAX_FAILURES times, each after a stable run) is restarted every time, each
    after the first back-off again."""
    clock, smolvm, bridges = rig
    kept = started(rig)
    failed: list[str] = []
    kept = bridges.keep(
        kept, "b1", "bn-b1-agent", ENDPOINTS, on_restarted=lambda _: None, on_failed=failed.append
    )
    for death in range(1, MAX_FAILURES + 2):
        clock.advance(STABLE_SECONDS)
        end(smolvm.sessions[-1][0], 137)
        assert kept.status().state is BridgeState.RESTARTING
        assert _restarts_after(clock, smolvm, BACKOFF_FIRST)
        ready(smolvm.sessions[-1][0])
        assert kept.status() == BridgeStatus(BridgeState.RUNNING, restarts=death)
    assert failed == []


def test_the_back_off_doubles_between_deaths_in_a_row(rig: Any) -> None:
    """Deaths in a row wait 0.5, 1, 2, 4 s (docs/sidecar.md: doubling, tests-3 R04); the
    fifth in a row gives up (the 30 s cap is beyond MAX_FAILURES' reach)."""
    clock, smolvm, bridges = rig
    kept = started(rig)
    kept = bridges.keep(
        kept, "b1", "bn-b1-agent", ENDPOINTS, on_restarted=lambda _: None, on_failed=lambda _: None
    )
    end(smolvm.sessions[-1][0], 137)
    for delay in (0.5, 1.0, 2.0, 4.0):
        assert _restarts_after(clock, smolvm, delay)
        end(smolvm.sessions[-1][0], 1)  # dies before it is ready
    assert kept.status().state is BridgeState.FAILED


def test_a_restart_that_completes_after_the_stop_ends_its_session(rig: Any) -> None:
    """The bottle's bridge is stopped while a restart is still spawning (before smolvm runs
    the exec, so there is nothing to signal yet): once that session comes up it is ended
    at once, never kept running for a bridge nobody watches (tests-3 R18)."""
    clock, smolvm, bridges = rig
    kept = started(rig)
    told: list[str] = []
    kept = bridges.keep(
        kept, "b1", "bn-b1-agent", ENDPOINTS, on_restarted=told.append, on_failed=told.append
    )
    pending: list[tuple[Any, Deferred[Any]]] = []

    def spawn_later(name: str, argv: Sequence[str], protocol: Any, **kw: Any) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        pending.append((protocol, d))
        return d

    smolvm.spawn_exec = spawn_later  # type: ignore[method-assign]
    end(smolvm.sessions[-1][0], 137)
    clock.advance(BACKOFF_FIRST)
    assert len(pending) == 1
    kept.stop()
    protocol, d = pending[0]
    t = _Transport()
    protocol.makeConnection(t)  # smolvm runs the exec only now
    d.callback(t)
    ready(protocol)
    assert t.signals == ["TERM"]
    assert told == [] and kept.status().state is BridgeState.STOPPED


def test_a_bridges_output_is_kept_to_its_cap_whatever_one_read_brings() -> None:
    """One 64 KiB read of the guest's output keeps MAX_OUTPUT bytes, not the read (R01)."""
    session = BridgeSession(b"")
    session.childDataReceived(1, b"x" * 65536)
    session.childDataReceived(1, b"BNB ready 1\n")
    assert len(session._out) == BridgeSession.MAX_OUTPUT
    assert not session.ready.called  # past the cap nothing more is read


def test_a_bridge_whose_vm_died_is_not_restarted_and_says_why(rig: Any) -> None:
    """The session ended because the agent VM stopped (smolvm: connection to VM lost, exit
    1): on_failed is told at once that the VM is gone, and nothing is restarted against it."""
    clock, smolvm, bridges = rig
    kept = started(rig)
    told: list[str] = []
    kept = bridges.keep(
        kept, "b1", "bn-b1-agent", ENDPOINTS, on_restarted=told.append, on_failed=told.append
    )
    smolvm.state = "stopped"
    end(smolvm.sessions[0][0], 1)
    assert told == [
        "agent VM bn-b1-agent is stopped (it stopped or crashed): its sessions ended with it "
        "(connection to VM lost)"
    ]
    assert kept.status().state is BridgeState.FAILED
    clock.advance(3600)
    assert len(smolvm.sessions) == 1


def test_connections_the_host_never_saw_are_ended_and_seen_ones_are_not(rig: Any) -> None:
    """The bridge reports each connection; the host's listener saw the first but not the two
    after it: ``down 3128`` goes to the bridge (its unanswered clients get EOF), once."""
    clock, smolvm, bridges = rig
    started(rig)
    session, t = smolvm.sessions[0]
    sent = len(t.written)
    session.childDataReceived(1, b"BNB conn 3128\n")
    bridges.table.seen += 1
    clock.advance(CHECK_AFTER)
    assert t.written[sent:] == b""  # seen: nothing to do
    session.childDataReceived(1, b"BNB conn 3128\nBNB co")
    session.childDataReceived(1, b"nn 3128\nBNB conn 99999999\n")
    clock.advance(CHECK_AFTER)
    assert t.written[sent:] == b"down 3128\n"
    clock.advance(CHECK_AFTER * 10)
    assert t.written[sent:] == b"down 3128\n"  # nothing new was reported
