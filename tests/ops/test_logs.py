"""Log observers: one JSON object per line, escaped text, the twist/twistd hook, rate limits."""

from __future__ import annotations

import io
import json
import unicodedata

from hypothesis import given
from hypothesis import strategies as st
from twisted.application.twist._options import TwistOptions
from twisted.internet.task import Clock
from twisted.logger import (
    Logger,
    LogLevel,
    capturedLogs,
    eventsFromJSONLogFile,
    jsonFileLogObserver,
    textFileLogObserver,
)
from twisted.python.failure import Failure
from twisted.python.usage import UsageError
from twisted.scripts.twistd import ServerOptions

from bottlenet.ops import logs

FORGED = "x\n2026-01-01T00:00:00+0000 [bottlenet#critical] fatal: forged\r\x1b[2J"


def _event(fmt: str, **fields: object) -> dict[str, object]:
    return {
        "log_format": fmt,
        "log_time": 1_700_000_000.0,
        "log_level": LogLevel.warn,
        "log_namespace": "test",
        **fields,
    }


def test_escape_controls() -> None:
    assert logs.escape_controls("plain text: ok") == "plain text: ok"
    assert logs.escape_controls("a\nb\rc\td\x00e\x1b[0m\u2028\u202e") == (
        "a\\nb\\rc\\td\\x00e\\x1b[0m\\u2028\\u202e"
    )


@given(st.text())
def test_escape_leaves_no_control_characters(text: str) -> None:
    out = logs.escape_controls(text)
    # No control character (Cc) and no line or paragraph separator (Zl, Zp) survives.
    assert not any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in out)
    if not logs._UNSAFE_RE.search(text):
        assert out is text


def test_text_field_cannot_forge_a_line() -> None:
    line = logs.format_text(_event("refused peer {peer}", peer=FORGED))
    assert line is not None
    assert line.count("\n") == 1 and line.endswith("\n")
    assert "\\n2026-01-01" in line and "\\x1b[2J" in line and "\r" not in line
    # Twisted's own text observer does let it through: the check above can fail.
    out = io.StringIO()
    textFileLogObserver(out)(_event("refused peer {peer}", peer=FORGED))
    assert "\r" in out.getvalue()


def test_text_non_string_values_only_continue_lines() -> None:
    line = logs.format_text(_event("error {e}", e=ValueError("bad\nforged line\x07")))
    assert line is not None
    assert "\nforged" not in line.replace("\n\t", "")
    assert "\x07" not in line and "\\x07" in line


def test_text_traceback_is_indented() -> None:
    try:
        raise RuntimeError("boom\nforged")
    except RuntimeError:
        failure = Failure()
    line = logs.format_text(_event("failed", log_failure=failure))
    assert line is not None
    body = line[:-1]
    assert "Traceback" in body
    assert all(part.startswith("\t") for part in body.split("\n")[1:])


def test_text_observer_writes_lines() -> None:
    out = io.StringIO()
    observer = logs.text_observer(out)
    observer(_event("forward {bottle}/{label} listening", bottle="demo", label="git"))
    assert out.getvalue().endswith("[test#warn] forward demo/git listening\n")


def test_json_one_object_per_line_without_record_separator() -> None:
    out = io.StringIO()
    observer = logs.json_observer(out)
    observer(_event("refused peer {peer}", peer=FORGED))
    observer(_event("second"))
    text = out.getvalue()
    assert "\x1e" not in text
    lines = text.splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["peer"] == FORGED and first["log_format"] == "refused peer {peer}"
    # Twisted's default does put the separator in front of every record.
    default = io.StringIO()
    jsonFileLogObserver(default)(_event("x"))
    assert default.getvalue().startswith("\x1e")
    # Twisted can read our format back as a JSON line sequence.
    events = list(eventsFromJSONLogFile(io.StringIO(text), recordSeparator=""))
    assert [e["log_format"] for e in events] == ["refused peer {peer}", "second"]


def test_zero_argument_loggers_write_stdout_info_and_up(capsys) -> None:  # type: ignore[no-untyped-def]
    observer = logs.json_logger()
    observer({**_event("hello {who}", who="x"), "log_level": LogLevel.info})
    observer({**_event("noise"), "log_level": LogLevel.debug})
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["who"] for line in lines] == ["x"]
    logs.text_logger()({**_event("hi {v}", v="a\nb"), "log_level": LogLevel.info})
    assert capsys.readouterr().out.endswith("hi a\\nb\n")


def test_escaping_observer() -> None:
    seen: list[dict[str, object]] = []
    logs.escaping_observer(seen.append)(_event("{x}", x="a\nb", n=3))  # type: ignore[arg-type]
    assert seen[0]["x"] == "a\\nb" and seen[0]["n"] == 3
    event = _event("clean", x="fine")
    logs.escaping_observer(seen.append)(event)  # type: ignore[arg-type]
    assert seen[1] is event  # nothing copied when nothing needs escaping


# -- the runner hook ----------------------------------------------------------------------


def _twist(*argv: str) -> TwistOptions:
    opts = TwistOptions()
    opts.selectDefaultLogObserver()
    for arg in argv:
        opts.opt_log_format(arg)
    return opts


def test_install_twist_json_and_text() -> None:
    opts = _twist("json")
    assert logs.install_log_format(opts, "json") == "twist"
    assert opts["fileLogObserverFactory"].wrapped is logs.json_observer
    assert logs.install_log_format(opts, "text") == "twist"
    assert opts["fileLogObserverFactory"].wrapped is logs.text_observer


def test_install_twist_default_swaps_text_keeps_json() -> None:
    opts = _twist("text")
    assert logs.install_log_format(opts, None) == "twist"
    assert opts["fileLogObserverFactory"].wrapped is logs.text_observer
    opts = _twist("json")
    before = opts["fileLogObserverFactory"]
    assert logs.install_log_format(opts, None) == "unchanged"
    assert opts["fileLogObserverFactory"].wrapped is before  # twist's own, quieted


def test_install_twistd_sets_logger_before_its_post_options() -> None:
    opts = ServerOptions()
    opts["nodaemon"] = True
    assert logs.install_log_format(opts, "json") == "twistd"
    opts.postOptions()  # what twistd does after the plugin's options: resolve the name
    assert opts["logger"] is logs.json_logger


def test_install_twistd_conflicts_are_usage_errors() -> None:
    opts = ServerOptions()
    for setting, value in [("nodaemon", False), ("logger", "x.y"), ("logfile", "/tmp/x.log")]:
        opts = ServerOptions()
        opts["nodaemon"] = True
        opts[setting] = value
        try:
            logs.install_log_format(opts, "text")
        except UsageError:
            pass
        else:
            raise AssertionError(f"{setting}={value} was accepted")
    assert logs.install_log_format(ServerOptions(), None) == "unchanged"


def test_install_refuses_unknown_format_and_runner() -> None:
    for runner, fmt in [(_twist(), "xml"), (None, "json"), ({}, "json")]:
        try:
            logs.install_log_format(runner, fmt)
        except UsageError:
            continue
        raise AssertionError(f"{runner!r} {fmt} accepted")
    assert logs.install_log_format(None, None) == "unchanged"


# -- rate limiting ------------------------------------------------------------------------


def test_rate_limiter_one_per_key_per_interval() -> None:
    clock = Clock()
    rl = logs.RateLimiter(clock, interval=1.0)
    assert rl.allow("a") == 0
    assert [rl.allow("a") for _ in range(9999)] == [None] * 9999
    assert rl.allow("b") == 0  # keys are independent
    clock.advance(0.999)
    assert rl.allow("a") is None
    clock.advance(0.001)
    assert rl.allow("a") == 10000
    assert rl.allow("a") is None


def test_rate_limiter_bounds_keys() -> None:
    clock = Clock()
    rl = logs.RateLimiter(clock, interval=1.0, max_keys=3)
    assert [rl.allow(k) for k in "abc"] == [0, 0, 0]
    assert rl.allow("d") == 0  # first overflow key gets the shared slot
    assert rl.allow("e") is None  # ...which every other new key shares
    assert len(rl._last) == 4
    clock.advance(1)
    assert rl.allow("f") == 0  # expired quiet keys were pruned to make room
    assert "f" in rl._last


def test_take_suppressed_reports_quiet_keys_once() -> None:
    clock = Clock()
    rl = logs.RateLimiter(clock, interval=1.0)
    rl.allow("a")
    rl.allow("a")
    rl.allow("a")
    assert rl.take_suppressed() == {}  # interval not over yet
    clock.advance(1)
    assert rl.take_suppressed() == {"a": 2}
    assert rl.take_suppressed() == {}
    assert rl.allow("a") == 0


def test_rate_limited_logger_10k_refusals_are_a_few_lines() -> None:
    clock = Clock()
    log = logs.RateLimitedLogger(Logger(namespace="t"), clock, interval=1.0)
    with capturedLogs() as events:
        for i in range(10_000):
            if i % 1000 == 0:
                clock.advance(1)
            log.warn(
                ("refused", "demo", "git"), "refused {bottle}/{label}", bottle="demo", label="git"
            )
        clock.advance(1)
        assert log.flush() == 1
        assert log.flush() == 0
    assert len(events) == 11
    assert events[0]["suppressed"] == 0
    assert events[1]["suppressed"] == 999
    assert "similar suppressed" in events[1]["log_format"]
    assert events[-1]["suppressed"] == 999 and events[-1]["ratelimit_key"] == "refused/demo/git"
    assert sum(e["suppressed"] for e in events) + 10 == 10_000
    assert {e["log_level"] for e in events} == {LogLevel.warn, LogLevel.info}


def test_port_chatter_is_dropped_and_nothing_else() -> None:
    """Twisted's own ``X starting on N`` / ``(TCP Port N Closed)`` lines are dropped; our
    events and any other legacy line pass."""
    from twisted.logger import PredicateResult

    def legacy(text: str) -> dict[str, object]:
        return {"log_namespace": "log_legacy", "log_text": text, "log_format": "{log_text}"}

    for chatter in (
        "_Forward starting on 8077",
        "_QuietSite (CappedFactory) starting on '/s/metrics.sock'",
        "(TCP Port 8077 Closed)",
        "Starting factory <x>",
    ):
        assert logs.not_port_chatter(legacy(chatter)) is PredicateResult.no
    for kept in (
        legacy("something else starting on a bad day: oops"),
        {"log_namespace": "bottlenet.x", "log_text": "_Forward starting on 8077"},
        legacy("Main loop terminated."),
    ):
        assert logs.not_port_chatter(kept) is PredicateResult.maybe
