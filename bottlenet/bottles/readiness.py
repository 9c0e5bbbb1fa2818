"""Wait until each sidecar service answers before anything uses it (issue 27 item 10).

smolvm binds a sidecar's exposed host socket (or its published port) in the VM process before
the guest app listens, and the guest agent drops every host connection it cannot dial the app
for (1.9.3 ``publish_socket.rs`` ``serve_expose`` -> ``dial_app``); ``machine start`` returns
once the sidecar's container is started, not listening. The egress policy's reload right
after the start, and the launch gate's early ``CONNECT``, would race a slow proxy.

So after the sidecar starts, each service is tried: a connection that is still open after
:data:`SETTLE` seconds has reached its app (a dropped one closes at once). An exposed socket
lives in the sidecar VMM uid's own directory, where that uid can put anything: the probe opens
the name without following a link (``O_PATH|O_NOFOLLOW``), refuses what is not a socket, and
connects to that very inode (``/proc/self/fd/N``), so the daemon never connects through a link
the VMM planted, nor to a socket swapped in after the check. The services are
tried together, so a round costs one :data:`SETTLE`, not one per service. Tries back off from
:data:`BACKOFF_FIRST` to :data:`BACKOFF_MAX` on the injected clock, for at most
:data:`TIMEOUT` seconds in all; a service that never answers fails the create with
``SIDECAR_NOT_READY`` naming it, and the create's undo removes the sidecar.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred, FirstError, gatherResults
from twisted.internet.endpoints import TCP4ClientEndpoint, UNIXClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.python.failure import Failure

from bottlenet.errors import SidecarNotReady
from bottlenet.paths import proc_fd

#: Seconds a connection must stay open to count as reaching the app.
SETTLE = 0.25
#: The first pause between tries, doubled up to BACKOFF_MAX.
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 2.0
#: The most seconds the sidecar's services get to answer, all together.
TIMEOUT = 60.0
#: One connect's own bound.
CONNECT_TIMEOUT = 5

#: ``answers(reactor, target)``: does the service behind ``target`` (its exposed socket's
#: path, or its raw port on 127.0.0.1) answer now?
Answers = Callable[[Any, "str | int"], Awaitable[bool]]


class _Held(Protocol):
    def __init__(self) -> None:
        self.lost: Deferred[bool] = Deferred()

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        if not self.lost.called:
            self.lost.callback(False)


def _socket_at(path: str) -> int | None:
    """An ``O_PATH`` descriptor of the socket at ``path`` itself (a link is not followed), or
    None when there is none (nothing, a link, a file, a FIFO...)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISSOCK(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


async def answers(reactor: Any, target: str | int) -> bool:
    """A connection to ``target`` that the far side does not drop within :data:`SETTLE`; a
    path must be a socket itself, and the connect goes to that inode."""
    pinned = None
    if isinstance(target, int):
        endpoint: Any = TCP4ClientEndpoint(reactor, "127.0.0.1", target, CONNECT_TIMEOUT)
    else:
        pinned = _socket_at(target)
        if pinned is None:
            return False
        endpoint = UNIXClientEndpoint(reactor, proc_fd(pinned), CONNECT_TIMEOUT)
    held = _Held()
    try:
        await connectProtocol(endpoint, held)
    except Exception:
        return False
    finally:
        if pinned is not None:
            os.close(pinned)

    def settled() -> None:
        if not held.lost.called:
            held.lost.callback(True)

    timer = reactor.callLater(SETTLE, settled)
    try:
        return await held.lost
    finally:
        if timer.active():
            timer.cancel()
        transport: Any = held.transport
        if transport is not None:
            transport.abortConnection()


async def _one(probe: Answers, reactor: Any, target: str | int) -> bool:
    return await probe(reactor, target)


async def _try_all(
    reactor: Any, services: Sequence[tuple[str, str | int]], probe: Answers
) -> list[bool]:
    """One try of every service, all at once; a probe's own error is raised as it was."""
    tries = [Deferred.fromCoroutine(_one(probe, reactor, target)) for _, target in services]
    try:
        return await gatherResults(tries, consumeErrors=True)
    except FirstError as e:
        raise e.subFailure.value from None


async def wait_ready(
    reactor: Any,
    services: Sequence[tuple[str, str | int]],
    *,
    probe: Answers = answers,
    timeout: float = TIMEOUT,
) -> None:
    """Return once every ``(name, target)`` answers; SIDECAR_NOT_READY names those that did
    not within ``timeout`` seconds."""
    deadline = reactor.seconds() + timeout
    waiting = list(services)
    pause = BACKOFF_FIRST
    while True:
        answered = await _try_all(reactor, waiting, probe)
        waiting = [s for s, ok in zip(waiting, answered, strict=True) if not ok]
        if not waiting:
            return
        left = deadline - reactor.seconds()
        if left <= 0:
            names = ", ".join(name for name, _ in waiting)
            raise SidecarNotReady(
                f"the sidecar's service(s) {names} did not answer within {timeout:g} s of its "
                "start (the VM process binds each socket before the service listens, and drops "
                "connections until it does): check that the sidecar image starts them"
            )
        await deferLater(reactor, min(pause, left), lambda: None)
        pause = min(BACKOFF_MAX, pause * 2)
