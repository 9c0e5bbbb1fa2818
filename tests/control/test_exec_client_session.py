"""``ExecSession``, the client's side of an exec, against a socketpair playing the daemon.

The rules only a misbehaving or slow daemon reaches (tests-3 X06, X07, X12): an fd session
that forwards no stdin closes the command's stdin at once; fds past the three pipes are
refused as they come; the framed path holds a bounded amount of stdin for a daemon that
does not read. The daemon's end speaks the frames of :mod:`bottlenet.control.stream`.
"""

from __future__ import annotations

import io
import os
import select
import socket
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bottlenet.control import execsession, stream
from bottlenet.control.clienterrors import ControlConnectionError
from bottlenet.control.execsession import MAX_OUTGOING, SEND_BUFFER, ExecSession


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the client's end, the daemon's end)."""
    client, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    daemon.settimeout(30)
    yield client, daemon
    client.close()
    daemon.close()


def _expect(sock: socket.socket, frame: bytes) -> None:
    got = b""
    while len(got) < len(frame):
        chunk = sock.recv(len(frame) - len(got))
        assert chunk, "the client closed the connection"
        got += chunk
    assert got == frame


@pytest.mark.parametrize("given", ["none", "empty"])
def test_an_fd_session_without_stdin_closes_the_commands_stdin(
    pair: tuple[socket.socket, socket.socket], given: str
) -> None:
    """No ``-i`` (or an empty in-memory stdin, as the self-test gives the kit's ``write``):
    the command's stdin pipe is closed as soon as the client holds it, so a command reading
    stdin (``cat``) sees its end even while our own stdin stays open, and no other event is
    needed to say so (the empty one waited for the command's output that never came)."""
    client, daemon = pair
    session = ExecSession(client, b"", tty=False, stdin=given == "empty", fds=True)
    our_stdin_r, our_stdin_w = os.pipe()  # open, and nobody writes to it
    result: list[int | BaseException] = []

    def run() -> None:
        try:
            with open(our_stdin_r, "rb", buffering=0) as stdin:
                given_stdin = io.BytesIO(b"") if given == "empty" else stdin
                result.append(session.run(given_stdin, io.BytesIO(), io.BytesIO()))
        except BaseException as e:
            result.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        _expect(daemon, stream.encode(stream.FDS_READY))
        socket.send_fds(daemon, [stream.encode(stream.FDS)], [in_w, out_r, err_r])
        for fd in (in_w, out_r, err_r):
            os.close(fd)
        _expect(daemon, stream.encode(stream.FDS_TAKEN))
        readable, _, _ = select.select([in_r], [], [], 30)  # the command reading its stdin
        saw_the_end = bool(readable) and os.read(in_r, 1) == b""
        daemon.sendall(stream.encode_exit(0))
    finally:
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    thread.join(30)
    os.close(our_stdin_w)
    session.close()
    assert saw_the_end, "the command's stdin stayed open"
    assert result == [0]


def _fds_open() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_fds_past_the_three_pipes_are_refused_as_they_come(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A daemon sending a fourth fd before its FDS frame is refused at once (not when the
    frame comes, which a hostile daemon may never send), and every fd it sent is closed."""
    client, daemon = pair
    before = _fds_open()
    extra = [os.open(os.devnull, os.O_RDONLY) for _ in range(stream.FD_COUNT + 1)]
    # One byte of a frame header carries the fds; the rest never comes, the stream ends.
    socket.send_fds(daemon, [stream.encode(stream.FDS)[:1]], extra)
    daemon.shutdown(socket.SHUT_WR)
    for fd in extra:
        os.close(fd)
    with (
        ExecSession(client, b"", tty=False, stdin=False, fds=True) as session,
        pytest.raises(ControlConnectionError, match="too many file descriptors"),
    ):
        session.run()
    assert _fds_open() == before - 1  # and the client end of the pair, with the session


def test_a_daemon_that_does_not_read_stops_the_reading_of_stdin(
    pair: tuple[socket.socket, socket.socket], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Framed exec: while the daemon takes none of our input, the client holds at most
    MAX_OUTGOING of it beyond what the socket holds, then stops reading stdin (a 16 MiB
    input is never read whole into memory)."""
    client, daemon = pair
    source = tmp_path / "input"
    size = 16 * 1024 * 1024
    assert size > 4 * (SEND_BUFFER + MAX_OUTGOING)  # the socket holds at most 2x SEND_BUFFER
    source.write_bytes(b"\0" * size)
    seen: list[int] = []
    real_select = select.select

    def watching(r: list[Any], w: list[Any], x: list[Any], *timeout: float) -> Any:
        if stdin_fd not in r and not seen:  # the loop stopped reading our stdin
            seen.append(os.lseek(stdin_fd, 0, os.SEEK_CUR))
            daemon.sendall(stream.encode_exit(0))  # then the command ends
        return real_select(r, w, x, *timeout)

    monkeypatch.setattr(execsession, "select", types.SimpleNamespace(select=watching))
    with open(source, "rb", buffering=0) as stdin:
        stdin_fd = stdin.fileno()
        with ExecSession(client, b"", tty=False, stdin=True) as session:
            assert session.run(stdin, io.BytesIO(), io.BytesIO()) == 0
    assert len(seen) == 1 and seen[0] < size // 2
