"""The daemon's side of the bridge (``bottlenet.bottles.bridge``) on a Clock, with a stub of
vmctl's attached exec: start, why a start failed, the proof, restarts with back-off, and
giving up after repeated failure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from bottlenet.bottles.bridge import (
    BACKOFF_FIRST,
    MAX_FAILURES,
    START_TIMEOUT,
    Bridges,
    BridgeSession,
    BridgeState,
)
from bottlenet.bottles.model import SocketEndpoint
from bottlenet.bridge.script import Bridge, render
from bottlenet.errors import BridgeFailed
from vmctl.smolvm import GUEST_ROOT, ExecResult

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

    def spawn_exec(
        self, name: str, argv: Sequence[str], protocol: Any, *, user: str | None = None
    ) -> Deferred[Any]:
        assert list(argv) == ["/bin/sh", "-s"]
        # the bridge binds guest ports (below 1024 too): as root, whatever the image's USER
        assert user == GUEST_ROOT
        t = _Transport()
        protocol.makeConnection(t)
        self.sessions.append((protocol, t))
        return succeed(t)

    def exec(self, name: str, argv: Sequence[str], **kw: Any) -> Deferred[ExecResult]:
        assert kw.get("user") == GUEST_ROOT  # the reach check too
        self.execs.append(kw.get("stdin"))
        return succeed(ExecResult(0, b"", b"", 0.1))


class StubTable:
    def __init__(self) -> None:
        self.diverted: list[tuple[str, Any]] = []

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


def started(rig: tuple[Clock, StubSmolvm, Bridges]) -> Deferred[None]:
    _, smolvm, bridges = rig
    d = Deferred.fromCoroutine(bridges.start("b1", "bn-b1-agent", ENDPOINTS))
    session, _ = smolvm.sessions[-1]
    ready(session)
    return d


def test_start_feeds_the_script_and_keeps_stdin_open(rig: Any) -> None:
    """The session gets the exact script; stdin is never closed (the bridge's lifeline)."""
    _clock, smolvm, bridges = rig
    d = started(rig)
    assert d.called and d.result is None
    _, t = smolvm.sessions[0]
    assert t.written == render([Bridge(3128, "/run/bottle/egress.sock")])
    assert bridges.status("b1").state is BridgeState.RUNNING


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
    assert "127.0.0.1:3128 (egress)" in f.value.message
    assert smolvm.execs and b"BNP-WITNESS" in (smolvm.execs[0] or b"")
    # diverted to the witness, then back to the relay
    assert [label for label, _ in bridges.table.diverted] == ["egress", "egress"]
    assert bridges.table.diverted[-1][1] is None


def test_a_dead_bridge_is_restarted_with_back_off(rig: Any) -> None:
    """It dies: after the back-off a new session starts; once ready, on_restarted is told."""
    clock, smolvm, bridges = rig
    started(rig)
    told: list[str] = []
    bridges.keep("b1", "bn-b1-agent", ENDPOINTS, on_restarted=told.append, on_failed=told.append)
    end(smolvm.sessions[0][0], 137)
    assert bridges.status("b1").state is BridgeState.RESTARTING
    assert len(smolvm.sessions) == 1
    clock.advance(BACKOFF_FIRST)
    assert len(smolvm.sessions) == 2
    ready(smolvm.sessions[1][0])
    assert told == ["bridge restarted in bn-b1-agent (1x)"]
    assert bridges.status("b1").state is BridgeState.RUNNING
    assert bridges.status("b1").restarts == 1


def test_repeated_failure_gives_up_and_says_why(rig: Any) -> None:
    """Every restart dies at once: after MAX_FAILURES the keeper stops and on_failed is told."""
    clock, smolvm, bridges = rig
    started(rig)
    failed: list[str] = []
    bridges.keep(
        "b1", "bn-b1-agent", ENDPOINTS, on_restarted=failed.append, on_failed=failed.append
    )
    end(smolvm.sessions[0][0], 1)
    for _ in range(MAX_FAILURES * 2):
        clock.advance(60)
        session = smolvm.sessions[-1][0]
        if not session.ended.called:
            end(session, 4)
    assert len(smolvm.sessions) == MAX_FAILURES
    assert bridges.status("b1").state is BridgeState.FAILED
    assert len(failed) == 1 and failed[0].startswith("bridge failed: ")
    assert f"gave up after {MAX_FAILURES} failures" in failed[0]


def test_stop_ends_the_session_and_nothing_restarts(rig: Any) -> None:
    """A stopped bridge (destroy, degrade, daemon stop) is not restarted."""
    clock, smolvm, bridges = rig
    started(rig)
    bridges.stop("b1")
    session, t = smolvm.sessions[0]
    assert t.signals == ["TERM"]
    end(session, 143)
    clock.advance(3600)
    assert len(smolvm.sessions) == 1
    assert bridges.status("b1").state is BridgeState.STOPPED
