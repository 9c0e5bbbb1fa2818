"""bottlenetctl starts at once: what each simple command imports is pinned (not timed)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

import pytest
from twisted.protocols import amp

from bottlenet.control import commands as C
from bottlenet.control.framing import BoxParser
from bottlenet.control.records import BottleRecord

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


ANSWERS = {
    b"bottlenet.Hello": C.Hello.makeResponse(
        {
            "server_version": "0.1.0",
            "protocol": 1,
            "features": ["bottles"],
            "smolvm_available": False,
            "smolvm_version": None,
        },
        None,
    ),
    b"bottlenet.Ping": amp.AmpBox(),
    b"bottlenet.ListBottles": C.ListBottles.makeResponse(
        {
            "bottles": [BottleRecord("b1", "127.77.0.1", "api", "ready", 1.5, 0)],
            "total": 1,
            "next_offset": None,
        },
        None,
    ),
}


def _answer_connection(conn: socket.socket) -> None:
    parser = BoxParser()
    with conn:
        while chunk := conn.recv(65536):
            parser.feed(chunk)
            while (box := parser.next_box()) is not None:
                answer = amp.AmpBox(ANSWERS[box[amp.COMMAND]])
                answer[amp.ANSWER] = box[amp.ASK]
                conn.sendall(answer.serialize())


@pytest.fixture
def daemon() -> Iterator[str]:
    """A stand-in daemon on a UNIX socket that answers Hello, Ping and ListBottles (one bottle)."""
    where = tempfile.mkdtemp(prefix="bnt-start-", dir="/tmp")
    path = os.path.join(where, "c.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            _answer_connection(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(10)
        os.unlink(path)
        os.rmdir(where)


@pytest.mark.parametrize("argv", [["status"], ["bottle", "ls"], ["bottle", "ls", "--json"]])
def test_status_and_ls_read_answers_without_attrs(daemon: str, argv: list[str]) -> None:
    """status and bottle ls decode a daemon's real answers (a bottle record) without attrs."""
    code, modules = imported_by(["--control", daemon, *argv])
    assert code == 0
    assert [m for m in modules if m.split(".")[0] in ("attr", "attrs", "twisted")] == []


@pytest.mark.parametrize("argv", [["--help"], ["status"], ["ping"], ["bottle", "ls"]])
def test_simple_commands_import_no_shutil_or_hashlib(daemon: str, argv: list[str]) -> None:
    """argparse is given the terminal width (no shutil, bz2, lzma); errors hash only when
    they digest a value (no hashlib)."""
    code, modules = imported_by(["--control", daemon, *argv])
    assert code == 0
    assert [m for m in modules if m in ("shutil", "lzma", "bz2", "hashlib")] == []
