"""A cap on the attached sessions launchers hold in one agent VM (issue 27 item 4).

smolvm's guest agent serves 8 connections at once; the 9th waits in its accept loop (1.9.3
``crates/smolvm-agent/src/main.rs`` ``run_server_with_listener``,
``MAX_CONCURRENT_CONNECTIONS``; 1.32.2's value is not in its strings). Every ``machine exec``
holds one while it runs, and so does smolvm's own 250 ms state ping. bottlenet holds two for
good per agent VM (the bridge session and the workload waiter) and one now and then (the
launch gate's ``verify``, the bridge's reach check or its restart). Without a cap, six
``bottle exec``/``bottle logs -f`` sessions would make every later exec -- bottlenet's own
included -- wait until its timeout, and ``machine ls`` would call the VM ``unreachable``.

So a bottle takes at most :data:`SESSION_CAP` launcher sessions (``Exec`` and ``Logs``) at
once; the next is refused at once with ``BUSY`` naming the cap, never queued.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from bottlenet.errors import Busy

#: Connections smolvm's guest agent serves at once (1.9.3).
AGENT_CONNECTIONS = 8
#: Kept for bottlenet's own: the bridge, the workload waiter, one gate/reach check/bridge
#: restart, and smolvm's state ping.
RESERVED = 4
#: Launcher sessions one agent VM takes at once.
SESSION_CAP = AGENT_CONNECTIONS - RESERVED


class SessionSlots:
    """How many launcher sessions each bottle holds; :meth:`take` refuses past the cap."""

    def __init__(self, cap: int = SESSION_CAP) -> None:
        self.cap = cap
        self._held: dict[str, int] = {}

    def held(self, bottle: str) -> int:
        return self._held.get(bottle, 0)

    def take(self, bottle: str) -> Slot:
        """One slot of ``bottle``'s, or BUSY naming the cap."""
        if self.held(bottle) >= self.cap:
            raise Busy(
                f"bottle {bottle} already has {self.cap} exec/logs sessions open, the most "
                f"one agent VM takes at once (smolvm's guest agent serves {AGENT_CONNECTIONS} "
                f"connections; {RESERVED} are kept for bottlenet's bridge, workload waiter, "
                "checks and smolvm's state ping): retry when one ends"
            )
        self._held[bottle] = self.held(bottle) + 1
        return Slot(self, bottle)

    def _release(self, bottle: str) -> None:
        left = self.held(bottle) - 1
        if left > 0:
            self._held[bottle] = left
        else:
            self._held.pop(bottle, None)


class Slot:
    """One held session slot; :meth:`release` gives it back (twice is once)."""

    def __init__(self, slots: SessionSlots, bottle: str) -> None:
        self._slots = slots
        self.bottle = bottle
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._slots._release(self.bottle)


class CountedSession(ProcessProtocol):
    """``inner`` as smolvm's child sees it, the slot given back when the child has ended."""

    def __init__(self, inner: Any, slot: Slot) -> None:
        self.inner = inner
        self.slot = slot

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
        self.slot.release()
        self.inner.processEnded(reason)
