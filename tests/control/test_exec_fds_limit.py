"""An fd session's time limit in process: a real ``sh`` on the pipes an :class:`ExecBridge` made,
spawned by the real reactor; the limit's timer is a :class:`Clock` the test passes once the
command's first line is in the client's pipe (trial TestCase: the real reactor runs the child).

The process-level proof (a daemon ends a command past its limit, exit 124, and logs it) is
``tests/control/test_exec_fds.py``; this is its rule without waiting the limit out.
"""

from __future__ import annotations

import os
import select
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial import unittest

from bottlenet.control import stream
from bottlenet.control.execbroker import TIMEOUT_EXIT, ExecBridge

reactor: Any = _reactor
LIMIT = 5


class FdTimeLimitTests(unittest.TestCase):
    timeout = 60

    def test_the_limit_ends_a_command_whose_bytes_the_daemon_never_saw(self) -> Deferred[None]:
        """The deadline ends an fd session's command (exit 124); its output before the end is
        in the client's pipe, and the daemon framed none of it."""
        clock = Clock()
        bridge = ExecBridge(
            bottle="b1",
            peer="test",
            tty=False,
            stdin=False,
            clock=clock,
            resize=lambda *_: None,
            fds=True,
        )
        stdio = bridge.make_stdio()
        reactor.spawnProcess(
            bridge,
            "sh",
            ["sh", "-c", "echo early; exec sleep 1000"],
            env={"PATH": "/usr/bin:/bin"},
            childFDs=dict(enumerate(stdio)),
        )
        bridge.spawned()
        bridge.set_deadline(LIMIT)
        client = _FdClient()
        self.addCleanup(client.close_fds)
        bridge.attach(client, b"")
        bridge.client_data(stream.encode(stream.FDS_READY))
        bridge.client_data(stream.encode(stream.FDS_TAKEN))
        out = client.fds[1]
        ready, _, _ = select.select([out], [], [], 30)
        self.assertTrue(ready, "no output from the command")
        self.assertEqual(os.read(out, 100), b"early\n")
        clock.advance(LIMIT)  # the limit is over: the command is ended

        def ended(_: None) -> None:
            frames = stream.FrameParser(stream.DAEMON_KINDS | stream.FD_DAEMON_KINDS).feed(
                client.value()
            )
            self.assertEqual(
                [f.kind for f in frames], [stream.FDS, stream.EXIT]
            )  # no STDOUT frame: the daemon never saw the bytes
            self.assertEqual(stream.decode_exit(frames[-1].payload), TIMEOUT_EXIT)
            self.assertEqual(os.read(out, 100), b"")  # the command and its pipe are gone

        return client.closed.addCallback(ended)


class _FdClient(StringTransport):
    """A client connection that receives file descriptors (its own copies, as ``SCM_RIGHTS``
    gives) and says when the bridge closes it (after the EXIT frame)."""

    def __init__(self) -> None:
        super().__init__()
        self.fds: list[int] = []
        self.closed: Deferred[None] = Deferred()

    def sendFileDescriptor(self, fd: int) -> None:
        self.fds.append(os.dup(fd))

    def loseConnection(self) -> None:
        super().loseConnection()
        if not self.closed.called:
            self.closed.callback(None)

    def close_fds(self) -> None:
        for fd in self.fds:
            os.close(fd)
