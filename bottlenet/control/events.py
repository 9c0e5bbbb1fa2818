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
        #: Which events this peer may see (a scoped peer: its own bottles'); None: all.
        self.visible: Callable[[BottleEvent], bool] | None = None


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
        visible: Callable[[BottleEvent], bool] | None = None,
    ) -> int:
        """Push ``bottle``'s events (every bottle's for None) to ``connection`` too; answers
        the current seq. Several watches on one connection add up. ``visible``: only the
        events it accepts (a scoped peer's)."""
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
        w.visible = visible
        return self.seq

    def forget(self, connection: object) -> None:
        self._watchers.pop(id(connection), None)

    def close(self) -> None:
        self._unsubscribe()
        self._watchers.clear()

    def publish(self, event: BottleEvent) -> None:
        self.seq += 1
        record = EventRecord(
            seq=self.seq,
            kind=event.kind,
            bottle=event.bottle,
            at=event.at,
            state=event.state,
            detail=event.detail,
            exit_code=event.exit_code,
            creator=event.creator,
        )
        for key, w in list(self._watchers.items()):
            if None not in w.bottles and event.bottle not in w.bottles:
                continue
            if w.visible is not None and not w.visible(event):
                continue
            if w.unanswered >= self.max_unanswered:
                self._watchers.pop(key, None)
                w.connection.drop(
                    f"event watcher has {w.unanswered} unanswered events (it reads too slowly)"
                )
                continue
            w.unanswered += 1
            self._send(w, record)

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
