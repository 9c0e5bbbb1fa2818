"""``ExecBridge`` and ``FrameParser`` as units: the rules the end-to-end exec tests left open.

Mutants T01, E01, E03 and E06 of ``tests-2.md`` survived every test: the frame length cap, the
child's stdin closed when the client sends none, the connection closed after EXIT, and SIGKILL
after the grace period. The smolvm child here is a recording double of Twisted's process
transport; the client side is Twisted's ``StringTransport``.
"""

from __future__ import annotations

import fcntl
import os
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from twisted.internet.error import ProcessDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from bottlenet.control import stream
from bottlenet.control.execbroker import KILL_GRACE, REACTOR_READ, TURN_READ, ExecBridge


class Child:
    """What the bridge does to its smolvm child's process transport, recorded."""

    def __init__(self) -> None:
        self.stdin_closed = False
        self.signals: list[str] = []
        self.written: list[bytes] = []

    def closeStdin(self) -> None:
        self.stdin_closed = True

    def signalProcess(self, name: str) -> None:
        self.signals.append(name)

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        pass

    def unregisterProducer(self) -> None:
        pass


def bridge(*, stdin: bool = False, tty: bool = False) -> tuple[ExecBridge, Child, Clock]:
    clock = Clock()
    b = ExecBridge(
        bottle="b1", peer="uid 0", tty=tty, stdin=stdin, clock=clock, resize=lambda *a: None
    )
    child = Child()
    b.makeConnection(child)  # type: ignore[arg-type]
    return b, child, clock


def test_a_frame_announced_longer_than_the_cap_is_refused_before_buffering() -> None:
    """T01: the header alone of a MAX_FRAME + 1 frame is a stream error."""
    parser = stream.FrameParser(stream.CLIENT_KINDS)
    assert parser.feed(struct.pack(">BI", stream.STDIN, stream.MAX_FRAME)) == []  # at the cap
    with pytest.raises(stream.StreamError, match="too long"):
        stream.FrameParser(stream.CLIENT_KINDS).feed(
            struct.pack(">BI", stream.STDIN, stream.MAX_FRAME + 1)
        )


def test_an_overlong_frame_aborts_the_session() -> None:
    """T01 through the bridge: the client is cut off, nothing reaches the child."""
    b, child, _ = bridge(stdin=True)
    client = StringTransport()
    b.attach(client, b"")
    b.client_data(struct.pack(">BI", stream.STDIN, 0xFFFFFFFF) + b"x" * 100)
    assert client.disconnecting and child.written == []


@pytest.mark.parametrize(("stdin", "tty", "closed"), [(False, False, True), (True, False, False)])
def test_the_childs_stdin_is_closed_when_the_client_sends_none(
    stdin: bool, tty: bool, closed: bool
) -> None:
    """E01: without stdin a command that reads it (``cat``) sees EOF instead of hanging."""
    _, child, _ = bridge(stdin=stdin, tty=tty)
    assert child.stdin_closed is closed


def test_the_connection_closes_after_the_exit_frame() -> None:
    """E03: a client waiting for EOF is not held once the command has ended."""
    b, _, _ = bridge()
    client = StringTransport()
    b.attach(client, b"")
    b.processEnded(Failure(ProcessDone(0)))
    assert client.value().endswith(stream.encode_exit(0))
    assert client.disconnecting


def test_a_child_that_ignores_sigterm_gets_sigkill_after_the_grace() -> None:
    """E06: the client went away; TERM now, KILL once the grace period is over."""
    b, child, clock = bridge()
    b.attach(StringTransport(), b"")
    b.client_lost()
    assert child.signals == ["TERM"]
    clock.advance(KILL_GRACE - 0.1)
    assert child.signals == ["TERM"]
    clock.advance(0.1)
    assert child.signals == ["TERM", "KILL"]


def test_a_child_that_ends_within_the_grace_gets_no_sigkill() -> None:
    """E06's other side: the kill timer is cancelled when the child ends in time."""
    b, child, clock = bridge()
    b.attach(StringTransport(), b"")
    b.client_lost()
    b.processEnded(Failure(ProcessDone(0)))
    clock.advance(KILL_GRACE * 2)
    assert child.signals == ["TERM"] and clock.getDelayedCalls() == []


def test_a_resize_payload_of_the_wrong_size_is_a_stream_error() -> None:
    """T03: not a ``struct.error`` escaping the parser's caller."""
    with pytest.raises(stream.StreamError):
        stream.decode_resize(b"abc")


def test_a_child_killed_by_a_signal_exits_128_plus_the_signal() -> None:
    """E02: the shell convention, so ``exec`` of a killed command reports 137 for SIGKILL."""
    from twisted.internet.error import ProcessTerminated

    b, _, _ = bridge()
    client = StringTransport()
    b.attach(client, b"")
    b.processEnded(Failure(ProcessTerminated(exitCode=None, signal=9)))
    assert client.value().endswith(stream.encode_exit(137))


def test_a_tty_session_passes_stdin_frames_to_the_child() -> None:
    """E10: with a terminal the keystrokes go to the child even without ``stdin``."""
    b, child, _ = bridge(tty=True)
    b.attach(StringTransport(), b"")
    b.client_data(stream.encode(stream.STDIN, b"ls\r"))
    assert child.written == [b"ls\r"] and not child.stdin_closed


class PipeEnd:
    """The read end of a child's pipe, as Twisted's process transport keeps it in ``pipes``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


@pytest.fixture
def child_stdout() -> Iterator[tuple[int, int]]:
    """A real non-blocking pipe with room for 1 MiB: (read end, write end)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
    yield r, w
    os.close(r)
    os.close(w)


def piped_bridge(r: int) -> tuple[ExecBridge, StringTransport]:
    b, child, _ = bridge()
    child.pipes = {1: PipeEnd(r)}  # type: ignore[attr-defined]
    client = StringTransport()
    b.attach(client, b"")
    return b, client


def stdout_frames(client: StringTransport) -> list[int]:
    frames = stream.FrameParser(stream.DAEMON_KINDS).feed(client.value())
    assert {f.kind for f in frames} == {stream.STDOUT}
    return [len(f.payload) for f in frames]


def test_bulk_output_goes_out_in_full_frames_bounded_per_turn(child_stdout: Any) -> None:
    """A full reactor read means more is waiting: the bridge sends 64 KiB frames, not one
    frame per 8 KiB read, and reads at most TURN_READ per call (the rest stays in the pipe)."""
    r, w = child_stdout
    os.write(w, bytes(TURN_READ + 100_000))
    b, client = piped_bridge(r)
    b.childDataReceived(1, os.read(r, REACTOR_READ))
    assert stdout_frames(client) == [stream.MAX_FRAME] * (TURN_READ // stream.MAX_FRAME)
    assert len(os.read(r, 1 << 20)) == 100_000


def test_a_short_read_is_one_frame_and_reads_nothing_more(child_stdout: Any) -> None:
    """Interactive output (a read shorter than the reactor's) is sent as it came."""
    r, w = child_stdout
    os.write(w, b"more")
    b, client = piped_bridge(r)
    b.childDataReceived(1, b"prompt$ ")
    assert client.value() == stream.encode(stream.STDOUT, b"prompt$ ")
    assert os.read(r, 100) == b"more"


def test_a_client_that_pauses_stops_the_reading_mid_turn(child_stdout: Any) -> None:
    """Back-pressure holds within one turn: after the connection pauses the bridge, it
    reads no further frame from the child."""
    r, w = child_stdout
    os.write(w, bytes(TURN_READ))
    b, client = piped_bridge(r)
    b.pauseProducing()
    b.childDataReceived(1, os.read(r, REACTOR_READ))
    assert stdout_frames(client) == [stream.MAX_FRAME]
    assert len(os.read(r, 1 << 20)) == TURN_READ - stream.MAX_FRAME
