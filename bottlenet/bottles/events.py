"""Bottle events (created, ready, degraded, workload exited, destroyed, bridge restarted,
lease expired) and the node's own (drained, undrained: their bottle is empty).

Each bottle's owner emits them (the node's drain gate emits the node's); the bus is the
wire's feed (the control plane's watchers, and tests): no part of the daemon learns a bottle's
life by subscribing (the node's policies hear the owners' outputs, ``bottles.policy``). The
bus only fans out: it keeps no history and never blocks the emitter (a failing subscriber is
logged and skipped).
"""

from __future__ import annotations

from collections.abc import Callable

from attrs import frozen
from twisted.logger import Logger

CREATED = "created"
READY = "ready"
DEGRADED = "degraded"
WORKLOAD_EXITED = "workload_exited"
DESTROYED = "destroyed"
#: bottlenet's in-guest bridge died and was started again (docs/sidecar.md).
BRIDGE_RESTARTED = "bridge_restarted"
#: The daemon destroyed a bottle whose lease ran out (plus its grace): ``node.lease``.
LEASE_EXPIRED = "lease_expired"
#: The sidecar's egress policy refused a connection (``bottles.egresswatch``).
EGRESS_DENIED = "egress_denied"
KINDS = (CREATED, READY, DEGRADED, WORKLOAD_EXITED, DESTROYED, BRIDGE_RESTARTED, LEASE_EXPIRED,
         EGRESS_DENIED)  # fmt: skip
#: Events of the node itself (``node.drain``): their ``bottle`` is empty.
DRAINED = "drained"
UNDRAINED = "undrained"
NODE_KINDS = (DRAINED, UNDRAINED)


@frozen
class BottleEvent:
    kind: str
    bottle: str
    at: float
    state: str | None = None
    detail: str | None = None
    exit_code: int | None = None
    #: The scoped peer that created the bottle (``uid:N``, its ``tenancy.creator``), stamped
    #: by its owner on every event: a scoped peer sees its own bottles' events by it.
    creator: str | None = None


Subscriber = Callable[[BottleEvent], None]


class EventBus:
    """Synchronous fan-out of :class:`BottleEvent` to subscribers."""

    log = Logger()

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Add ``subscriber``; the returned function removes it again (idempotent)."""
        self._subscribers.append(subscriber)

        def unsubscribe() -> None:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

        return unsubscribe

    def emit(self, event: BottleEvent) -> None:
        for subscriber in list(self._subscribers):
            try:
                subscriber(event)
            except Exception:
                self.log.failure("bottle event subscriber failed ({kind})", kind=event.kind)
