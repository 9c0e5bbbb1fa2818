"""FastClientEndpoint on the real reactor: connect, refuse, time out, cancel, UNIX."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
from twisted.internet import reactor
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.error import (
    ConnectError,
    ConnectingCancelledError,
    ConnectionRefusedError,
    TimeoutError,
)
from twisted.trial import unittest

from bottlenet.forward.connect import FastClientEndpoint, HeldClient
from tests.forward.netutil import Collector, Echo, factory_of
from tests.forward.test_loopback import tempdir


def attempts_in_reactor() -> list[Any]:
    return [w for w in reactor.getWriters() if type(w).__name__ == "_Attempt"]


def test_sockets_are_non_blocking_where_the_platform_has_no_sock_nonblock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """macOS has no SOCK_NONBLOCK: the socket is made non-blocking anyway (a blocking one
    would let a connect or a transport write stall the whole reactor)."""
    from bottlenet.forward import connect

    monkeypatch.setattr(connect, "_NONBLOCK", 0)
    monkeypatch.setattr(connect, "_SOCK_FLAGS", socket.SOCK_STREAM)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        ep = FastClientEndpoint(reactor, IPv4Address("TCP", *listener.getsockname()), 5)
        sock, err = ep.open()
        assert sock is not None and err in (0, *connect._IN_PROGRESS)
        with sock:
            assert not sock.getblocking()


class FastEndpointTests(unittest.TestCase):
    def listen(self) -> int:
        port = reactor.listenTCP(0, factory_of(Echo), interface="127.0.0.1")  # type: ignore[attr-defined]
        self.addCleanup(port.stopListening)
        return int(port.getHost().port)

    async def test_connects_tuned_and_starts_paused(self) -> None:
        ep = FastClientEndpoint(reactor, IPv4Address("TCP", "127.0.0.1", self.listen()), 5)
        c = Collector(b"hi", fin=True)
        proto = await ep.connect(factory_of(lambda: c))
        assert proto is c
        t = c.transport
        assert isinstance(t, HeldClient)
        sk = t.getHandle()
        assert sk.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert sk.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert t.getPeer().port == ep.peer.port  # type: ignore[union-attr]
        assert t not in reactor.getReaders()  # held until resumed
        t.resumeProducing()
        await c.done
        assert bytes(c.received) == b"hi" and c.clean

    async def test_refused(self) -> None:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        ep = FastClientEndpoint(reactor, IPv4Address("TCP", "127.0.0.1", port), 5)
        with self.assertRaises(ConnectionRefusedError):
            await ep.connect(factory_of(Collector))

    def full_backlog(self) -> tuple[int, list[socket.socket]]:
        """A listener that never accepts, with its queue full: new SYNs get no answer."""
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        held = [srv]
        for _ in range(8):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(srv.getsockname())
            held.append(c)
        for sk in held:
            self.addCleanup(sk.close)
        return srv.getsockname()[1], held

    async def test_times_out_and_leaves_no_timer_or_writer(self) -> None:
        port, _ = self.full_backlog()
        ep = FastClientEndpoint(reactor, IPv4Address("TCP", "127.0.0.1", port), 0.2)
        d = ep.connect(factory_of(Collector))
        assert not d.called and attempts_in_reactor()
        with self.assertRaises(TimeoutError):
            await d
        assert not attempts_in_reactor()
        assert ep._timer is None  # lazy: nothing scheduled while nothing connects

    async def test_cancel(self) -> None:
        port, _ = self.full_backlog()
        ep = FastClientEndpoint(reactor, IPv4Address("TCP", "127.0.0.1", port), 30)
        d = ep.connect(factory_of(Collector))
        assert ep._timer is not None
        d.cancel()
        with self.assertRaises(ConnectingCancelledError):
            await d
        assert not attempts_in_reactor()
        # The shared timer fires later with nothing left to do and is not re-armed.
        ep._timer.cancel()
        ep._expire()
        assert ep._timer is None and not ep._pending

    async def test_unix(self) -> None:
        path = os.path.join(tempdir(self), "t.sock")
        port = reactor.listenUNIX(path, factory_of(Echo))  # type: ignore[attr-defined]
        self.addCleanup(port.stopListening)
        ep = FastClientEndpoint(reactor, UNIXAddress(path), 5)
        c = Collector(b"unix", fin=True)
        await ep.connect(factory_of(lambda: c))
        c.transport.resumeProducing()  # type: ignore[union-attr]
        await c.done
        assert bytes(c.received) == b"unix" and c.clean

    async def test_ipv6(self) -> None:
        try:
            port = reactor.listenTCP(0, factory_of(Echo), interface="::1")  # type: ignore[attr-defined]
        except Exception:
            raise unittest.SkipTest("no IPv6 loopback") from None
        self.addCleanup(port.stopListening)
        ep = FastClientEndpoint(reactor, IPv6Address("TCP", "::1", port.getHost().port), 5)
        c = Collector(b"six", fin=True)
        await ep.connect(factory_of(lambda: c))
        c.transport.resumeProducing()  # type: ignore[union-attr]
        await c.done
        assert bytes(c.received) == b"six"

    async def test_factory_refusal_closes_the_socket(self) -> None:
        ep = FastClientEndpoint(reactor, IPv4Address("TCP", "127.0.0.1", self.listen()), 5)
        f = factory_of(Collector)
        f.buildProtocol = lambda addr: None  # type: ignore[method-assign, assignment, return-value]
        before = len(os.listdir("/proc/self/fd"))
        with self.assertRaises(ConnectError):
            await ep.connect(f)
        assert len(os.listdir("/proc/self/fd")) == before  # the connected socket was closed
