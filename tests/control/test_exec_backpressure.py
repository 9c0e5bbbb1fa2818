"""Security-2 T3: an exec's stdin is back-pressured for tty and non-tty alike.

A real child (``sleep``, which never reads its input) on a real pipe or pty, spawned by the
real reactor with an :class:`ExecBridge` as its protocol; the client is a string transport
that records whether the bridge paused it. Frames are fed synchronously, so nothing drains
the child's stdin meanwhile: the daemon's buffer for it must stop growing once the client
is paused (trial TestCases: the real reactor runs the children).
"""

from __future__ import annotations

import os
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial import unittest

from bottlenet.control import stream
from bottlenet.control.execbroker import KILL_GRACE, ExecBridge

reactor: Any = _reactor
CHUNK = stream.encode(stream.STDIN, b"\0" * (stream.MAX_FRAME - 1))
#: What the test may feed (a bound for the broken case: it would buffer all of it).
FEED_LIMIT = 64 * 1024 * 1024


class StdinBackPressureTests(unittest.TestCase):
    def _session(self, *, tty: bool) -> tuple[ExecBridge, StringTransport, Clock, Deferred[None]]:
        ended: Deferred[None] = Deferred()
        clock = Clock()  # the KILL grace's timer: the test ends it at once, not in 3 s
        bridge = ExecBridge(
            bottle="b1",
            peer="test",
            tty=tty,
            stdin=True,
            clock=clock,
            resize=lambda *_: None,
            on_end=lambda _: ended.callback(None),
        )
        reactor.spawnProcess(
            bridge, "sleep", ["sleep", "60"], env={"PATH": "/usr/bin:/bin"}, usePTY=tty
        )
        client = StringTransport()
        bridge.attach(client, b"")
        return bridge, client, clock, ended

    def _flood(self, *, tty: bool) -> Deferred[None]:
        bridge, client, clock, ended = self._session(tty=tty)
        fed = 0
        while client.producerState == "producing" and fed < FEED_LIMIT:
            bridge.client_data(CHUNK)
            fed += len(CHUNK)
        process: Any = bridge.process
        buffered = sum(map(len, process._tempDataBuffer)) + len(process.dataBuffer) if tty else 0
        self.assertEqual(client.producerState, "paused")  # the client's reading stopped
        self.assertLess(fed, 1024 * 1024)
        self.assertLess(buffered, 1024 * 1024)
        bridge.client_lost()  # the command ends with its client: SIGTERM, then SIGKILL
        # A SIGTERM that reaches the forked child before it has exec'd ``sleep`` meets the
        # handler it inherited from this process and is lost, so the end may take the KILL
        # grace (3 s in the full suite): its timer is the Clock's, passed here at once (a
        # child the TERM ended has cancelled it: then no KILL is sent).
        clock.advance(KILL_GRACE)
        return ended

    def test_tty_exec_stdin_pauses_the_client(self) -> Deferred[None]:
        """T3: a tty exec used to buffer every STDIN frame the command did not read."""
        return self._flood(tty=True)

    def test_pipe_exec_stdin_pauses_the_client(self) -> Deferred[None]:
        """The non-tty exec keeps the same bound (its pipe's producer)."""
        return self._flood(tty=False)

    def test_the_clients_end_of_input_ends_a_command_reading_stdin(self) -> Deferred[None]:
        """A real ``cat`` on a real pipe: 300 KB of input fill the pipe's buffer (its writer
        pauses the client), then the client's STDIN_EOF must still reach ``cat`` as an end of
        file: a pipe with a producer registered never closes, so the pauser is unregistered
        first (tests-3 X13, caught before only by a hang in test_remote). A pause and a
        resume of the registered producer pause and resume the client (X11)."""
        bridge = ExecBridge(
            bottle="b1", peer="test", tty=False, stdin=True, clock=reactor, resize=lambda *_: None
        )
        reactor.spawnProcess(bridge, "cat", ["cat"], env={"PATH": "/usr/bin:/bin"})
        client = _ClosingClient()
        bridge.attach(client, b"")
        stdin_producer = bridge.process.pipes[0].producer  # type: ignore[union-attr]
        stdin_producer.pauseProducing()
        self.assertEqual(client.producerState, "paused")
        stdin_producer.resumeProducing()
        self.assertEqual(client.producerState, "producing")
        payload = os.urandom(150_000).hex().encode()
        frames = [
            stream.encode(stream.STDIN, payload[i : i + 65536]) for i in range(0, 300_000, 65536)
        ]
        bridge.client_data(b"".join(frames))
        self.assertEqual(client.producerState, "paused")  # the pipe's buffer is over its size
        bridge.client_data(stream.encode(stream.STDIN_EOF))  # while the writer is paused

        def exited(_: None) -> None:
            got = stream.FrameParser(stream.DAEMON_KINDS).feed(client.value())
            self.assertEqual(got[-1], stream.Frame(stream.EXIT, stream.encode_exit(0)[5:]))
            self.assertEqual(b"".join(f.payload for f in got[:-1]), payload)

        return client.closed.addCallback(exited)

    test_the_clients_end_of_input_ends_a_command_reading_stdin.timeout = 60  # type: ignore[attr-defined]


class _ClosingClient(StringTransport):
    """A client connection that says when the bridge closes it (after the EXIT frame)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed: Deferred[None] = Deferred()

    def loseConnection(self) -> None:
        super().loseConnection()
        if not self.closed.called:
            self.closed.callback(None)
