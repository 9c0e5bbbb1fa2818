"""ONE service for "listen on this endpoint, or the daemon must not run on".

The control socket, the TLS control listener and ``/metrics`` all need the same thing, which
``StreamServerEndpointService`` does not give: a listen that fails (or an endpoint that cannot
even be built from its description) ends the daemon through one ``on_fatal`` callback (the
daemon passes :func:`bottlenet.ops.fatal.fatal_stopper`), and whoever must wait for the port
(readiness, tests) can ask :meth:`ListeningService.when_listening`.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IStreamServerEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure

from bottlenet.errors import ListenError, listen_reason
from bottlenet.waiters import OneShot

#: Builds the endpoint at start (a description is parsed then, so its error is a listen error).
EndpointMaker = Callable[[], IStreamServerEndpoint]


def describe_port(port: IListeningPort) -> str:
    """Where a port listens, as a plain string (the JSON log cannot carry address objects)."""
    host = port.getHost()
    where = getattr(host, "name", None) or getattr(host, "host", None)
    if isinstance(where, bytes):
        where = where.decode("utf-8", "replace")
    number = getattr(host, "port", None)
    if number is not None:
        return f"{where}:{number}"
    return str(where)


class ListeningService(Service):
    """Listens on one endpoint while running; a failed listen is fatal, in one clear line.

    ``what`` names the listener in every line (``control``, ``control-tls``, ``metrics``);
    ``where`` is how the operator wrote it, for the failure message. ``endpoint`` is an
    endpoint or a zero-argument callable that builds one at start. A :class:`ListenError`
    carries its own message; any other failure is named by its type and text.
    """

    log = Logger()

    def __init__(
        self,
        what: str,
        where: str,
        endpoint: IStreamServerEndpoint | EndpointMaker,
        factory: IProtocolFactory,
        on_fatal: Callable[[str], None],
    ) -> None:
        self._what = what
        self._where = where
        self._endpoint = endpoint
        self._factory = factory
        self._on_fatal = on_fatal
        self.port: IListeningPort | None = None
        self.failed: str | None = None
        self._listened: OneShot[IListeningPort] = OneShot()

    def when_listening(self) -> Deferred[IListeningPort]:
        """Fires with the listening port, or fails with the listen error (each caller its own)."""
        return self._listened.when_fired()

    def _settle(self, outcome: IListeningPort | Failure) -> None:
        if self._listened.fired:
            # A restart: the earlier outcome stayed readable until this one replaces it.
            self._listened = OneShot()
        self._listened.fire(outcome)

    def startService(self) -> None:
        super().startService()
        if callable(self._endpoint) and not IStreamServerEndpoint.providedBy(self._endpoint):
            try:
                endpoint = self._endpoint()
            except Exception:
                self._failed(Failure())
                return
        else:
            endpoint = self._endpoint
        endpoint.listen(self._factory).addCallbacks(self._listening, self._failed)

    def _listening(self, port: IListeningPort) -> None:
        self.port = port
        self.log.info("{what}: listening on {where}", what=self._what, where=describe_port(port))
        self._settle(port)

    def _failed(self, failure: Failure) -> None:
        exc = failure.value
        if isinstance(exc, ListenError):
            why = str(exc)
        else:  # a taken port reads as the forwards' do: EADDRINUSE (Address already in use)
            why = listen_reason(exc) or f"{type(exc).__name__}: {exc}"
        message = f"{self._what}: cannot listen on {self._where}: {why}"
        self.failed = why
        # No line of its own: on_fatal logs the one line (and prints it once on stderr).
        self._settle(failure)
        self._on_fatal(message)

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        port, self.port = self.port, None
        if port is None:
            return None
        return port.stopListening()
