"""A launcher's sessions in a bottle's agent VM (``Exec``, ``Logs``), admitted up to its cap.

The registry says which bottle a command may run in (``exec_target``: NOT_FOUND, BUSY,
DEGRADED); this module admits the session against the bottle's slots (``sessions.py``: BUSY
past the cap, never queued) and runs it (``attach.py``). A slot is held until the child ends,
whoever ends it. bottlenet's own execs (the bridge, the workload waiter) take no slot: the cap
leaves room for them.
"""

from __future__ import annotations

from twisted.internet.interfaces import IProcessProtocol, IProcessTransport

from bottlenet.bottles import attach
from bottlenet.bottles.attach import ExecRequest
from bottlenet.bottles.host import VMHost
from bottlenet.bottles.model import Bottle
from bottlenet.bottles.sessions import CountedSession, SessionSlots


class Execs:
    """Every bottle's launcher sessions: admitted per bottle, then run in its agent VM."""

    def __init__(self, host: VMHost | None) -> None:
        self._host = host
        #: Launcher sessions per bottle, capped below the guest agent's limit.
        self.sessions = SessionSlots()

    async def spawn_exec(
        self,
        bottle: Bottle,
        request: ExecRequest,
        protocol: IProcessProtocol,
        stdio: tuple[int, int, int] | None = None,
    ) -> IProcessTransport:
        """Run ``request`` in the bottle's agent VM, ``protocol`` attached to its stdio (or
        the command on the fds ``stdio``, ``protocol`` told only of its end), holding one of
        the bottle's slots until its child ends; BUSY past the cap."""
        slot = self.sessions.take(bottle.name)
        try:
            return await attach.spawn_exec(
                self._host, bottle, request, CountedSession(protocol, slot), stdio=stdio
            )
        except BaseException:
            slot.release()
            raise

    async def spawn_logs(
        self, bottle: Bottle, tail: int, follow: bool, protocol: IProcessProtocol
    ) -> IProcessTransport:
        """``tail`` of the workload's log in the agent VM, ``protocol`` attached (one slot)."""
        return await self.spawn_exec(bottle, attach.logs_request(bottle, tail, follow), protocol)
