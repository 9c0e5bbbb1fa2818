"""bottlenetctl: output, --json, exit codes (against a real control socket)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial import unittest

from bottlenet.cli.main import default_control, main
from bottlenet.cli.output import report_control_error
from bottlenet.control.clienterrors import DaemonUnreachable
from bottlenet.control.context import ControlContext, UnixAdmission
from bottlenet.control.peercred import default_allowed_uids
from bottlenet.control.server import ControlServerFactory
from bottlenet.tap import control_service
from tests.control.fakes import FakeBackend

reactor: Any = _reactor
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, env=env or {}, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_default_control_rule() -> None:
    assert default_control({"BOTTLENET_CONTROL": "/x.sock"}) == "/x.sock"
    assert default_control({"XDG_RUNTIME_DIR": "/run/user/5"}) == (
        "/run/user/5/bottlenet/control.sock"
    )


def test_unreachable_is_exit_3_with_hint() -> None:
    code, out, err = run(["--control", "/nonexistent/bn/control.sock", "ping"])
    assert code == 3
    assert "hint:" in err and "/nonexistent/bn/control.sock" in err
    assert "Traceback" not in err and out == ""


def test_a_socket_this_uid_may_not_open_is_not_a_daemon_that_is_down() -> None:
    """Issue 30: ``Permission denied`` (a non-root uid outside the socket's group, as seen with
    setpriv against the system layout) says whose socket it is, not "is it running?"."""
    err = io.StringIO()
    e = DaemonUnreachable("/run/bottlenet/control.sock", "Permission denied")
    assert report_control_error(e, "/run/bottlenet/control.sock", err) == 3
    text = err.getvalue()
    assert "is the bottlenet daemon running" not in text
    assert f"does not let uid {os.geteuid()} in" in text and "bottlenet-launch" in text


def test_env_control_used() -> None:
    code, _, err = run(["ping"], env={"BOTTLENET_CONTROL": "unix:/nonexistent/e.sock"})
    assert code == 3 and "/nonexistent/e.sock" in err


def test_usage_errors_exit_2() -> None:
    assert run([])[0] == 2
    assert run(["bottle"])[0] == 2
    assert run(["forward", "add", "b", "web"])[0] == 2  # --to is required
    assert run(["forward", "add", "b", "web", "--to", "127.0.0.1:1", "--port", "x"])[0] == 2
    assert run(["--help"])[0] == 0


def test_console_entry_point_runs_without_reactor() -> None:
    """``python -m bottlenet.cli`` (what the console script runs): exit 3, no traceback."""
    code = (
        "import sys, runpy; sys.argv=['bottlenetctl','--control','/nonexistent/c.sock','ping'];"
        "\ntry:\n runpy.run_module('bottlenet.cli', run_name='__main__')"
        "\nfinally:\n assert 'twisted.internet.reactor' not in sys.modules"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=60,
    )
    assert p.returncode == 3, p.stderr
    assert "Traceback" not in p.stderr


class CLITests(unittest.TestCase):
    def setUp(self) -> None:
        d = tempfile.mkdtemp(prefix="bcl-")
        self.addCleanup(os.rmdir, d)
        self.path = os.path.join(d, "control.sock")
        factory = ControlServerFactory(
            ControlContext(backend=FakeBackend(), server_version="1.2.3", clock=reactor),
            UnixAdmission(default_allowed_uids()),
        )
        svc = control_service(reactor, f"unix:{self.path}", factory, self.fail)
        svc.startService()
        self.addCleanup(lambda: os.unlink(self.path + ".lock"))
        self.addCleanup(svc.stopService)

    def ctl(self, *argv: str) -> Any:
        return deferToThread(run, ["--control", self.path, *argv])

    @inlineCallbacks
    def test_session(self) -> Any:
        code, out, _ = yield self.ctl("ping")
        self.assertEqual((code, out), (0, "ok\n"))
        code, out, _ = yield self.ctl("status")
        self.assertIn("1.2.3", out)
        code, out, _ = yield self.ctl("bottle", "create", "web1")
        self.assertEqual((code, out), (0, "created web1 on 127.77.0.2\n"))
        code, out, _ = yield self.ctl("forward", "add", "web1", "http", "--to", "127.0.0.1:8080")
        self.assertEqual((code, out), (0, "127.77.0.2:43000\n"))
        code, out, _ = yield self.ctl("bottle", "ls")
        lines = out.splitlines()
        self.assertEqual(lines[0].split(), ["NAME", "ALIAS", "SOURCE", "STATE", "FORWARDS"])
        self.assertEqual(lines[1].split(), ["web1", "127.77.0.2", "control", "ready", "1"])
        self.assertEqual(lines[0].index("ALIAS"), lines[1].index("127.77.0.2"))  # aligned
        code, out, _ = yield self.ctl("forward", "ls", "--json")
        self.assertEqual(
            json.loads(out),
            [
                {
                    "bottle": "web1",
                    "label": "http",
                    "target": "127.0.0.1:8080",
                    "endpoint": "127.77.0.2:43000",
                }
            ],
        )
        code, out, _ = yield self.ctl("--json", "stats", "web1")
        self.assertEqual(json.loads(out)[0]["bytes_in"], 5)
        code, out, _ = yield self.ctl("stats")
        self.assertIn("ACCEPTED", out)
        code, out, _ = yield self.ctl("bottle", "status", "web1", "--json")
        self.assertEqual(json.loads(out)["bottle"]["name"], "web1")
        code, out, err = yield self.ctl("bottle", "create", "web1")
        self.assertEqual(code, 1)
        self.assertTrue(err.startswith("error: ALREADY_EXISTS: "), err)
        code, out, err = yield self.ctl("forward", "add", "web1", "x", "--to", "10.0.0.1:80")
        self.assertEqual(code, 1)
        self.assertTrue(err.startswith("error: INVALID_ARGUMENT: "), err)
        code, out, _ = yield self.ctl("forward", "rm", "web1", "http")
        self.assertEqual(code, 0)
        code, out, _ = yield self.ctl("bottle", "rm", "web1", "--json")
        self.assertEqual((code, json.loads(out)), (0, {"destroyed": "web1"}))
        code, out, err = yield self.ctl("bottle", "rm", "web1")
        self.assertEqual(code, 1)
        self.assertIn("NOT_FOUND", err)

    @inlineCallbacks
    def test_json_errors_are_one_json_object(self) -> Any:
        """Under --json a refusal is one JSON object on stderr with the daemon's code."""
        code, out, err = yield self.ctl("--json", "bottle", "rm", "nosuch")
        self.assertEqual((code, out), (1, ""))
        self.assertEqual(json.loads(err), {"code": "NOT_FOUND", "message": "no bottle 'nosuch'"})
        code, _, err = yield self.ctl("bottle", "status", "nosuch", "--json")
        self.assertEqual((code, json.loads(err)["code"]), (1, "NOT_FOUND"))


def test_json_usage_and_unreachable_errors() -> None:
    """Usage errors (code USAGE, exit 2) and an unreachable daemon (UNREACHABLE, exit 3, with
    the hint) are one JSON object each under --json; text without it."""
    code, out, err = run(["--json", "events", "--count", "-1"])
    assert (code, out) == (2, "")
    doc = json.loads(err)
    assert doc["code"] == "USAGE" and "--count" in doc["message"]
    code, _, err = run(["--json", "--control", "/nonexistent/bn/c.sock", "bottle", "ls"])
    doc = json.loads(err)
    assert code == 3 and doc["code"] == "UNREACHABLE"
    assert "/nonexistent/bn/c.sock" in doc["message"] and "hint" in doc
    code, _, err = run(["--json", "--control", "tls:127.0.0.1:1", "ping"])
    assert code == 2 and json.loads(err)["code"] == "USAGE"
    code, _, err = run(["events", "--count", "-1"])
    assert code == 2 and "bottlenetctl events: error: argument --count" in err


def test_a_timeout_not_positive_is_a_usage_error_for_every_command() -> None:
    """``--timeout`` 0 or less is exit 2 with one line, ``bottle logs`` too (it was a
    ValueError traceback from the socket there)."""
    for argv in (["ping"], ["bottle", "logs", "b1"], ["bottle", "exec", "b1", "--", "true"]):
        code, out, err = run(["--control", "/nonexistent/c.sock", "--timeout", "-1", *argv])
        assert (code, out) == (2, "")
        assert err == "bottlenetctl: error: --timeout must be positive\n"


def test_events_count_must_be_positive() -> None:
    """``events --count`` takes 1 or more; 0 and -1 are usage errors, not a silent exit 0."""
    for bad in ("0", "-1", "x"):
        assert run(["--control", "/nonexistent/c.sock", "events", "--count", bad])[0] == 2


def test_default_timeout_is_longer_for_calls_that_wait_on_vms(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each call's limit is its own pace (the VM timeout for calls that wait on VMs), and an
    explicit --timeout is every call's."""
    import io

    from bottlenet.cli import main as cli
    from bottlenet.control import blocking, lightclient
    from bottlenet.control.clienterrors import ControlConnectionError
    from bottlenet.control.records import BottleRecord
    from bottlenet.control.results import Page

    seen: dict[str, float] = {}

    class Recording:
        """A client that connects nowhere: it records each call's limit, answers a listing
        with one bottle (so ``down`` destroys it) and ends the command at any other call."""

        timeout: float
        vm_timeout: float

        def connect(self) -> Any:
            return self

        def call(self, c: Any, *, timeout: float | None = None) -> Any:
            limit = c.limit(self.timeout, self.vm_timeout) if timeout is None else timeout
            seen[c.command] = limit
            if c.command == "ListBottles":
                return Page((BottleRecord("b1", None, "control", "ready", 0.0, 0),), 1, None)
            raise ControlConnectionError("recorded")

    class Blocking(Recording, blocking.BlockingControlClient):
        pass

    class Light(Recording, lightclient.LightControlClient):
        pass

    monkeypatch.setattr(blocking, "BlockingControlClient", Blocking)
    monkeypatch.setattr(lightclient, "LightControlClient", Light)

    def timeout_for(*argv: str) -> dict[str, float]:
        seen.clear()
        cli.main(["--control", "/nonexistent.sock", *argv], out=io.StringIO(), err=io.StringIO())
        return dict(seen)

    assert timeout_for("ping") == {"Ping": cli.DEFAULT_TIMEOUT}
    assert timeout_for("bottle", "ls") == {"ListBottles": cli.DEFAULT_TIMEOUT}
    assert timeout_for("egress", "set", "b1", "example.com") == {"SetEgressPolicy": cli.VM_TIMEOUT}
    assert timeout_for("bottle", "create", "b1") == {"CreateBottle": cli.DEFAULT_TIMEOUT}
    assert timeout_for("down", "--all")["DestroyBottle"] == cli.VM_TIMEOUT
    assert timeout_for("events") == {"Watch": cli.DEFAULT_TIMEOUT}
    assert timeout_for("--timeout", "7", "egress", "set", "b1") == {"SetEgressPolicy": 7.0}


def test_every_subcommand_names_what_runs_it() -> None:
    """Each subcommand's parser names its runner (``set_defaults(run=...)``): the 22 that
    make their calls on one client (``pool ensure|ls|rm`` among them), ``top``, ``exec``,
    ``shell`` and ``logs``."""
    import argparse

    from bottlenet.cli import main as cli
    from bottlenet.cli.invocation import ClientCommand

    runs = []
    parsers = [cli.build_parser()]
    while parsers:
        for action in parsers.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    parsers.append(sub)
                    if not any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                        runs.append(sub.get_default("run"))
    assert None not in runs
    assert len({r.handler for r in runs if isinstance(r, ClientCommand)}) == 22
    assert len(runs) == 22 + 4
    light = {r.handler.__name__ for r in runs if isinstance(r, ClientCommand) and r.light}
    assert light == {"cmd_status", "cmd_ping", "cmd_bottle_ls", "cmd_node_info"}


PARSE_CASES = [
    ["status"],
    ["--json", "--timeout", "5", "bottle", "ls"],
    ["--control", "bottle", "forward", "ls", "b1"],
    ["--cont", "forward", "bottle", "rm", "b1"],
    ["--control=/x.sock", "egress", "set", "b1", "a.example"],
    ["--cert", "c", "--key", "k", "--ca", "a", "bottle", "exec", "b1", "-t"],
    ["forward", "add", "b1", "web", "--to", "127.0.0.1:80", "--port", "81"],
    ["top", "--once"],
    ["down", "--all"],
]


def test_the_parser_for_a_command_reads_it_as_the_whole_parser() -> None:
    """Leaving the other command groups' actions out changes no parse (abbreviations too)."""
    from bottlenet.cli import main as cli

    for words in PARSE_CASES:
        whole = vars(cli.build_parser().parse_args(words))
        assert vars(cli.build_parser(cli.command_word(words)).parse_args(words)) == whole


def test_value_options_are_the_parsers() -> None:
    """command_word skips the values of exactly the global options that take one."""
    from bottlenet.cli import main as cli

    takes_value = {
        option
        for action in cli.build_parser()._actions
        if action.nargs is None and action.option_strings and action.const is None
        for option in action.option_strings
    }
    assert takes_value == set(cli.VALUE_OPTIONS)


def test_bottle_status_table_shows_the_isolation_probe() -> None:
    """A failed ``bottle verify`` is in the human ``bottle status`` table, not only in --json."""
    from bottlenet.cli.main import _bottle_rows
    from bottlenet.control.records import BottleRecord

    b = BottleRecord(
        name="b1",
        alias=None,
        source="control",
        state="ready",
        created_at=0.0,
        forwards=0,
        mode="socket",
        probe="FAIL",
    )
    assert ["isolation probe", "FAIL"] in _bottle_rows(b)
