"""The ``/metrics`` listener: the site behind its connection cap, listening as the daemon's
other sockets do (a failed listen is fatal), its own socket kept out of every forward's reach.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IListeningPort
from twisted.python.failure import Failure

from bottlenet.ops.listening import ListeningService
from bottlenet.ops.metrics import (
    CallStats,
    CappedFactory,
    CommandStats,
    MetricsEndpoint,
    MetricsSource,
    metrics_site,
)

if TYPE_CHECKING:
    from bottlenet.forward.targets import OwnSockets

#: (kind, reason, count) rows of refused connections, as ``render_metrics`` reports them.
Refusals = Callable[[], Iterable[tuple[str, str, int]]]


def metrics_listener(
    reactor: Any,
    spec: MetricsEndpoint,
    cap: int,
    source: MetricsSource,
    recorders: tuple[CallStats, CommandStats],
    refusals: Refusals,
    own: OwnSockets,
    on_fatal: Callable[[str], None],
) -> ListeningService:
    """The ``metrics`` listener; ``refusals`` are the other listeners' rows (its own follow).

    Its address joins ``own`` (no forward may target it): a UNIX path now, a TCP port once
    bound (port 0 resolves then).
    """

    def all_refusals() -> list[tuple[str, str, int]]:
        return [*refusals(), ("metrics", "cap", capped.refused)]

    site = metrics_site(source, reactor, *recorders, all_refusals)
    capped = CappedFactory(site, cap, reactor)
    listener = ListeningService(
        "metrics", spec.describe(), spec.endpoint(reactor), capped, on_fatal
    )
    if spec.kind == "unix":
        own.add_unix(spec.path)
    else:
        interface = spec.interface

        def listening(port: IListeningPort) -> None:
            own.add_tcp(interface, int(getattr(port.getHost(), "port", 0)))

        def failed(failure: Failure) -> None:
            """Handled: the listener's on_fatal has said it, in one line."""

        listener.when_listening().addCallbacks(listening, failed)
    return listener
