"""The per-bottle cap on launcher sessions (``bottles/sessions.py``, issue 27 item 4)."""

from __future__ import annotations

import pytest
from twisted.internet.error import ProcessDone
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from bottlenet.bottles.sessions import AGENT_CONNECTIONS, RESERVED, Sessions
from bottlenet.errors import Busy


class _Recorder(ProcessProtocol):
    def __init__(self) -> None:
        self.heard: list[object] = []

    def connectionMade(self) -> None:
        self.heard.append("made")

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        self.heard.append((childFD, data))

    def processEnded(self, reason: Failure) -> None:
        self.heard.append("ended")


def test_cap_leaves_room_for_bottlenets_own_and_busy_names_it() -> None:
    """The cap is the agent's 8 connections less the ones kept; past it BUSY names the cap,
    per bottle, and a slot given back (twice is once) makes room again."""
    b1, b2 = Sessions("b1"), Sessions("b2")
    assert b1.cap == AGENT_CONNECTIONS - RESERVED < AGENT_CONNECTIONS - 2
    held = [b1.session(_Recorder()) for _ in range(b1.cap)]
    with pytest.raises(Busy, match=f"already has {b1.cap} exec/logs sessions open"):
        b1.session(_Recorder())
    b2.session(_Recorder())  # another bottle's VM has its own agent
    held[0].release()
    held[0].release()
    assert b1.held == b1.cap - 1
    b1.session(_Recorder())
    with pytest.raises(Busy):
        b1.session(_Recorder())


def test_counted_session_passes_everything_and_frees_its_slot_at_the_end() -> None:
    """The inner protocol hears its child as before; the slot is free once the child ended."""
    sessions = Sessions("b1", cap=1)
    inner = _Recorder()
    counted = sessions.session(inner)
    counted.makeConnection(object())
    counted.childDataReceived(1, b"x")
    assert sessions.held == 1
    counted.processEnded(Failure(ProcessDone(0)))
    assert inner.heard == ["made", (1, b"x"), "ended"] and sessions.held == 0
