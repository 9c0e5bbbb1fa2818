"""``ExecBridge``, ``FrameParser`` and the client's stdin copy as units: the rules the
end-to-end exec tests left open.

Mutants T01, E01, E03 and E06 of ``tests-2.md`` survived every test: the frame length cap, the
child's stdin closed when the client sends none, the connection closed after EXIT, and SIGKILL
after the grace period. The smolvm child here is a recording double of Twisted's process
transport; the client side is Twisted's ``StringTransport``.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from bottlenet.control import stream
from bottlenet.control.execbroker import (
    KILL_GRACE,
    MAX_PENDING,
    REACTOR_READ,
    TIMEOUT_EXIT,
    TURN_READ,
    ChildState,
    ExecBridge,
    ExecState,
)
from bottlenet.control.execsession import _Input, _StdinCopy

from .test_exec_sessions import UnixClient


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


def test_the_kill_timer_is_made_on_entering_terminating_and_gone_on_leaving_it() -> None:
    """The grace's timer is terminating's own: one, however often the end is asked for,
    and none left the moment the child ends within the grace (not only once it fired)."""
    b, child, clock = bridge()
    b.attach(StringTransport(), b"")
    assert clock.getDelayedCalls() == []
    b.client_lost()
    b.terminate()
    b.terminate()
    [kill] = clock.getDelayedCalls()
    assert kill.getTime() == KILL_GRACE and b.child_state is ChildState.TERMINATING
    clock.advance(KILL_GRACE - 0.1)
    b.processEnded(Failure(ProcessDone(0)))
    assert not kill.active() and clock.getDelayedCalls() == []
    assert b.child_state is ChildState.ENDED and child.signals == ["TERM"]


def test_the_kill_timer_that_fired_leaves_nothing_armed() -> None:
    """Not ended within the grace: KILL, the state left for killed with no timer, and the
    exit that follows finds nothing to cancel."""
    b, child, clock = bridge()
    b.attach(StringTransport(), b"")
    b.client_lost()
    clock.advance(KILL_GRACE)
    assert b.child_state is ChildState.KILLED and child.signals == ["TERM", "KILL"]
    assert clock.getDelayedCalls() == []
    b.processEnded(Failure(ProcessDone(0)))
    assert b.child_state is ChildState.ENDED and child.signals == ["TERM", "KILL"]


def test_a_resize_payload_of_the_wrong_size_is_a_stream_error() -> None:
    """T03: not a ``struct.error`` escaping the parser's caller."""
    with pytest.raises(stream.StreamError):
        stream.decode_resize(b"abc")


def test_a_child_killed_by_a_signal_exits_128_plus_the_signal() -> None:
    """E02: the shell convention, so ``exec`` of a killed command reports 137 for SIGKILL."""
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


def test_a_framed_session_walks_its_declared_states() -> None:
    """starting -> attached -> closing -> closed, the child running -> ended; on_end once."""
    ended: list[ExecBridge] = []
    b = ExecBridge(
        bottle="b1",
        peer="p",
        tty=False,
        stdin=True,
        clock=Clock(),
        resize=lambda *a: None,
        on_end=ended.append,
    )
    assert (b.state, b.child_state) == (ExecState.STARTING, ChildState.UNSTARTED)
    b.makeConnection(Child())  # type: ignore[arg-type]
    client = StringTransport()
    b.attach(client, b"")
    assert (b.state, b.child_state) == (ExecState.ATTACHED, ChildState.RUNNING)
    b.processEnded(Failure(ProcessDone(0)))
    assert (b.state, b.child_state, b.exit_code) == (ExecState.CLOSING, ChildState.ENDED, 0)
    assert ended == []  # the client is still attached
    b.client_lost()
    b.client_lost()
    assert b.state is ExecState.CLOSED and ended == [b]


def test_an_exit_before_the_client_attaches_waits_for_it() -> None:
    """exited: output and EXIT wait; the client then gets both and the connection closes."""
    b, _, _ = bridge()
    b.childDataReceived(1, b"early")
    b.processEnded(Failure(ProcessDone(0)))
    assert b.state is ExecState.EXITED
    client = StringTransport()
    b.attach(client, stream.encode(stream.STDIN, b"late"))  # too late: not applied
    assert client.value() == stream.encode(stream.STDOUT, b"early") + stream.encode_exit(0)
    assert b.state is ExecState.CLOSING and client.disconnecting


def test_a_client_gone_first_puts_the_child_through_its_grace() -> None:
    """client-gone: TERM and the KILL timer (terminating), KILL (killed), exit (closed)."""
    ended: list[ExecBridge] = []
    clock = Clock()
    b = ExecBridge(
        bottle="b1",
        peer="p",
        tty=False,
        stdin=False,
        clock=clock,
        resize=lambda *a: None,
        on_end=ended.append,
    )
    child = Child()
    b.makeConnection(child)  # type: ignore[arg-type]
    b.attach(StringTransport(), b"")
    b.client_lost()
    assert (b.state, b.child_state) == (ExecState.CLIENT_GONE, ChildState.TERMINATING)
    assert len(clock.getDelayedCalls()) == 1 and b.client is None
    b.childDataReceived(1, b"nobody reads this")  # dropped, not buffered
    clock.advance(KILL_GRACE)
    assert b.child_state is ChildState.KILLED and child.signals == ["TERM", "KILL"]
    assert ended == []
    b.processEnded(Failure(ProcessDone(0)))
    assert (b.state, b.child_state) == (ExecState.CLOSED, ChildState.ENDED) and ended == [b]


def test_a_time_limit_ends_the_child_with_exit_124() -> None:
    """The deadline: terminating (TERM, then KILL), exit code TIMEOUT_EXIT whatever it said."""
    b, child, clock = bridge()
    client = StringTransport()
    b.attach(client, b"")
    b.set_deadline(5)
    clock.advance(5)
    assert b.child_state is ChildState.TERMINATING and child.signals == ["TERM"]
    b.processEnded(Failure(ProcessDone(0)))
    assert client.value().endswith(stream.encode_exit(TIMEOUT_EXIT))
    assert clock.getDelayedCalls() == []


def test_a_terminate_before_the_child_runs_or_after_it_ended_sends_nothing() -> None:
    """unstarted and ended: nothing to signal (the destroy of a bottle may come at any time)."""
    b = ExecBridge(bottle="b1", peer="p", tty=False, stdin=False, clock=Clock(), resize=print)
    b.terminate()
    assert b.child_state is ChildState.UNSTARTED
    child = Child()
    b.makeConnection(child)  # type: ignore[arg-type]
    b.processEnded(Failure(ProcessDone(0)))
    b.terminate()
    assert b.child_state is ChildState.ENDED and child.signals == []


def fd_bridge() -> tuple[ExecBridge, UnixClient]:
    b = ExecBridge(
        bottle="b1", peer="p", tty=False, stdin=True, clock=Clock(), resize=print, fds=True
    )
    b.make_stdio()
    b.spawned()
    b.makeConnection(Child())  # type: ignore[arg-type]
    client = UnixClient()
    b.attach(client, b"")
    return b, client


def test_an_fd_session_hands_over_in_order() -> None:
    """attached -> fds-offered -> fds-taken -> closing; the exit code only after the take."""
    b, client = fd_bridge()
    b.client_data(stream.encode(stream.FDS_READY))
    assert b.state is ExecState.FDS_OFFERED and len(client.sent_fds) == 3
    b.client_data(stream.encode(stream.FDS_TAKEN))
    assert b.state is ExecState.FDS_TAKEN
    b.processEnded(Failure(ProcessTerminated(exitCode=3)))
    assert b.state is ExecState.CLOSING and client.value().endswith(stream.encode_exit(3))


def test_an_fd_session_whose_command_ends_while_offered_waits_for_the_take() -> None:
    """exited-fds-offered: the output is still in the pipes, so EXIT waits for FDS_TAKEN."""
    b, client = fd_bridge()
    b.client_data(stream.encode(stream.FDS_READY))
    b.processEnded(Failure(ProcessDone(0)))
    assert b.state is ExecState.EXITED_FDS_OFFERED and not client.disconnecting
    b.client_data(stream.encode(stream.FDS_TAKEN))
    assert b.state is ExecState.CLOSING and client.value().endswith(stream.encode_exit(0))


@pytest.mark.parametrize(
    "frames",
    [
        [stream.FDS_TAKEN],
        [stream.FDS_READY, stream.FDS_READY],
        [stream.FDS_READY, stream.FDS_TAKEN, stream.FDS_TAKEN],
    ],
)
def test_a_handover_frame_out_of_order_aborts_the_session(frames: list[int]) -> None:
    """The named refusals: a take before the offer, or a second of either, is a stream error."""
    b, client = fd_bridge()
    b.client_data(b"".join(stream.encode(kind) for kind in frames))
    assert client.disconnecting


def test_the_wire_bytes_of_each_frame_are_pinned() -> None:
    """Kind byte, 4-byte big-endian length, payload; EXIT a signed 4-byte code."""
    assert stream.encode(stream.STDOUT, b"hi") == b"\x10\x00\x00\x00\x02hi"
    assert stream.encode_exit(-1) == b"\x12\x00\x00\x00\x04\xff\xff\xff\xff"
    assert stream.encode_resize(24, 80) == b"\x03\x00\x00\x00\x04\x00\x18\x00\x50"
    assert stream.decode_exit(b"\xff\xff\xff\xff") == -1
    assert stream.encode_resize(70000, -3) == b"\x03\x00\x00\x00\x04\xff\xff\x00\x00"
    assert stream.FrameParser(stream.DAEMON_KINDS).feed(b"\x11\x00\x00\x00\x01e") == [
        stream.Frame(stream.STDERR, b"e")
    ]


def test_the_client_side_of_exec_imports_no_attrs() -> None:
    """``bottlenetctl bottle exec`` loads stream and execsession: neither pulls attrs in."""
    probe = (
        "import sys, bottlenet.control.execsession, bottlenet.control.stream;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('attr', 'attrs')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "[]\n"


@given(
    frames=st.lists(
        st.tuples(st.sampled_from(sorted(stream.DAEMON_KINDS)), st.binary(max_size=300)),
        max_size=8,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=12),
)
def test_the_parser_gives_the_same_frames_however_the_reads_are_cut(
    frames: list[tuple[int, bytes]], cuts: list[int]
) -> None:
    """A frame cut by the end of a read (in its header or its payload) waits for the rest."""
    wire = b"".join(stream.encode(kind, payload) for kind, payload in frames)
    parser = stream.FrameParser(stream.DAEMON_KINDS)
    got: list[stream.Frame] = []
    last = 0
    for cut in [*sorted({min(c, len(wire)) for c in cuts}), len(wire)]:
        got += parser.feed(wire[last:cut])
        last = cut
    assert got == [stream.Frame(kind, payload) for kind, payload in frames]
    assert parser.buffered == 0 and all(type(f.payload) is bytes for f in got)


def test_a_bad_header_cut_before_its_payload_is_refused_at_once() -> None:
    """The kind and the length are checked as soon as the header is in, payload or not."""
    parser = stream.FrameParser(stream.CLIENT_KINDS)
    assert parser.feed(stream.encode(stream.STDIN, b"ok")[:3]) == []
    with pytest.raises(stream.StreamError, match="too long"):
        stream.FrameParser(stream.CLIENT_KINDS).feed(b"\x01\x00\x01\x00\x01")
    parser = stream.FrameParser(stream.CLIENT_KINDS)
    parser.feed(b"\x10\x00")
    with pytest.raises(stream.StreamError, match="unexpected frame kind 16"):
        parser.feed(b"\x00\x00\x01")


def test_stdin_frames_after_the_exit_are_not_written() -> None:
    """E04: the child ended (its stdin is gone): a late STDIN frame is not written to it."""
    b, child, _ = bridge(stdin=True)
    b.attach(StringTransport(), b"")
    b.processEnded(Failure(ProcessDone(0)))
    b.client_data(stream.encode(stream.STDIN, b"late"))
    assert child.written == []


class PausableChild(Child):
    """A child whose output can be paused (as Twisted's process transport)."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = False

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False


def test_output_before_the_client_is_bounded_and_resumed_on_attach() -> None:
    """E07, E08: past MAX_PENDING the child is paused; the client's attach resumes it."""
    b = ExecBridge(bottle="b1", peer="p", tty=False, stdin=False, clock=Clock(), resize=print)
    child = PausableChild()
    b.makeConnection(child)  # type: ignore[arg-type]
    b.childDataReceived(1, bytes(MAX_PENDING // 2))
    assert not child.paused
    b.childDataReceived(1, bytes(MAX_PENDING // 2 + 1))
    assert child.paused
    client = StringTransport()
    b.attach(client, b"")
    assert not child.paused and len(client.value()) > MAX_PENDING


@pytest.mark.parametrize("tty", [True, False])
def test_a_resize_frame_reaches_the_terminal_only_with_one(tty: bool) -> None:
    """E11: RESIZE sets the child's terminal size; without a terminal it is ignored."""
    sizes: list[tuple[int, int]] = []
    b = ExecBridge(
        bottle="b1",
        peer="p",
        tty=tty,
        stdin=True,
        clock=Clock(),
        resize=lambda process, rows, cols: sizes.append((rows, cols)),
    )
    b.makeConnection(Child())  # type: ignore[arg-type]
    b.attach(StringTransport(), b"")
    b.client_data(stream.encode_resize(41, 123))
    assert sizes == ([(41, 123)] if tty else [])


def test_the_clients_end_of_input_is_a_half_close() -> None:
    """input-closed: the child's stdin closes once, its output still streams, then EXIT."""
    b, child, _ = bridge(stdin=True)
    client = StringTransport()
    b.attach(client, b"")
    b.client_data(stream.encode(stream.STDIN, b"in") + stream.encode(stream.STDIN_EOF))
    assert b.state is ExecState.INPUT_CLOSED and child.stdin_closed
    assert child.written == [b"in"]
    b.client_data(stream.encode(stream.STDIN_EOF))  # a second end changes nothing
    b.childDataReceived(1, b"out")
    b.processEnded(Failure(ProcessDone(0)))
    assert client.value() == stream.encode(stream.STDOUT, b"out") + stream.encode_exit(0)
    assert b.state is ExecState.CLOSING


def test_a_terminal_has_no_half_close() -> None:
    """With a tty the end of input is Ctrl-D in its bytes: STDIN_EOF leaves it open."""
    b, child, _ = bridge(tty=True)
    b.attach(StringTransport(), b"")
    b.client_data(stream.encode(stream.STDIN_EOF))
    assert b.state is ExecState.ATTACHED and not child.stdin_closed


@pytest.fixture
def command_stdin() -> Iterator[tuple[int, int]]:
    """The command's stdin pipe as the client holds it: (read end, the client's write end)."""
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        with contextlib.suppress(OSError):
            os.close(fd)


def test_the_stdin_copy_drains_held_input_then_closes(command_stdin: Any) -> None:
    """Input without an fd is held (draining), written when the pipe has room, then closed."""
    r, w = command_stdin
    copy = _StdinCopy(w)
    copy.open(io.BytesIO(b"held input"))
    assert copy.state is _Input.DRAINING and copy.readers() == [] and copy.writers() == [w]
    assert copy.write([w]) is True and copy.state is _Input.CLOSED
    assert os.read(r, 100) == b"held input"


def test_the_stdin_copy_splices_to_the_end_of_its_source(command_stdin: Any) -> None:
    """A pipe into a pipe: the kernel moves the bytes; the source's end closes the copy."""
    r, w = command_stdin
    src_r, src_w = os.pipe()
    os.write(src_w, b"spliced")
    os.close(src_w)
    with os.fdopen(src_r, "rb", buffering=0) as source:
        copy = _StdinCopy(w)
        copy.open(source)
        assert copy.state is _Input.READING and copy.readers() == [src_r]
        copy.read()
        copy.read()  # the source's EOF
        assert copy.state is _Input.DRAINING and copy.write([]) is True
    assert os.read(r, 100) == b"spliced"


def test_the_stdin_copy_stops_when_the_command_closed_its_stdin(command_stdin: Any) -> None:
    """A broken pipe (the command stopped reading) drops what is held and ends the copy,
    whatever is left to read."""
    r, w = command_stdin
    src_r, src_w = os.pipe()
    os.write(src_w, b"nobody reads this")
    with os.fdopen(src_r, "rb", buffering=0) as source:
        copy = _StdinCopy(w)
        copy.open(source)
        copy.splice = False  # copied through the client (a source that is not a pipe)
        copy.read()
        assert copy.pending == b"nobody reads this"
        os.close(r)
        assert copy.write([w]) is True and copy.state is _Input.CLOSED and not copy.pending
    os.close(src_w)


class ProducerChild(Child):
    """A child transport that keeps the producer registered on its stdin."""

    def __init__(self) -> None:
        super().__init__()
        self.producer: Any = None

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer = producer


@pytest.mark.parametrize(("tty", "stdin"), [(True, False), (True, True), (False, True)])
def test_a_full_child_stdin_pauses_the_client_whenever_the_client_may_send(
    tty: bool, stdin: bool
) -> None:
    """A terminal takes the client's frames even without ``stdin`` (tests-3 X09): so any
    session but a pipe without stdin registers the pauser, and a full stdin pauses the
    client until it drains."""
    b = ExecBridge(
        bottle="b1", peer="uid 0", tty=tty, stdin=stdin, clock=Clock(), resize=lambda *a: None
    )
    child = ProducerChild()
    b.makeConnection(child)  # type: ignore[arg-type]
    client = StringTransport()
    b.attach(client, b"")
    assert child.producer is not None
    child.producer.pauseProducing()
    assert client.producerState == "paused"
    child.producer.resumeProducing()
    assert client.producerState == "producing"


def test_a_pipe_session_without_stdin_registers_no_pauser() -> None:
    """Nothing comes from the client for a pipe without stdin: its stdin is closed instead."""
    b = ExecBridge(
        bottle="b1", peer="uid 0", tty=False, stdin=False, clock=Clock(), resize=lambda *a: None
    )
    child = ProducerChild()
    b.makeConnection(child)  # type: ignore[arg-type]
    assert child.producer is None and child.stdin_closed
