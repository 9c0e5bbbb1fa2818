"""The per-bottle cap on launcher sessions (``bottles/sessions.py``, issue 27 item 4)."""

from __future__ import annotations

import pytest
from twisted.internet.error import ProcessDone
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from bottlenet.bottles.sessions import AGENT_CONNECTIONS, RESERVED, CountedSession, SessionSlots
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
    slots = SessionSlots()
    assert slots.cap == AGENT_CONNECTIONS - RESERVED < AGENT_CONNECTIONS - 2
    held = [slots.take("b1") for _ in range(slots.cap)]
    with pytest.raises(Busy, match=f"already has {slots.cap} exec/logs sessions open"):
        slots.take("b1")
    slots.take("b2")  # another bottle's VM has its own agent
    held[0].release()
    held[0].release()
    assert slots.held("b1") == slots.cap - 1
    slots.take("b1")
    with pytest.raises(Busy):
        slots.take("b1")


def test_counted_session_passes_everything_and_frees_its_slot_at_the_end() -> None:
    """The inner protocol hears its child as before; the slot is free once the child ended."""
    slots = SessionSlots(cap=1)
    inner = _Recorder()
    counted = CountedSession(inner, slots.take("b1"))
    counted.makeConnection(object())
    counted.childDataReceived(1, b"x")
    assert slots.held("b1") == 1
    counted.processEnded(Failure(ProcessDone(0)))
    assert inner.heard == ["made", (1, b"x"), "ended"] and slots.held("b1") == 0
