"""Security-2 T3: an exec's stdin is back-pressured for tty and non-tty alike.

A real child (``sleep``, which never reads its input) on a real pipe or pty, spawned by the
real reactor with an :class:`ExecBridge` as its protocol; the client is a string transport
that records whether the bridge paused it. Frames are fed synchronously, so nothing drains
the child's stdin meanwhile: the daemon's buffer for it must stop growing once the client
is paused (trial TestCases: the real reactor runs the children).
"""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred
from twisted.internet.testing import StringTransport
from twisted.trial import unittest

from bottlenet.control import stream
from bottlenet.control.execbroker import ExecBridge

reactor: Any = _reactor
CHUNK = stream.encode(stream.STDIN, b"\0" * (stream.MAX_FRAME - 1))
#: What the test may feed (a bound for the broken case: it would buffer all of it).
FEED_LIMIT = 64 * 1024 * 1024


class StdinBackPressureTests(unittest.TestCase):
    def _session(self, *, tty: bool) -> tuple[ExecBridge, StringTransport, Deferred[None]]:
        ended: Deferred[None] = Deferred()
        bridge = ExecBridge(
            bottle="b1",
            peer="test",
            tty=tty,
            stdin=True,
            clock=reactor,
            resize=lambda *_: None,
            on_end=lambda _: ended.callback(None),
        )
        reactor.spawnProcess(
            bridge, "sleep", ["sleep", "60"], env={"PATH": "/usr/bin:/bin"}, usePTY=tty
        )
        client = StringTransport()
        bridge.attach(client, b"")
        return bridge, client, ended

    def _flood(self, *, tty: bool) -> Deferred[None]:
        bridge, client, ended = self._session(tty=tty)
        fed = 0
        while client.producerState == "producing" and fed < FEED_LIMIT:
            bridge.client_data(CHUNK)
            fed += len(CHUNK)
        process: Any = bridge.process
        buffered = sum(map(len, process._tempDataBuffer)) + len(process.dataBuffer) if tty else 0
        self.assertEqual(client.producerState, "paused")  # the client's reading stopped
        self.assertLess(fed, 1024 * 1024)
        self.assertLess(buffered, 1024 * 1024)
        bridge.client_lost()  # the command ends with its client
        return ended

    def test_tty_exec_stdin_pauses_the_client(self) -> Deferred[None]:
        """T3: a tty exec used to buffer every STDIN frame the command did not read."""
        return self._flood(tty=True)

    def test_pipe_exec_stdin_pauses_the_client(self) -> Deferred[None]:
        """The non-tty exec keeps the same bound (its pipe's producer)."""
        return self._flood(tty=False)
