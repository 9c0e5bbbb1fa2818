"""bottlenetctl top and down --all against a daemon in process, plus the rate arithmetic.

The throughput test runs the tap's real service tree (``tests/bottles/harness.py``, with the
fake smolvm, a TEST DOUBLE) for its real relays; the others need a daemon that answers, the
daemon's own control listener over ``FakeBackend``. ``top``'s live loop runs as the process a
person starts (signals, a pseudo-terminal, a closed stdout); ``top --once`` and ``down`` run
``main()`` as tests/cli/test_cli.py does."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from bottlenet.cli.down import bottle_names, destroy_all
from bottlenet.cli.main import main
from bottlenet.cli.top import Snapshot, human_bytes, rates, render
from bottlenet.control.blocking import BlockingControlClient
from bottlenet.control.records import BottleRecord, ForwardRecord, StatsRecord
from tests.bottles.harness import ControlSocketCase, DaemonCase, in_thread
from tests.control.daemon_helpers import ENV
from tests.sigdefault import sigint_default


def _stats(bottle: str, label: str, bytes_in: int, bytes_out: int, active: int = 0) -> StatsRecord:
    return StatsRecord(
        bottle=bottle,
        label=label,
        endpoint="127.77.0.1:1000",
        accepted=1,
        active=active,
        refused=0,
        failed=0,
        bytes_in=bytes_in,
        bytes_out=bytes_out,
    )


def _snap(at: float, *stats: StatsRecord) -> Snapshot:
    bottles = tuple(
        BottleRecord(
            name=b,
            alias="127.77.0.1",
            source="control",
            state="ready",
            created_at=0.0,
            forwards=sum(1 for s in stats if s.bottle == b),
        )
        for b in sorted({s.bottle for s in stats})
    )
    forwards = tuple(
        ForwardRecord(bottle=s.bottle, label=s.label, target="127.0.0.1:9", endpoint=s.endpoint)
        for s in stats
    )
    return Snapshot(at, "0.1.0", bottles, forwards, stats)


def test_rates_are_deltas_over_time() -> None:
    a = _snap(10.0, _stats("b", "web", 1000, 0), _stats("b", "git", 0, 0))
    b = _snap(12.0, _stats("b", "web", 5096, 2048), _stats("b", "git", 0, 0))
    assert rates(a, b) == {("b", "web"): (2048.0, 1024.0), ("b", "git"): (0.0, 0.0)}
    assert rates(None, b) == {}
    # A forward removed and added again (counters went back) has no rate yet.
    c = _snap(13.0, _stats("b", "web", 10, 10), _stats("b", "git", 0, 0))
    assert ("b", "web") not in rates(b, c)


def test_render_aligns_columns_and_shows_rates() -> None:
    a = _snap(0.0, _stats("alpha", "web", 0, 0), _stats("b", "egress-proxy", 0, 0, active=2))
    b = _snap(1.0, _stats("alpha", "web", 3 * 1024, 0), _stats("b", "egress-proxy", 10, 5, 2))
    lines = render(b, a, path="/run/c.sock", interval=1.0, now="12:00:00")
    assert lines[1].startswith("bottles 2  forwards 2  active relays 2  in 3.0 KiB/s")
    table = lines[lines.index("") + 1 :]
    bottles = table[: table.index("")]
    forwards = table[table.index("") + 1 :]
    assert bottles[0].split() == ["BOTTLE", "ALIAS", "STATE", "FORWARDS", "ACTIVE", "IN/s", "OUT/s"]
    for block in (bottles, forwards):
        starts = {
            line.index(word) for line, word in zip(block, ("BOTTLE", "alpha", "b"), strict=True)
        }
        assert starts == {0}
        # every row's second column starts where its header's does
        col = block[0].index(block[0].split()[1])
        assert all(line[col - 2 : col] == "  " and line[col] != " " for line in block)
    assert "3.0 KiB/s" in forwards[1] and "10 B/s" in forwards[2]
    first = render(a, None, path="/run/c.sock", interval=1.0, now="12:00:00")
    assert "in -  out -" in first[1]


def test_render_keeps_rates_and_counters_within_80_columns() -> None:
    """At 80 columns the forwards' IN/s, OUT/s, IN and OUT stay visible (long endpoints and
    targets come last)."""
    a = _snap(0.0, _stats("agent-0042", "egress-proxy", 0, 0))
    b = _snap(1.0, _stats("agent-0042", "egress-proxy", 5 * 1024**2, 1024**3, active=3))
    lines = render(b, a, path="/run/c.sock", interval=1.0, now="12:00:00")
    forwards = lines[len(lines) - 2 :]
    for word in ("IN/s", "OUT/s", "IN", "OUT", "ACTIVE"):
        assert word in forwards[0][:80].split()
    assert "5.0 MiB/s" in forwards[1][:80] and "1.0 GiB/s" in forwards[1][:80]


def test_human_bytes() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536, "/s") == "1.5 KiB/s"
    assert human_bytes(5 * 1024**3) == "5.0 GiB"


def test_down_without_all_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--control", "/nonexistent/c.sock", "down"], env={}) == 2
    assert "--all" in capsys.readouterr().err


def test_top_once_unreachable_exits_3() -> None:
    out, err = io.StringIO(), io.StringIO()
    code = main(["--control", "/nonexistent/c.sock", "top", "--once"], env={}, out=out, err=err)
    assert code == 3 and "hint:" in err.getvalue() and out.getvalue() == ""


# -- against a daemon in process ------------------------------------------------------------


@contextmanager
def sink() -> Iterator[int]:
    """Reads and discards everything: a target for a steady upload."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                while conn.recv(65536):
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        done.set()
        t.join(2)
        srv.close()


def ctl(path: str, *argv: str) -> tuple[int, str, str]:
    """``bottlenetctl --control PATH ARGV``: its exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    code = main(["--control", path, *argv], env={}, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def top_during_upload(
    path: str, sink_port: int
) -> tuple[tuple[int, str, str], tuple[int, str, str], tuple[str, int]]:
    """``top --once`` twice (text, then --json) while a client uploads through a forward."""
    with BlockingControlClient(path, timeout=5) as c:
        c.create_bottle("topb")
        ep = c.add_forward("topb", "up", f"127.0.0.1:{sink_port}")
    assert ep.host is not None and ep.port is not None
    address = (ep.host, ep.port)
    stop_upload = threading.Event()

    def upload() -> None:
        with socket.create_connection(address, timeout=5) as s:
            while not stop_upload.is_set():
                s.sendall(b"x" * 16384)
                time.sleep(0.005)

    t = threading.Thread(target=upload, daemon=True)
    t.start()
    try:
        time.sleep(0.2)
        res = ctl(path, "top", "--once", "--interval", "0.5")
        as_json = ctl(path, "top", "--once", "--interval", "0.5", "--json")
    finally:
        stop_upload.set()
        t.join(5)
    return res, as_json, address


class TopThroughputTests(DaemonCase):
    async def test_top_once_shows_throughput(self) -> None:
        """``top --once`` shows a steady upload through a real relay as a rate (text and --json)."""
        await self.start(vm_bottles=False)
        with sink() as sink_port:
            res, as_json, (host, port) = await in_thread(top_during_upload, self.control, sink_port)
        code, stdout, stderr = res
        assert code == 0, stderr
        assert "\x1b" not in stdout  # not a terminal: no escape sequences
        lines = stdout.splitlines()
        assert lines[1].startswith("bottles 1  forwards 1  active relays 1  in ")
        row = next(line for line in lines if line.startswith("topb ") and " up " in line)
        assert f"{host}:{port}" in row and f"127.0.0.1:{sink_port}" in row
        assert "KiB/s" in row or "MiB/s" in row
        frame = json.loads(as_json[1])
        (stat,) = frame["stats"]
        assert stat["active"] == 1 and stat["in_rate"] > 0 and stat["out_rate"] == 0


def _wait_for(fd: int, needle: bytes, timeout: float = 30) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen and time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    return seen


def top_argv(path: str, interval: str) -> list[str]:
    """``bottlenetctl top`` as a person runs it (its own process: signals, terminal, stdout)."""
    return [sys.executable, "-m", "bottlenet.cli", "--control", path, "top", "--interval", interval]


def top_live_until_sigint(path: str, terminal: bool) -> None:
    """Live ``top`` on a pipe or a pseudo-terminal: two frames, SIGINT, a clean exit 0."""
    argv = top_argv(path, "0.1")
    if terminal:
        master, slave = pty.openpty()
        proc = subprocess.Popen(
            argv, env=ENV, stdout=slave, stderr=subprocess.PIPE, preexec_fn=sigint_default
        )
        os.close(slave)
        read_fd = master
    else:
        proc = subprocess.Popen(
            argv,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=sigint_default,
        )
        assert proc.stdout is not None
        read_fd = proc.stdout.fileno()
    try:
        # Two frames seen: it is in its loop (and SIGINT's handler is installed).
        seen = _wait_for(read_fd, b"bottles 0")
        seen += _wait_for(read_fd, b"bottles 0")
        assert seen.count(b"bottles 0") >= 2, seen
        proc.send_signal(signal.SIGINT)
        code = proc.wait(15)
        seen += _wait_for(read_fd, b"\x1b[?25h" if terminal else b"\0", timeout=1)
        err = proc.stderr.read().decode() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
        if terminal:
            os.close(master)
    assert code == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    if terminal:
        assert seen.startswith(b"\x1b[?25l")  # cursor hidden while it runs...
        assert b"\x1b[H" in seen
        assert seen.rstrip(b"\r\n").endswith(b"\x1b[?25h")  # ...and shown again at exit
    else:
        assert b"\x1b" not in seen


def top_live_until_stdout_closes(path: str) -> None:
    """Live ``top`` whose reader goes away after one line: exit 0, nothing on stderr."""
    proc = subprocess.Popen(
        top_argv(path, "0.05"), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # the reader goes away, as with `bottlenetctl top | head -1`
    try:
        code = proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read().decode()
    assert code == 0, err
    assert err == ""


def down_session(path: str) -> None:
    """``down --all`` over pages, as a library call and as the command (text, --json, usage)."""
    names = [f"d{i}" for i in range(7)]
    with BlockingControlClient(path, timeout=5) as c:
        for n in names:
            c.create_bottle(n)
        c.add_forward("d0", "web", "127.0.0.1:9")
        # Small pages: the listing is read in full before anything is destroyed.
        assert bottle_names(c, page_size=2) == names
        destroyed, failed = destroy_all(c, page_size=2)
        assert (destroyed, failed) == (names, {})
        assert list(c.all_bottles()) == []
        for n in names[:3]:
            c.create_bottle(n)
    code, out, err = ctl(path, "down", "--all")
    assert code == 0, err
    assert out.splitlines() == [
        "destroyed d0",
        "destroyed d1",
        "destroyed d2",
        "3 destroyed, 0 failed",
    ]
    code, out, _ = ctl(path, "down", "--all", "--json")
    assert code == 0 and json.loads(out) == {"destroyed": [], "failed": []}
    assert ctl(path, "down", "--all")[1] == "no bottles\n"
    with BlockingControlClient(path, timeout=5) as c:
        c.create_bottle("j1")
    code, out, _ = ctl(path, "--json", "down", "--all")
    assert code == 0 and json.loads(out) == {"destroyed": ["j1"], "failed": []}
    code, _, err = ctl(path, "down")
    assert code == 2 and "--all" in err


class TopAndDownTests(ControlSocketCase):
    async def test_top_live_exits_0_on_sigint_pipe(self) -> None:
        """Live ``top`` on a pipe exits 0 on SIGINT, with no escape sequences."""
        await self.serve()
        await in_thread(top_live_until_sigint, self.path, False)

    async def test_top_live_exits_0_on_sigint_pty(self) -> None:
        """Live ``top`` on a terminal exits 0 on SIGINT and shows the cursor again."""
        await self.serve()
        await in_thread(top_live_until_sigint, self.path, True)

    async def test_top_live_exits_0_when_stdout_closes(self) -> None:
        """Live ``top`` exits 0, silently, when its reader goes away (``| head -1``)."""
        await self.serve()
        await in_thread(top_live_until_stdout_closes, self.path)

    async def test_top_live_survives_the_daemon_going_away(self) -> None:
        """Live ``top`` shows the daemon unreachable while it is gone, keeps retrying, and
        draws again once it is back; SIGINT then exits 0."""
        top = subprocess.Popen(
            top_argv(self.path, "0.1"),
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=sigint_default,
        )
        assert top.stdout is not None
        fd = top.stdout.fileno()
        try:
            await self.serve()
            assert b"bottles 0" in await in_thread(_wait_for, fd, b"bottles 0")
            await self.go_away()
            assert b"daemon unreachable" in await in_thread(_wait_for, fd, b"daemon unreachable")
            assert top.poll() is None  # still retrying
            await self.serve()
            assert b"bottles 0" in await in_thread(_wait_for, fd, b"bottles 0")
            top.send_signal(signal.SIGINT)
            assert await in_thread(top.wait, 15) == 0
        finally:
            if top.poll() is None:
                top.kill()
                top.wait()
            top.stdout.close()
            if top.stderr is not None:
                top.stderr.close()

    async def test_down_all_destroys_every_bottle(self) -> None:
        """``down --all`` reads every page, then destroys each bottle once (text and --json)."""
        await self.serve()
        await in_thread(down_session, self.path)
