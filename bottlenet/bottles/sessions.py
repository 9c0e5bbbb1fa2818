"""A cap on the attached sessions launchers hold in one agent VM (issue 27 item 4).

smolvm's guest agent serves 8 connections at once (1.9.3, ``MAX_CONCURRENT_CONNECTIONS``):
an exec holds one while it runs, smolvm's state ping one, bottlenet two for good (bridge,
workload waiter) and one now and then (``verify``, a reach check, a bridge restart). Uncapped,
six ``bottle exec``/``logs -f`` sessions would make every later exec wait for its timeout. So
a bottle (its owner's :class:`Sessions`) takes at most :data:`SESSION_CAP` launcher sessions
at once; the next is BUSY naming the cap, never queued.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from bottlenet.errors import Busy

#: Connections smolvm's guest agent serves at once (1.9.3); of them, kept for bottlenet's own
#: (the bridge, the waiter, a check or restart) and smolvm's state ping; left for launchers.
AGENT_CONNECTIONS, RESERVED = 8, 4
SESSION_CAP = AGENT_CONNECTIONS - RESERVED


class Sessions:
    """One bottle's launcher sessions held now; past the cap a new one is BUSY."""

    def __init__(self, bottle: str, cap: int = SESSION_CAP) -> None:
        self.bottle, self.cap, self.held = bottle, cap, 0

    def session(self, inner: Any) -> CountedSession:
        """``inner`` counted as one of the bottle's sessions, or BUSY naming the cap."""
        if self.held >= self.cap:
            raise Busy(
                f"bottle {self.bottle} already has {self.cap} exec/logs sessions open, the most "
                f"one agent VM takes at once (smolvm's guest agent serves {AGENT_CONNECTIONS} "
                f"connections; {RESERVED} are kept for bottlenet's bridge, workload waiter, "
                "checks and smolvm's state ping): retry when one ends"
            )
        self.held += 1
        return CountedSession(inner, self)


class CountedSession(ProcessProtocol):
    """``inner`` as smolvm's child sees it; its slot back at its end (or release: once)."""

    def __init__(self, inner: Any, sessions: Sessions) -> None:
        self.inner, self.sessions, self.released = inner, sessions, False

    def release(self) -> None:
        if not self.released:
            self.released, self.sessions.held = True, self.sessions.held - 1

    def makeConnection(self, transport: Any) -> None:
        self.transport = transport
        self.inner.makeConnection(transport)

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        self.inner.childDataReceived(childFD, data)

    def childConnectionLost(self, childFD: int) -> None:
        self.inner.childConnectionLost(childFD)

    def processExited(self, reason: Failure) -> None:
        self.inner.processExited(reason)

    def processEnded(self, reason: Failure) -> None:
        self.release()
        self.inner.processEnded(reason)
