"""Rate limiting for log lines an outsider can cause: one per key per interval, counted.

It lives in the data plane, where most such lines come from (refused connections, failed
relays), and it imports only Twisted: the control plane (refused peers) and the daemon's
plumbing (``ops.logs`` re-exports it, metrics) use this one implementation.
"""

from __future__ import annotations

from collections.abc import Hashable

from attrs import define, field
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger, LogLevel

_OVERFLOW: Hashable = ("bottlenet.forward.ratelimit", "overflow")


@define
class RateLimiter:
    """Lets one event per key through per ``interval`` seconds and counts the rest.

    Keys must come from validated names (bottle, label, a fixed reason), never raw peer
    input. At most ``max_keys`` keys are tracked; past that, new keys share one slot, so a
    flood of distinct keys still yields at most one line per interval.
    """

    clock: IReactorTime
    interval: float = 1.0
    max_keys: int = 4096
    _last: dict[Hashable, float] = field(factory=dict, init=False)
    _pending: dict[Hashable, int] = field(factory=dict, init=False)

    def allow(self, key: Hashable) -> int | None:
        """None: drop this event. An int: emit it, noting that many were dropped before it."""
        now = self.clock.seconds()
        if key not in self._last and len(self._last) >= self.max_keys:
            self._prune(now)
            if len(self._last) >= self.max_keys:
                key = _OVERFLOW
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._pending[key] = self._pending.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._pending.pop(key, 0)

    def _prune(self, now: float) -> None:
        for k in [k for k, t in self._last.items() if now - t >= self.interval]:
            if k not in self._pending:
                del self._last[k]

    def has_pending(self) -> bool:
        """Whether some key has dropped events not yet reported."""
        return bool(self._pending)

    def take_suppressed(self) -> dict[Hashable, int]:
        """Counts dropped since each key's last emitted event whose interval has passed.

        Those keys are reset, so a periodic caller reports each dropped event exactly once.
        """
        now = self.clock.seconds()
        done = {
            k: n for k, n in self._pending.items() if now - self._last.get(k, now) >= self.interval
        }
        for k in done:
            del self._pending[k]
            del self._last[k]
        return done


class RateLimitedLogger:
    """A :class:`Logger` front that rate-limits per key and reports what it dropped.

    ``log.warn(("refused", bottle, label), "refused {bottle}/{label}: {reason}", ...)`` emits
    the first event at once; repeats within the interval are counted, and the next one that
    gets through carries ``suppressed=N`` and says so in its text. Call :meth:`flush`
    periodically (or at stop) to report counts for keys that went quiet; with ``auto_flush``
    the logger does it itself with a one-shot timer that exists only while something was
    dropped (no periodic wakeup in an idle daemon).
    """

    def __init__(
        self,
        log: Logger,
        clock: IReactorTime,
        interval: float = 1.0,
        max_keys: int = 4096,
        *,
        auto_flush: bool = False,
    ) -> None:
        self._log = log
        self._clock = clock
        self._interval = interval
        self._auto_flush = auto_flush
        self._timer: IDelayedCall | None = None
        self.limiter = RateLimiter(clock, interval, max_keys)

    def emit(self, level: LogLevel, key: Hashable, format: str, **kwargs: object) -> bool:
        """Emit unless rate-limited; True if emitted."""
        suppressed = self.limiter.allow(key)
        if suppressed is None:
            if self._auto_flush and self._timer is None:
                self._timer = self._clock.callLater(self._interval, self._flush_due)
            return False
        if suppressed:
            format += " ({suppressed} similar suppressed)"
        self._log.emit(level, format, suppressed=suppressed, **kwargs)
        return True

    def _flush_due(self) -> None:
        self._timer = None
        self.flush()
        if self.limiter.has_pending():
            self._timer = self._clock.callLater(self._interval, self._flush_due)

    def debug(self, key: Hashable, format: str, **kwargs: object) -> bool:
        return self.emit(LogLevel.debug, key, format, **kwargs)

    def info(self, key: Hashable, format: str, **kwargs: object) -> bool:
        return self.emit(LogLevel.info, key, format, **kwargs)

    def warn(self, key: Hashable, format: str, **kwargs: object) -> bool:
        return self.emit(LogLevel.warn, key, format, **kwargs)

    def error(self, key: Hashable, format: str, **kwargs: object) -> bool:
        return self.emit(LogLevel.error, key, format, **kwargs)

    def flush(self, level: LogLevel = LogLevel.info) -> int:
        """One summary event per quiet key that still has dropped events; returns how many."""
        counts = self.limiter.take_suppressed()
        if self._timer is not None and not self.limiter.has_pending():
            if self._timer.active():
                self._timer.cancel()
            self._timer = None
        for key, n in counts.items():
            self._log.emit(
                level,
                "{suppressed} similar events suppressed ({ratelimit_key})",
                suppressed=n,
                ratelimit_key=_describe_key(key),
            )
        return len(counts)


def _describe_key(key: Hashable) -> str:
    parts = key if isinstance(key, tuple) else (key,)
    # Keys are validated names; the log observers escape every field on output anyway.
    return "/".join(str(p) for p in parts)
