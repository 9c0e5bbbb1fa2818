"""bottlenetctl starts at once: what each simple command imports is pinned (not timed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from bottlenet.cli.main import main
code = main(json.loads(sys.argv[1]), env={}, out=open("/dev/null", "w"), err=open("/dev/null", "w"))
print("\\n" + json.dumps([code, sorted(sys.modules)]))
"""

HEAVY = ("twisted", "OpenSSL", "cryptography", "ssl", "zope")


def imported_by(argv: list[str]) -> tuple[int, list[str]]:
    """Run ``bottlenetctl ARGV`` in a fresh interpreter; its exit code and its sys.modules."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    code, modules = json.loads(done.stdout.splitlines()[-1])  # after --help's own text
    return code, modules


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["--control", "/nonexistent/bn/control.sock", "status"],
        ["--control", "unix:/nonexistent/bn/control.sock", "bottle", "ls"],
        ["--control", "/nonexistent/bn/control.sock", "ping"],
    ],
)
def test_simple_commands_import_no_twisted_or_tls(argv: list[str]) -> None:
    """--help, --version, status, bottle ls and ping load no Twisted, AMP, TLS or zope."""
    code, modules = imported_by(argv)
    assert code in (0, 3)
    heavy = [m for m in modules if m.split(".")[0] in HEAVY]
    assert heavy == []


def test_exec_on_a_unix_socket_imports_no_twisted() -> None:
    """``bottle exec`` on a UNIX socket loads no Twisted, AMP or OpenSSL (the light client)."""
    argv = ["--control", "/nonexistent/bn/c.sock", "bottle", "exec", "b1", "--", "true"]
    code, modules = imported_by(argv)
    assert code == 3
    assert [m for m in modules if m.split(".")[0] in ("twisted", "OpenSSL", "zope")] == []


def test_exec_without_a_tty_imports_no_tls_or_terminal() -> None:
    """``bottle exec`` without -t loads neither ``ssl`` nor the terminal module (not on a tty)."""
    argv = ["--control", "/nonexistent/bn/c.sock", "bottle", "exec", "b1", "--", "true"]
    code, modules = imported_by(argv)
    assert code == 3
    assert [m for m in modules if m == "ssl" or m == "bottlenet.control.terminal"] == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--control", "/nonexistent/bn/control.sock", "status"],
        ["--control", "/nonexistent/bn/control.sock", "ping"],
    ],
)
def test_status_and_ping_import_no_attrs(argv: list[str]) -> None:
    """status and ping load no attrs (their values are client-side plain tuples)."""
    code, modules = imported_by(argv)
    assert code == 3
    assert [m for m in modules if m.split(".")[0] in ("attr", "attrs")] == []


def test_help_and_version_import_no_client() -> None:
    """--help and --version do not even load a control client or attrs."""
    for argv in (["--help"], ["--version"]):
        code, modules = imported_by(argv)
        assert code == 0
        assert not [m for m in modules if m.startswith(("attr", "bottlenet.control.lightclient"))]


def test_other_commands_still_use_the_amp_client() -> None:
    """A command the light client does not know goes through AMP (the probe can tell)."""
    code, modules = imported_by(["--control", "/nonexistent/bn/c.sock", "forward", "ls"])
    assert code == 3 and "twisted.protocols.amp" in modules


def test_version_prints_the_package_version() -> None:
    """``bottlenetctl --version`` prints its name and the package version, exit 0."""
    from bottlenet import __version__

    done = subprocess.run(
        [sys.executable, "-m", "bottlenet.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (0, f"bottlenetctl {__version__}\n")
