"""The systemd units: the settings that matter, and `systemd-analyze verify` when available."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "contrib" / "systemd"
FLAVOURS = ("user", "system")


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A small unit-file reader: sections of keys, each with its list of values."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        assert not line.endswith("\\"), f"{path.name}: continuation lines are not expected"
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path.name}: bad line {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section][key]
    assert len(values) == 1, f"{key} set {len(values)} times"
    return values[0]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_key_settings(flavour: str) -> None:
    service = parse_unit(UNITS / flavour / "bottlenet.service")
    socket = parse_unit(UNITS / flavour / "bottlenet.socket")
    assert one(service, "Service", "Type") == "notify"
    assert one(service, "Service", "NotifyAccess") == "main"
    # VMs must survive a daemon stop/restart: only the main process is signalled.
    assert one(service, "Service", "KillMode") == "process"
    assert one(socket, "Socket", "Accept") == "no"
    argv = one(service, "Service", "ExecStart").split()
    assert argv[0].endswith("/bin/twist")
    plugin_args = argv[argv.index("bottlenet") + 1 :]
    assert "--log-format=json" in plugin_args
    control = plugin_args[plugin_args.index("--control") + 1]
    m = re.fullmatch(r"systemd:domain=UNIX:name=(\w+)", control)
    assert m, control
    assert m.group(1) == one(socket, "Socket", "FileDescriptorName") == "control"
    assert one(socket, "Socket", "Service") == "bottlenet.service"


def test_user_units() -> None:
    service = parse_unit(UNITS / "user" / "bottlenet.service")
    socket = parse_unit(UNITS / "user" / "bottlenet.socket")
    assert one(socket, "Socket", "ListenStream") == "%t/bottlenet/control.sock"
    assert one(socket, "Socket", "SocketMode") == "0600"
    assert one(socket, "Socket", "DirectoryMode") == "0700"
    assert one(service, "Service", "ExecStart").startswith(
        "%h/.local/share/bottlenet/venv/bin/twist "
    )
    assert "User" not in service["Service"]


def test_system_units() -> None:
    service = parse_unit(UNITS / "system" / "bottlenet.service")
    socket = parse_unit(UNITS / "system" / "bottlenet.socket")
    listen = one(socket, "Socket", "ListenStream")
    runtime = one(service, "Service", "RuntimeDirectory")
    assert listen == f"/run/{runtime}/control.sock"
    assert one(service, "Service", "RuntimeDirectoryMode") == "0750"
    # Otherwise stopping the daemon deletes the directory holding the socket unit's socket.
    assert one(service, "Service", "RuntimeDirectoryPreserve") == "yes"
    assert one(socket, "Socket", "SocketMode") == "0660"
    assert one(socket, "Socket", "SocketGroup") == "bottlenet-launch"
    assert one(service, "Service", "Group") == "bottlenet-launch"
    assert one(service, "Service", "User") not in ("", "root", "0")


def _header_commands(path: Path) -> list[list[str]]:
    """The shell commands a unit's header comment tells the operator to run (``#   cmd``,
    continuation lines joined)."""
    lines: list[str] = []
    for raw in path.read_text().splitlines():
        if raw.startswith("[Unit]"):
            break
        text = raw[1:].split("#", 1)[0].strip() if raw.startswith("#   ") else ""
        if text and lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1] + " " + text
        elif text and re.match(r"(groupadd|useradd|usermod|python3) ", text):
            lines.append(text)
    return [line.split() for line in lines]


def test_system_install_needs_no_group_the_host_may_lack() -> None:
    """Issue 30: the unit's own install steps worked only where a ``kvm`` group exists
    (``useradd --groups kvm`` exits 6, ``SupplementaryGroups=kvm`` fails the unit): they
    name only the group they create, and /dev/kvm's group is read from the host."""
    path = UNITS / "system" / "bottlenet.service"
    service = parse_unit(path)
    assert "SupplementaryGroups" not in service["Service"]
    commands = _header_commands(path)
    made = {c[-1] for c in commands if c[0] == "groupadd"}
    assert made == {one(service, "Service", "Group")}
    (useradd,) = [c for c in commands if c[0] == "useradd"]
    assert "--groups" not in useradd and "-G" not in useradd
    assert useradd[useradd.index("--gid") + 1] in made
    assert useradd[-1] == one(service, "Service", "User")
    (usermod,) = [c for c in commands if c[0] == "usermod"]
    assert "stat -c %G /dev/kvm" in " ".join(usermod)  # whatever /dev/kvm's group is here
    (venv,) = [c for c in commands if c[0] == "python3"]
    twist = one(service, "Service", "ExecStart").split()[0]
    assert venv[:3] == ["python3", "-m", "venv"] and twist == f"{venv[3]}/bin/twist"


def _verify(units: Path, *flags: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    twist = Path(sys.executable).parent / "twist"
    assert twist.exists(), twist
    for service in units.glob("*.service"):
        text = service.read_text()
        text = re.sub(r"^ExecStart=\S+", f"ExecStart={twist}", text, flags=re.M)
        service.write_text(text)
    return subprocess.run(
        ["systemd-analyze", *flags, "verify", "--man=no", "bottlenet.socket", "bottlenet.service"],
        cwd=units,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_systemd_analyze_verify(flavour: str, tmp_path: Path) -> None:
    units = tmp_path / "units"
    shutil.copytree(UNITS / flavour, units)
    env = dict(os.environ)
    flags: list[str] = []
    if flavour == "user":
        runtime = tmp_path / "runtime"
        runtime.mkdir(mode=0o700)
        env["XDG_RUNTIME_DIR"] = str(runtime)  # --user needs one, even without a user manager
        flags.append("--user")
    out = _verify(units, *flags, env=env)
    # Warnings about our units (unknown keys, bad values) do not change the exit status;
    # any line naming one of them is a failure too.
    ours = [line for line in (out.stdout + out.stderr).splitlines() if "bottlenet." in line]
    assert out.returncode == 0 and ours == [], out.stdout + out.stderr
