"""Security-2, exec sessions on the control side: T13 (DestroyBottle ends the destroyed
bottle's sessions) and T8 (a RESIZE frame of the wrong size; "went away" logged once)."""

from __future__ import annotations

import os

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs, formatEvent

from bottlenet.control import codec, stream
from bottlenet.control import commands as C
from bottlenet.control.execbroker import ExecBridge
from bottlenet.control.identity import mint_capability

from .fakes import Conn, FakeBackend, make_factory


class _Child:
    """The process transport of a session's smolvm child: records the signals it gets."""

    def __init__(self) -> None:
        self.signals: list[str] = []

    def signalProcess(self, name: str) -> None:
        self.signals.append(name)

    def closeStdin(self) -> None:
        pass


def _session(bottle: str, clock: Clock) -> tuple[ExecBridge, _Child]:
    bridge = ExecBridge(
        bottle=bottle, peer="uid=0", tty=False, stdin=False, clock=clock, resize=lambda *_: None
    )
    child = _Child()
    bridge.makeConnection(child)  # type: ignore[arg-type]
    return bridge, child


def test_destroy_bottle_ends_its_exec_sessions() -> None:
    """T13: sessions used to keep streaming after their bottle's DestroyBottle answered."""
    clock = Clock()
    conn = Conn(make_factory(clock=clock))
    conn.call(C.CreateBottle, name="b1")
    conn.call(C.CreateBottle, name="b2")
    doomed, doomed_child = _session("b1", clock)
    other, other_child = _session("b2", clock)
    conn.factory.context.exec_sessions.update({doomed, other})
    assert conn.call(C.DestroyBottle, name="b1") == {}
    assert doomed_child.signals == ["TERM"]
    clock.advance(10)  # the grace period: then SIGKILL
    assert doomed_child.signals == ["TERM", "KILL"]
    assert other_child.signals == []  # another bottle's session is left alone


def _tty_session_with_client() -> tuple[ExecBridge, _Child, StringTransport]:
    clock = Clock()
    bridge = ExecBridge(
        bottle="b1", peer="uid=0", tty=True, stdin=True, clock=clock, resize=lambda *_: None
    )
    child = _Child()
    bridge.makeConnection(child)  # type: ignore[arg-type]
    client = StringTransport()
    bridge.attach(client, b"")
    return bridge, child, client


@pytest.mark.parametrize("payload", [b"", b"\x00\x18\x00", b"\x00\x18\x00\x50\x00"])
def test_resize_frame_of_the_wrong_size_is_a_stream_error(payload: bytes) -> None:
    """T8: a RESIZE frame whose payload is not 4 bytes used to raise past the parser."""
    bridge, _child, client = _tty_session_with_client()
    with capturedLogs() as events:
        bridge.client_data(stream.encode(stream.RESIZE, payload))
    assert client.disconnecting  # the session is closed (aborted)
    (line,) = [formatEvent(e) for e in events]
    assert "resize frame must hold 4 bytes" in line
    assert not any(e.get("log_failure") for e in events)  # no traceback


def test_client_went_away_is_logged_once() -> None:
    """T8: "went away" was logged twice per session (producer stop, then connection lost)."""
    bridge, child, _client = _tty_session_with_client()
    with capturedLogs() as events:
        bridge.stopProducing()  # the connection stops its producer...
        bridge.client_lost()  # ...and then reports the loss
    assert sum("went away" in formatEvent(e) for e in events) == 1
    assert child.signals == ["TERM"]


class _SlowSpawnBackend(FakeBackend):
    """spawn_exec waits for ``started`` (smolvm starting the command), then attaches a child."""

    def __init__(self) -> None:
        super().__init__()
        self.started: Deferred[None] = Deferred()
        self.child = _Child()

    async def spawn_exec(self, name: str, request: object, protocol: ExecBridge) -> _Child:
        await self.started
        protocol.makeConnection(self.child)  # type: ignore[arg-type]
        return self.child


def test_exec_whose_spawn_outlasts_the_destroy_is_ended() -> None:
    """T13: an Exec accepted just before DestroyBottle, started after it, is ended too."""
    backend = _SlowSpawnBackend()
    factory = make_factory(backend, clock=Clock())
    admin = Conn(factory)
    admin.call(C.CreateBottle, name="b1")
    execer = Conn(factory)
    execer.send(codec.encode_request(C.Exec, b"1", {"bottle": "b1", "argv": ["sleep", "9"]}))
    assert admin.call(C.DestroyBottle, name="b1") == {}
    assert backend.child.signals == []  # nothing to end yet: smolvm is still starting it
    backend.started.callback(None)
    assert backend.child.signals == ["TERM"]


class UnixClient(StringTransport):
    """A client connection that can carry file descriptors: records the ones it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.sent_fds: list[int] = []

    def sendFileDescriptor(self, fd: int) -> None:
        self.sent_fds.append(fd)


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _fd_session() -> tuple[ExecBridge, _Child, UnixClient, list[int]]:
    bridge = ExecBridge(
        bottle="b1",
        peer="uid=0",
        tty=False,
        stdin=True,
        clock=Clock(),
        resize=lambda *_: None,
        fds=True,
    )
    child_ends = list(bridge.make_stdio())
    bridge.spawned()
    child = _Child()
    bridge.makeConnection(child)  # type: ignore[arg-type]
    client = UnixClient()
    bridge.attach(client, b"")
    return bridge, child, client, child_ends


def test_fd_session_hands_the_pipes_and_keeps_no_copy() -> None:
    """The client's ends go out on FDS after FDS_READY; once taken, the daemon has none."""
    bridge, _child, client, child_ends = _fd_session()
    assert not any(_open(fd) for fd in child_ends)  # the child has its own copies
    assert client.sent_fds == [] and client.value() == b""
    bridge.client_data(stream.encode(stream.FDS_READY))
    assert len(client.sent_fds) == 3 and all(_open(fd) for fd in client.sent_fds)
    assert client.value() == stream.encode(stream.FDS, b"\0\0\0")
    bridge.client_data(stream.encode(stream.FDS_TAKEN))
    assert not any(_open(fd) for fd in client.sent_fds)


def test_fd_session_whose_client_leaves_closes_the_pipes_and_ends_the_command() -> None:
    """A client gone before it took the pipes: the daemon's copies close, the command ends."""
    bridge, child, client, _ = _fd_session()
    bridge.client_data(stream.encode(stream.FDS_READY))
    sent = list(client.sent_fds)
    bridge.client_lost()
    assert not any(_open(fd) for fd in sent)
    assert child.signals == ["TERM"]


def test_a_scoped_peers_destroy_ends_its_bottles_exec_sessions() -> None:
    """A scoped peer names its bottle in its own name space: its DestroyBottle still ends the
    sessions kept under the node's name of that bottle, and no other bottle's."""
    clock = Clock()
    backend = FakeBackend()
    factory = make_factory(backend, uid=4243, scoped_uids=frozenset({4243}), clock=clock)
    conn = Conn(factory)
    capability = mint_capability()
    conn.call(C.CreateBottle, name="b1", capability=capability)
    (node_name,) = backend.bottles
    assert node_name != "b1"  # the scoped name space: the node's name is another
    doomed, doomed_child = _session(node_name, clock)
    other, other_child = _session("b1", clock)  # an operator's bottle called b1
    factory.context.exec_sessions.update({doomed, other})
    assert conn.call(C.DestroyBottle, name="b1", capability=capability) == {}
    assert doomed_child.signals == ["TERM"] and other_child.signals == []
