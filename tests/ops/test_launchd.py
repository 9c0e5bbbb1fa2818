"""The launchd plists parse, say what matters, and the alias script adds exactly the pool."""

from __future__ import annotations

import os
import plistlib
import stat
import subprocess
from pathlib import Path
from typing import Any

from bottlenet.forward.spec import MAX_SUN_PATH, AliasPool

LAUNCHD = Path(__file__).resolve().parents[2] / "contrib" / "launchd"


def load(name: str) -> dict[str, Any]:
    with open(LAUNCHD / name, "rb") as f:
        data = plistlib.load(f)
    assert isinstance(data, dict)
    assert data["Label"] + ".plist" == name  # launchd convention: file named after the label
    return data


def test_agent_runs_twist_bottlenet_unprivileged() -> None:
    agent = load("org.bottlenet.daemon.plist")
    argv = agent["ProgramArguments"]
    assert argv[0].endswith("/venv/bin/twist") and argv[1] == "bottlenet"
    assert "UserName" not in agent and "GroupName" not in agent  # runs as the logged-in user
    control = argv[argv.index("--control") + 1]
    assert control.startswith("unix:/")
    assert len(control.removeprefix("unix:")) <= MAX_SUN_PATH
    assert "--log-format=text" in argv
    # VMs started by the daemon must survive its restart (no process-group kill).
    assert agent["AbandonProcessGroup"] is True
    assert agent["KeepAlive"] == {"SuccessfulExit": False}
    assert agent["RunAtLoad"] is True


def test_alias_daemon_covers_exactly_the_agents_pool(tmp_path: Path) -> None:
    agent = load("org.bottlenet.daemon.plist")
    pool_arg = next(a for a in agent["ProgramArguments"] if a.startswith("--alias-pool="))
    pool = AliasPool.parse(pool_arg.partition("=")[2])

    aliases = load("org.bottlenet.loopback-aliases.plist")
    assert aliases["RunAtLoad"] is True and aliases.get("KeepAlive", False) is False
    shell, flag, script = aliases["ProgramArguments"]
    assert (shell, flag) == ("/bin/sh", "-c")
    # Run the script with a stand-in ifconfig that records its arguments.
    log = tmp_path / "calls"
    fake = tmp_path / "ifconfig"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert "/sbin/ifconfig " in script
    subprocess.run(
        ["/bin/sh", "-c", script.replace("/sbin/ifconfig", str(fake))],
        check=True,
        timeout=30,
        env={"PATH": os.defpath},
    )
    calls = log.read_text().splitlines()
    assert calls == [f"lo0 alias {addr} up" for addr in pool.candidates()]


def test_alias_script_stops_at_the_first_failure(tmp_path: Path) -> None:
    script = load("org.bottlenet.loopback-aliases.plist")["ProgramArguments"][2]
    out = subprocess.run(
        ["/bin/sh", "-c", script.replace("/sbin/ifconfig", "/bin/false")], timeout=30
    )
    assert out.returncode != 0
