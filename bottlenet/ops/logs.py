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
from collections.abc import Callable, MutableMapping
from typing import IO, Any

from twisted.logger import (
    FileLogObserver,
    FilteringLogObserver,
    ILogFilterPredicate,
    ILogObserver,
    LogEvent,
    LogLevel,
    LogLevelFilterPredicate,
    PredicateResult,
    formatEventAsClassicLogText,
    formatTime,
    jsonFileLogObserver,
    timeFormatRFC3339,
)
from twisted.python.usage import UsageError
from zope.interface import provider

# Their old home: RateLimiter and RateLimitedLogger live in forward/ratelimit.py now.
from bottlenet.forward.ratelimit import RateLimitedLogger as RateLimitedLogger
from bottlenet.forward.ratelimit import RateLimiter as RateLimiter

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


#: What Twisted's ports and factories say on their own when they start and stop listening
#: (``_Forward starting on 8077``, ``(TCP Port 8077 Closed)``): private class names, and
#: each already said in words by our own ``... listening on ...`` / ``... removed`` lines.
_PORT_CHATTER_RE = re.compile(
    r"[\w.]+(?: \([\w.]+\))? starting on .+|\(\S+ Port \S+ Closed\)"
    r"|(?:Starting|Stopping) factory .+"
)


@provider(ILogFilterPredicate)
def not_port_chatter(event: LogEvent) -> PredicateResult:
    """Drop Twisted's own listening/closing lines (see :data:`_PORT_CHATTER_RE`)."""
    if event.get("log_namespace") == "log_legacy" and _PORT_CHATTER_RE.fullmatch(
        str(event.get("log_text", ""))
    ):
        return PredicateResult.no
    return PredicateResult.maybe


def without_port_chatter(observer: ILogObserver) -> ILogObserver:
    return FilteringLogObserver(observer, [not_port_chatter])


def _info_and_above(observer: ILogObserver) -> ILogObserver:
    # twistd --logger applies no level filter of its own; twist defaults to info.
    return FilteringLogObserver(
        observer, [LogLevelFilterPredicate(defaultLogLevel=LogLevel.info), not_port_chatter]
    )


def json_logger() -> ILogObserver:
    """For ``twistd --logger=bottlenet.ops.logs.json_logger``: JSON lines on stdout, info and up."""
    return _info_and_above(json_observer(sys.stdout))


def text_logger() -> ILogObserver:
    """For ``twistd --logger=bottlenet.ops.logs.text_logger``: escaped text, info and up."""
    return _info_and_above(text_observer(sys.stdout))


class QuietFactory:
    """A twist ``fileLogObserverFactory`` (``wrapped``) whose observer drops the port chatter."""

    def __init__(self, wrapped: Callable[[IO[Any]], ILogObserver]) -> None:
        self.wrapped = wrapped

    def __call__(self, out: IO[Any]) -> ILogObserver:
        return without_port_chatter(self.wrapped(out))


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
                own = runner_options["fileLogObserverFactory"]
                runner_options["fileLogObserverFactory"] = QuietFactory(own)
                return "unchanged"
            fmt = "text"
        runner_options["fileLogObserverFactory"] = QuietFactory(_FACTORIES[fmt])
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
