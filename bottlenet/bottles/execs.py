"""A launcher's sessions in a bottle's agent VM (``Exec``, ``Logs``), admitted up to its cap.

The registry says which bottle a command may run in (``exec_target``: NOT_FOUND, BUSY,
DEGRADED); this module admits the session against the bottle's own count (``sessions.py``:
BUSY past the cap, never queued) and runs it (``attach.py``). A slot is held until the child ends,
whoever ends it. bottlenet's own execs (the bridge, the workload waiter) take no slot: the cap
leaves room for them.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.interfaces import IProcessProtocol, IProcessTransport

from bottlenet.bottles import attach
from bottlenet.bottles.attach import ExecRequest
from bottlenet.bottles.host import VMHost
from bottlenet.bottles.model import Bottle
from bottlenet.bottles.sessions import CountedSession

#: The bottle's own count: ``inner`` as one of its sessions, or BUSY past its cap.
Session = Callable[[IProcessProtocol], CountedSession]


async def spawn_exec(
    host: VMHost | None,
    bottle: Bottle,
    session: Session,
    request: ExecRequest,
    protocol: IProcessProtocol,
    stdio: tuple[int, int, int] | None = None,
) -> IProcessTransport:
    """Run ``request`` in the bottle's agent VM, ``protocol`` attached to its stdio (or the
    command on the fds ``stdio``, ``protocol`` told only of its end), holding one of the
    bottle's sessions (``session``) until its child ends; BUSY past the cap."""
    counted = session(protocol)
    try:
        return await attach.spawn_exec(host, bottle, request, counted, stdio=stdio)
    except BaseException:
        counted.release()
        raise


async def spawn_logs(
    host: VMHost | None,
    bottle: Bottle,
    session: Session,
    tail: int,
    follow: bool,
    protocol: IProcessProtocol,
) -> IProcessTransport:
    """``tail`` of the workload's log in the agent VM, ``protocol`` attached (one session)."""
    request = attach.logs_request(bottle, tail, follow)
    return await spawn_exec(host, bottle, session, request, protocol)
