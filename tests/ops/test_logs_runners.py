"""install_log_format under the real runners: `twist` and `twistd -n` in subprocesses.

A throw-away plugin (written to a temp dir) calls install_log_format from its postOptions,
exactly as bottlenet's Options should, logs one hostile field and stops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PLUGIN = """
from twisted.application.service import ServiceMaker
bnlogtest = ServiceMaker("bnlogtest", "bnlogtest_tap", "log format test", "bnlogtest")
"""

TAP = """
from twisted.application.service import Service
from twisted.logger import Logger
from twisted.python import usage
from bottlenet.ops.logs import install_log_format

class Options(usage.Options):
    optParameters = [["log-format", None, None, "json or text"]]

    def postOptions(self):
        install_log_format(self.parent, self["log-format"])

class Hostile(Service):
    log = Logger()

    def startService(self):
        from twisted.internet import reactor
        self.log.info("peer {peer}", peer="x\\nFORGED\\x1b[2J")
        reactor.callLater(0, reactor.stop)

def makeService(options):
    return Hostile()
"""

TWISTD = "import sys; from twisted.scripts.twistd import run; sys.argv[0] = 'twistd'; run()"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    base = tmp_path_factory.mktemp("plugin")
    (base / "twisted" / "plugins").mkdir(parents=True)
    (base / "twisted" / "plugins" / "bnlogtest_plugin.py").write_text(PLUGIN)
    (base / "bnlogtest_tap.py").write_text(TAP)
    return str(base)


def _run(plugin_path: str, argv: list[str], cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([plugin_path, ROOT])}
    out = subprocess.run(
        [sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _json_lines(stdout: str) -> list[dict[str, object]]:
    assert "\x1e" not in stdout
    return [json.loads(line) for line in stdout.splitlines()]


def test_twist_json(plugin_path: str, tmp_path: Path) -> None:
    events = _json_lines(
        _run(plugin_path, ["-m", "twisted", "bnlogtest", "--log-format=json"], tmp_path)
    )
    assert any(e.get("peer") == "x\nFORGED\x1b[2J" for e in events)


def test_twist_text_default_is_escaped(plugin_path: str, tmp_path: Path) -> None:
    out = _run(plugin_path, ["-m", "twisted", "--log-format=text", "bnlogtest"], tmp_path)
    assert "peer x\\nFORGED\\x1b[2J" in out
    assert "\x1b" not in out and "\nFORGED" not in out


def test_twistd_json(plugin_path: str, tmp_path: Path) -> None:
    out = _run(
        plugin_path, ["-c", TWISTD, "-n", "--pidfile=", "bnlogtest", "--log-format=json"], tmp_path
    )
    events = _json_lines(out)
    assert any(e.get("peer") == "x\nFORGED\x1b[2J" for e in events)
    assert not (tmp_path / "twistd.pid").exists()


def test_twistd_logger_option_directly(plugin_path: str, tmp_path: Path) -> None:
    argv = [
        "-c",
        TWISTD,
        "-n",
        "--pidfile=",
        "--logger=bottlenet.ops.logs.json_logger",
        "bnlogtest",
    ]
    events = _json_lines(_run(plugin_path, argv, tmp_path))
    assert any(e.get("peer") == "x\nFORGED\x1b[2J" for e in events)
