"""Admission of TLS control connections before their peer is known.

A TCP connection to the TLS listener is nobody until its handshake has verified a client
certificate. So it never takes one of the control slots (those are for authenticated peers),
it gets :data:`HANDSHAKE_DEADLINE` seconds to finish the handshake, and the unauthenticated
connections are capped per source address and in total. At a cap the oldest *silent*
unauthenticated connection (no byte received yet; of that source, else overall) gives way to
the new one, and only when none is silent the oldest of all: a peer holding connections open
without speaking cannot keep a launcher (whose ClientHello comes at once) from handshaking,
even from the same address; it only churns its own. Every cause is logged through one
rate-limited key (never a traceback, never peer bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attrs import define, field
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from bottlenet.forward.ratelimit import RateLimitedLogger

#: Seconds a TCP peer has, from accept, to complete the TLS handshake with a certificate.
HANDSHAKE_DEADLINE = 5.0
#: Unauthenticated connections one source address may hold at once.
MAX_PENDING_PER_SOURCE = 16
#: Unauthenticated connections all sources together may hold at once.
MAX_PENDING_TOTAL = 128


@define(eq=False)
class _Pending:
    source: str
    abort: Callable[[], None]
    timer: IDelayedCall
    spoke: bool = False


@define
class HandshakeAdmission:
    """Tracks the connections still handshaking; ends the late and the surplus ones."""

    clock: IReactorTime
    log: RateLimitedLogger
    deadline: float = HANDSHAKE_DEADLINE
    per_source: int = MAX_PENDING_PER_SOURCE
    total: int = MAX_PENDING_TOTAL
    #: Connections (keys) in accept order, oldest first.
    _pending: dict[object, _Pending] = field(factory=dict, init=False)
    _per_source: dict[str, int] = field(factory=dict, init=False)
    #: Connections ended by the deadline or a cap (metrics, tests).
    ended: int = field(default=0, init=False)

    @property
    def waiting(self) -> int:
        """Unauthenticated connections held right now."""
        return len(self._pending)

    def admit(self, key: object, source: str, abort: Callable[[], None]) -> None:
        """A TCP connection was accepted; ``abort()`` ends it (it is not authenticated yet)."""
        if self._per_source.get(source, 0) >= self.per_source:
            self._evict(self._victim(source), "source")
        elif len(self._pending) >= self.total:
            self._evict(self._victim(None), "total")
        timer = self.clock.callLater(self.deadline, self._expire, key)
        self._pending[key] = _Pending(source, abort, timer)
        self._per_source[source] = self._per_source.get(source, 0) + 1

    def spoke(self, key: object) -> None:
        """The connection sent its first bytes (a ClientHello, presumably): it is evicted
        only once no silent connection is left to evict."""
        entry = self._pending.get(key)
        if entry is not None:
            entry.spoke = True

    def _victim(self, source: str | None) -> object:
        """The oldest silent connection (of ``source``, or of any), else the oldest."""
        candidates = [
            (k, p) for k, p in self._pending.items() if source is None or p.source == source
        ]
        return next((k for k, p in candidates if not p.spoke), candidates[0][0])

    def settled(self, key: object) -> None:
        """The handshake completed, or the connection is gone: stop tracking it."""
        entry = self._pending.pop(key, None)
        if entry is None:
            return
        if entry.timer.active():
            entry.timer.cancel()
        left = self._per_source[entry.source] - 1
        if left:
            self._per_source[entry.source] = left
        else:
            del self._per_source[entry.source]

    def _expire(self, key: object) -> None:
        entry = self._pending.get(key)
        if entry is None:
            return
        self.log.warn(
            ("tls-handshake", "deadline"),
            "control: closed a TLS connection that did not complete its handshake"
            " within {deadline}s",
            deadline=self.deadline,
        )
        self._end(key, entry)

    def _evict(self, key: object, cap: str) -> None:
        entry = self._pending[key]
        limit = self.per_source if cap == "source" else self.total
        self.log.warn(
            ("tls-handshake", cap),
            "control: closed the oldest unauthenticated TLS connection: {limit} are open"
            " ({cap} cap)",
            limit=limit,
            cap="per-source" if cap == "source" else "total",
        )
        self._end(key, entry)

    def _end(self, key: object, entry: _Pending) -> None:
        self.settled(key)
        self.ended += 1
        entry.abort()


def peer_source(transport: Any) -> str:
    """The source address of a TCP connection (the key of the per-source cap)."""
    host = getattr(transport.getPeer(), "host", None)
    return host if isinstance(host, str) else "?"
