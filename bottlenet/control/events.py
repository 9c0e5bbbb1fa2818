"""Bottle events pushed to watching control connections (``Watch`` in, ``Event`` out).

The hub numbers each event (``seq``) and calls ``Event`` on every watching connection, over
the same AMP connection the client used for ``Watch``. Each watcher may have at most
:data:`MAX_UNANSWERED` events it has not answered yet: a client that stops reading (or reads
slower than events happen) is disconnected, so a slow watcher costs the daemon a bounded
amount of memory and never delays anyone else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from twisted.logger import Logger

from bottlenet.bottles.events import BottleEvent
from bottlenet.control.commands import Event
from bottlenet.control.records import EventRecord
from bottlenet.errors import InvalidArgument

MAX_UNANSWERED = 64
#: Distinct bottles one connection may watch by name (a watch of every bottle has no bound to
#: reach): a client cannot grow the daemon's memory one Watch at a time.
MAX_WATCHED = 1024


#: An event as one watcher sees it (None: it does not).
View = Callable[[BottleEvent], BottleEvent | None]


class WatchingConnection(Protocol):
    """What the hub needs of a control connection."""

    def callRemote(self, commandType: Any, *a: Any, **kw: Any) -> Any: ...

    def drop(self, why: str) -> None: ...


class _Watcher:
    """One watching connection; a dropped one is simply no longer in the hub's table."""

    def __init__(self, connection: WatchingConnection) -> None:
        self.connection = connection
        #: Bottles watched on this connection; None stands for every bottle.
        self.bottles: set[str | None] = set()
        self.unanswered = 0
        #: Each event as this peer sees it, None when it may not (a scoped peer: its own
        #: bottles', under its own names); None: every event as it is.
        self.view: View | None = None


class EventHub:
    """Fan-out of bottle events to watching connections, bounded per connection."""

    log = Logger()

    def __init__(
        self,
        subscribe: Callable[[Callable[[BottleEvent], None]], Callable[[], None]],
        *,
        max_unanswered: int = MAX_UNANSWERED,
    ) -> None:
        self.seq = 0
        self.max_unanswered = max_unanswered
        self._watchers: dict[int, _Watcher] = {}
        self._unsubscribe = subscribe(self.publish)

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    def watch(
        self,
        connection: WatchingConnection,
        bottle: str | None = None,
        view: View | None = None,
    ) -> int:
        """Push ``bottle``'s events (every bottle's for None) to ``connection`` too; answers
        the current seq. Several watches on one connection add up. ``view``: each event as
        the peer sees it, or not at all (a scoped peer's; the last watch's holds)."""
        w = self._watchers.get(id(connection))
        if (
            w is not None
            and bottle is not None
            and bottle not in w.bottles
            and len(w.bottles - {None}) >= MAX_WATCHED
        ):
            raise InvalidArgument(
                f"this connection already watches {MAX_WATCHED} bottles by name; "
                "watch every bottle (no bottle argument) instead"
            )
        if w is None:
            w = self._watchers[id(connection)] = _Watcher(connection)
        w.bottles.add(bottle)
        w.view = view
        return self.seq

    def forget(self, connection: object) -> None:
        self._watchers.pop(id(connection), None)

    def close(self) -> None:
        self._unsubscribe()
        self._watchers.clear()

    def publish(self, event: BottleEvent) -> None:
        self.seq += 1
        record = _record(self.seq, event)
        for key, w in list(self._watchers.items()):
            if None not in w.bottles and event.bottle not in w.bottles:
                continue
            shown = record
            if w.view is not None:
                seen = w.view(event)
                if seen is None:
                    continue
                shown = record if seen is event else _record(self.seq, seen)
            if w.unanswered >= self.max_unanswered:
                self._watchers.pop(key, None)
                w.connection.drop(
                    f"event watcher has {w.unanswered} unanswered events (it reads too slowly)"
                )
                continue
            w.unanswered += 1
            self._send(w, shown)

    def _send(self, w: _Watcher, record: EventRecord) -> None:
        def answered(result: object) -> None:
            w.unanswered -= 1
            return None

        try:
            d = w.connection.callRemote(Event, event=record)
        except Exception:
            self.log.failure("control: cannot push an event")
            return
        d.addBoth(answered)


def _record(seq: int, event: BottleEvent) -> EventRecord:
    return EventRecord(
        seq=seq,
        kind=event.kind,
        bottle=event.bottle,
        at=event.at,
        state=event.state,
        detail=event.detail,
        exit_code=event.exit_code,
        creator=event.creator,
    )
