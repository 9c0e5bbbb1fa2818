"""The bridge program as the guest runs it, run for real on the host: ``sh -s`` fed the script,
TCP clients on 127.0.0.1 and a UNIX socket server standing in for the mounted socket."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from bottlenet.bridge.__main__ import main
from bottlenet.bridge.script import EXIT_NO_TOOL, NO_TOOL, READY, Bridge, render
from bottlenet.errors import InvalidArgument
from tests.netio import OutputReader, roundtrip

Handler = Callable[[socket.socket], None]


def echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)


@contextmanager
def unix_server(path: str, handler: Handler = echo) -> Iterator[list[socket.socket]]:
    """A threaded UNIX socket server (the sidecar's service behind the mounted socket)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(256)
    accepted: list[socket.socket] = []

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                handler(conn)
            except OSError:
                pass

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.settimeout(30)
            accepted.append(conn)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield accepted
    finally:
        srv.shutdown(socket.SHUT_RDWR)
        srv.close()
        t.join(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_bridge(
    bridges: list[Bridge], env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """The bridge script fed to ``/bin/sh -s`` as the daemon feeds it; waits for ready."""
    proc = subprocess.Popen(
        ["/bin/sh", "-s"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env or {"PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin"},
    )
    assert proc.stdin is not None and proc.stdout is not None
    # As the daemon's session: the script, then stdin stays open (the bridge's lifeline).
    proc.stdin.write(render(bridges))
    proc.stdin.flush()
    try:
        OutputReader(proc.stdout.fileno()).wait_for(READY.encode() + rb" \d+\n", timeout=30)
        yield proc
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stdin.close()


@pytest.fixture
def sock_path(tmp_path: object) -> str:
    return os.path.join(str(tmp_path), "svc.sock")


def test_relays_both_ways_with_half_close(sock_path: str) -> None:
    """Bytes reach the socket and come back; the client's half-close reaches the server."""
    port = free_port()
    payload = os.urandom(3 * 1024 * 1024)
    with unix_server(sock_path), running_bridge([Bridge(port, sock_path)]):
        assert roundtrip("127.0.0.1", port, payload) == payload


def test_server_half_close_keeps_the_other_direction(sock_path: str) -> None:
    """The server ends its side first; the client still sends and the server still reads."""
    port = free_port()
    got: queue.Queue[bytes] = queue.Queue()

    def greet_then_read(conn: socket.socket) -> None:
        conn.sendall(b"hello")
        conn.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        got.put(data)

    with unix_server(sock_path, greet_then_read), running_bridge([Bridge(port, sock_path)]):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
            assert c.recv(5) == b"hello"
            assert c.recv(5) == b""  # the server's EOF, relayed
            c.sendall(b"after")
            c.shutdown(socket.SHUT_WR)
            assert c.recv(5) == b""
        # The server read the client's bytes after its own half-close.
        assert got.get(timeout=30) == b"after"


def test_many_connections_at_once(sock_path: str) -> None:
    """Sixty concurrent connections through one bridge each get their own bytes back."""
    port = free_port()
    results: dict[int, bool] = {}

    def one(i: int) -> None:
        payload = os.urandom(64 * 1024 + i)
        results[i] = roundtrip("127.0.0.1", port, payload, timeout=60) == payload

    with unix_server(sock_path), running_bridge([Bridge(port, sock_path)]):
        threads = [threading.Thread(target=one, args=(i,)) for i in range(60)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    assert results == {i: True for i in range(60)}


def test_one_listener_per_service(tmp_path: object) -> None:
    """Two services: each port relays to its own socket."""
    a, b = os.path.join(str(tmp_path), "a.sock"), os.path.join(str(tmp_path), "b.sock")
    pa, pb = free_port(), free_port()

    def tag(name: bytes) -> Handler:
        def handler(conn: socket.socket) -> None:
            conn.recv(1)
            conn.sendall(name)

        return handler

    with unix_server(a, tag(b"A")), unix_server(b, tag(b"B")):
        with running_bridge([Bridge(pa, a), Bridge(pb, b)]):
            assert roundtrip("127.0.0.1", pa, b"x") == b"A"
            assert roundtrip("127.0.0.1", pb, b"x") == b"B"


def test_binds_only_loopback(sock_path: str) -> None:
    """The listener is on 127.0.0.1, never on a wildcard address."""
    port = free_port()
    with unix_server(sock_path), running_bridge([Bridge(port, sock_path)]) as proc:
        rows = []
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{proc.pid}/net/{table}") as fh:
                rows += [line.split() for line in fh.readlines()[1:]]
        mine = [r[1] for r in rows if r[3] == "0A" and int(r[1].split(":")[1], 16) == port]
    assert mine == [f"0100007F:{port:04X}"]


def test_socket_gone_ends_the_connection(sock_path: str) -> None:
    """No server behind the socket: the client's connection is closed, the bridge lives on."""
    port = free_port()
    with unix_server(sock_path):
        pass  # bound once, now nobody listens
    with running_bridge([Bridge(port, sock_path)]) as proc:
        for _ in range(3):
            try:
                assert roundtrip("127.0.0.1", port, b"x") == b""
            except OSError:
                pass  # closed with the client's byte unread: a reset, as good as an end
        assert proc.poll() is None


def test_session_end_ends_the_bridge(sock_path: str) -> None:
    """The end of its stdin pipe (the session, e.g. a killed daemon's) ends the bridge."""
    with unix_server(sock_path), running_bridge([Bridge(free_port(), sock_path)]) as proc:
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0


def test_fed_from_a_file_runs_until_killed(sock_path: str, tmp_path: object) -> None:
    """By hand (``sh -s < bridge.sh``) stdin is a file at its end: the bridge keeps running."""
    port = free_port()
    script = os.path.join(str(tmp_path), "bridge.sh")
    with open(script, "wb") as fh:
        fh.write(render([Bridge(port, sock_path)]))
    with unix_server(sock_path), open(script, "rb") as stdin:
        proc = subprocess.Popen(["/bin/sh", "-s"], stdin=stdin, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        try:
            OutputReader(proc.stdout.fileno()).wait_for(rb"BNB ready 1\n", timeout=30)
            assert roundtrip("127.0.0.1", port, b"still here") == b"still here"
            assert proc.poll() is None
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_no_python3_says_so(sock_path: str, tmp_path: object) -> None:
    """A guest without python3: the script prints its marker and exits 4."""
    env = {"PATH": str(tmp_path)}
    out = subprocess.run(
        ["/bin/sh", "-s"], input=render([Bridge(3128, sock_path)]), capture_output=True, env=env
    )
    assert out.returncode == EXIT_NO_TOOL
    assert out.stdout == NO_TOOL.encode() + b"\n"


@pytest.mark.parametrize(
    "text", ["3128", "x=/run/a.sock", "3128=relative", "0=/run/a.sock", "3128=/run/a b", "1=/"]
)
def test_bad_bridges_refused(text: str) -> None:
    """Anything but PORT=absolute safe path is a typed error."""
    if text == "1=/":
        Bridge.parse(text)  # the root is a path; only the form is checked here
        return
    with pytest.raises(InvalidArgument):
        Bridge.parse(text)


def test_duplicate_ports_refused() -> None:
    """One listener per port."""
    with pytest.raises(InvalidArgument):
        render([Bridge(1, "/a"), Bridge(1, "/b")])


def test_cli_prints_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    """``script`` prints exactly what the daemon feeds; its first line says how it runs."""
    assert main(["script", "3128=/run/bottle/egress.sock"]) == 0
    out = capsys.readouterr().out
    assert out.encode() == render([Bridge(3128, "/run/bottle/egress.sock")])
    assert out.startswith("#!/bin/sh\n")


def test_cli_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed service is a clear error, no traceback."""
    assert main(["script", "egress"]) == 2
    assert "is not PORT=PATH" in capsys.readouterr().err


# The connection cap, in process: the guest program's own ``serve`` and ``relay`` with a
# semaphore that says when it would make the accept loop wait (tests-3 R13, R14).


class _WouldWait(Exception):
    """The accept loop asked for a slot when none was free (it would block here)."""


class _NoMore(Exception):
    """The accept loop went on to accept a connection past the cap."""


class _Slots(threading.Semaphore):
    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        if not super().acquire(blocking=False):
            raise _WouldWait
        return True


def test_the_accept_loop_waits_for_a_free_slot(sock_path: str) -> None:
    """With every slot held by a live connection the bridge accepts nothing more (the rest
    wait in the backlog): two slots, three clients, two accepted, then a wait for a slot."""
    from bottlenet.bridge import guest

    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    upstream.bind(sock_path)
    upstream.listen(8)  # connects complete in the backlog: each relay holds its slot
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted: list[socket.socket] = []

    class _Listener:
        def accept(self) -> tuple[socket.socket, object]:
            if len(accepted) == 2:
                raise _NoMore
            conn, addr = listener.accept()
            accepted.append(conn)
            return conn, addr

    clients = [socket.create_connection(listener.getsockname()) for _ in range(3)]
    try:
        with pytest.raises(_WouldWait):
            guest.serve(_Listener(), 3128, sock_path, _Slots(2))
        assert len(accepted) == 2
    finally:
        for s in [*clients, listener, upstream]:
            s.close()


def test_a_failed_socket_connect_gives_its_slot_back(sock_path: str) -> None:
    """No socket behind the bridge: the connection ends and its slot is free again, so
    failures never use up the cap."""
    from bottlenet.bridge import guest

    slots = threading.Semaphore(1)
    for _ in range(3):
        assert slots.acquire(blocking=False)  # as serve takes it before accept
        a, b = socket.socketpair()
        guest.relay(a, 3128, sock_path, slots)  # nothing listens at sock_path
        assert b.recv(1) == b""  # the client's connection was closed
        b.close()
    assert slots.acquire(blocking=False)


def test_down_ends_only_the_unanswered_connections_of_its_port(sock_path: str) -> None:
    """Issue 27 item 3: every connection is reported (``BNB conn PORT``); ``down PORT`` on
    stdin ends that port's connections the socket never answered (the client gets EOF, as it
    would not from a real VM whose host side could not connect), and not an answered one."""
    port = free_port()

    def greet_if_asked(conn: socket.socket) -> None:
        while data := conn.recv(65536):
            if data.startswith(b"hi"):
                conn.sendall(b"hello")

    with unix_server(sock_path, greet_if_asked), running_bridge([Bridge(port, sock_path)]) as p:
        assert p.stdin is not None and p.stdout is not None
        out = OutputReader(p.stdout.fileno())
        answered = socket.create_connection(("127.0.0.1", port), timeout=30)
        out.wait_for(rb"BNB conn %d\n" % port)
        answered.sendall(b"hi")
        assert answered.recv(5) == b"hello"
        silent = socket.create_connection(("127.0.0.1", port), timeout=30)
        out.wait_for(rb"BNB conn %d\n" % port)
        silent.sendall(b"anyone?")
        p.stdin.write(b"down %d\n" % port)
        p.stdin.flush()
        assert silent.recv(16) == b""  # EOF, not a hang (the socket's own 30 s timeout)
        answered.sendall(b"hi")
        assert answered.recv(5) == b"hello"
        silent.close()
        answered.close()
