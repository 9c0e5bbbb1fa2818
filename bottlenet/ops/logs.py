"""Log output for the daemon: line-per-event JSON, escaped text, and rate limiting.

- JSON: one object per line, **without** the RFC 7464 ``\\x1e`` record separator that
  ``twist --log-format=json`` puts before each record (journald and line-based shippers keep
  it as a stray byte). ``json.dumps`` escapes control characters, so a record is always one line.
- Text: Twisted's classic ``timestamp [system] message`` lines, but no field can put a raw
  newline, carriage return, escape sequence or other control character into the output
  (log injection); they become visible escapes such as ``\\n`` and ``\\x1b``.
- :class:`RateLimitedLogger`: one event per key per interval, with the number suppressed
  reported on the next one, so a flood of refused connections costs a few lines.

twist and twistd own the global log beginner, so the format is chosen through their own
options (see :func:`install_log_format`), not by replacing observers after the fact.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Hashable, MutableMapping
from typing import IO, Any

from attrs import define, field
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import (
    FileLogObserver,
    FilteringLogObserver,
    ILogObserver,
    LogEvent,
    Logger,
    LogLevel,
    LogLevelFilterPredicate,
    formatEventAsClassicLogText,
    formatTime,
    jsonFileLogObserver,
    timeFormatRFC3339,
)
from twisted.python.usage import UsageError
from zope.interface import provider

LOG_FORMATS = ("json", "text")

# C0 controls, DEL, C1 controls, Unicode line/paragraph separators and bidi overrides: anything
# that can end a line, move the cursor, or reorder what a person reads in a terminal.
_UNSAFE_RE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
# After Twisted's classic formatting, "\n" followed by "\t" is its continuation marker
# (tracebacks, multi-line values); every other newline or control character is escaped.
_UNSAFE_FORMATTED_RE = re.compile(
    "\n(?!\t)|[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(m: re.Match[str]) -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def escape_controls(text: str) -> str:
    """``text`` with every control/line-breaking character replaced by a visible escape."""
    if _UNSAFE_RE.search(text) is None:  # the common case costs one regex scan
        return text
    return _UNSAFE_RE.sub(_escape_char, text)


def sanitize_event(event: LogEvent) -> LogEvent:
    """A copy of ``event`` whose string fields are escaped (``event`` itself if none need it).

    ``log_format`` is left alone: it is a literal in our code, not data.
    """
    changed: dict[str, str] | None = None
    for key, value in event.items():
        if isinstance(value, str) and key != "log_format" and _UNSAFE_RE.search(value):
            if changed is None:
                changed = {}
            changed[key] = escape_controls(value)
    if changed is None:
        return event
    return {**event, **changed}


def escaping_observer(wrapped: ILogObserver) -> ILogObserver:
    """Wrap any observer so it only ever sees events with escaped string fields."""

    @provider(ILogObserver)
    def observe(event: LogEvent) -> None:
        wrapped(sanitize_event(event))

    return observe


def format_text(event: LogEvent, time_format: str | None = timeFormatRFC3339) -> str | None:
    """One classic text record; newlines only as Twisted's ``"\\n\\t"`` continuations."""
    text = formatEventAsClassicLogText(
        sanitize_event(event), formatTime=lambda t: formatTime(t, time_format)
    )
    if text is None:
        return None
    # Values that are not strings (exceptions, objects) are only turned into text by the
    # formatter, so check the result too; keep the final newline and Twisted's continuations.
    body = text[:-1]
    if _UNSAFE_FORMATTED_RE.search(body):
        body = _UNSAFE_FORMATTED_RE.sub(_escape_char, body)
    return body + "\n"


def text_observer(out: IO[Any], time_format: str | None = timeFormatRFC3339) -> FileLogObserver:
    """Classic text lines with control characters escaped (a ``fileLogObserverFactory``)."""
    return FileLogObserver(out, lambda event: format_text(event, time_format))


def json_observer(out: IO[Any]) -> FileLogObserver:
    """One JSON object per line, no record separator (a ``fileLogObserverFactory``)."""
    return jsonFileLogObserver(out, recordSeparator="")


def _info_and_above(observer: ILogObserver) -> ILogObserver:
    # twistd --logger applies no level filter of its own; twist defaults to info.
    return FilteringLogObserver(observer, [LogLevelFilterPredicate(defaultLogLevel=LogLevel.info)])


def json_logger() -> ILogObserver:
    """For ``twistd --logger=bottlenet.ops.logs.json_logger``: JSON lines on stdout, info and up."""
    return _info_and_above(json_observer(sys.stdout))


def text_logger() -> ILogObserver:
    """For ``twistd --logger=bottlenet.ops.logs.text_logger``: escaped text, info and up."""
    return _info_and_above(text_observer(sys.stdout))


_FACTORIES: dict[str, Callable[[IO[Any]], ILogObserver]] = {
    "json": json_observer,
    "text": text_observer,
}
_TWISTD_LOGGERS = {
    "json": "bottlenet.ops.logs.json_logger",
    "text": "bottlenet.ops.logs.text_logger",
}


def install_log_format(runner_options: MutableMapping[str, Any] | None, fmt: str | None) -> str:
    """Make twist or twistd log through our observer; call it from the plugin's ``postOptions``.

    ``runner_options`` is the plugin Options' ``parent``: ``TwistOptions`` for ``twist`` or
    ``ServerOptions`` for ``twistd``. Both read their log setting only after the plugin's
    options are parsed, which is what makes this work:

    - twist: ``parent["fileLogObserverFactory"]`` is what ``Runner.startLogging`` calls with
      ``--log-file`` (stdout by default), wrapped in twist's ``--log-level`` filter;
    - twistd: ``parent["logger"]`` is the ``--logger`` dotted name; ``ServerOptions.postOptions``
      (which runs after ours) imports it. Our loggers write to stdout, so twistd must run
      with ``-n`` and without ``--logfile``.

    ``fmt`` None keeps the runner's choice, but swaps twist's text observer for the escaping
    one. Returns a word saying what was done ("twist", "twistd" or "unchanged"). Raises
    :class:`UsageError` (shown by twist/twistd as a usage error) when the runner is neither,
    or when the choice conflicts with twistd's own logging options.
    """
    if fmt is not None and fmt not in LOG_FORMATS:
        raise UsageError(f"--log-format must be one of: {', '.join(LOG_FORMATS)}")
    if runner_options is None:
        if fmt is None:
            return "unchanged"
        raise UsageError("--log-format only works under twist or twistd")
    if "fileLogObserverFactory" in runner_options:  # twist
        if fmt is None:
            if runner_options.get("logFormat") != "text":
                return "unchanged"
            fmt = "text"
        runner_options["fileLogObserverFactory"] = _FACTORIES[fmt]
        runner_options["logFormat"] = fmt
        return "twist"
    if "logger" in runner_options and "nodaemon" in runner_options:  # twistd
        if fmt is None:
            return "unchanged"
        if runner_options["logger"] is not None:
            raise UsageError("--log-format cannot be combined with twistd --logger")
        if not runner_options["nodaemon"]:
            raise UsageError("--log-format writes to stdout: run twistd with -n")
        if runner_options.get("logfile") not in (None, "", "-"):
            raise UsageError("--log-format writes to stdout: drop twistd --logfile")
        runner_options["logger"] = _TWISTD_LOGGERS[fmt]
        return "twistd"
    raise UsageError("--log-format: the runner is neither twist nor twistd; use its log options")


_OVERFLOW: Hashable = ("bottlenet.ops.logs", "overflow")


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
    return "/".join(escape_controls(str(p)) for p in parts)
