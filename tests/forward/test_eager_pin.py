"""Pin the private Twisted behaviour the eager send / eager FIN rely on.

If Twisted is upgraded, ``EAGER_VERIFIED_TWISTED`` no longer matches and the relay silently
falls back to plain ``write()``; this test makes that fail loudly instead, so someone re-checks
``abstract.FileDescriptor``/``tcp.Connection`` (write buffer attributes, ``_writeDisconnecting``,
``_writeDisconnected``, ``_shouldShutdown``) and then adds the new version to the set.
"""

from __future__ import annotations

import inspect
import ipaddress
from typing import Any

from twisted.internet import abstract, reactor, tcp
from twisted.trial import unittest

import twisted
from bottlenet.forward import relay
from bottlenet.forward.spec import ForwardSpec, TCPListen, TCPTarget
from bottlenet.forward.table import ForwardTable
from tests.forward.netutil import Collector, Echo, connect_tcp, factory_of, registry_with
from tests.forward.test_loopback import LOOP, tempdir


def test_twisted_version_is_verified_for_eager_send() -> None:
    assert twisted.__version__ in relay.EAGER_VERIFIED_TWISTED, (
        f"Twisted {twisted.__version__} is not verified for the eager send: re-check the private"
        " attributes it uses, then add the version to EAGER_VERIFIED_TWISTED"
    )
    assert relay.EAGER_SEND is True


def test_private_write_state_still_means_what_eager_send_assumes() -> None:
    fd = abstract.FileDescriptor
    write_src = inspect.getsource(fd.write)
    assert "self._tempDataBuffer.append(data)" in write_src
    assert "self._tempDataLen += len(data)" in write_src
    do_write = inspect.getsource(fd.doWrite)
    assert "self.offset == len(self.dataBuffer) and not self._tempDataLen" in do_write
    assert "self._writeDisconnected = True" in do_write
    assert "self._closeWriteConnection()" in do_write
    assert "self.socket.shutdown(1)" in inspect.getsource(tcp.Connection._closeWriteConnection)
    assert "if self._shouldShutdown:" in inspect.getsource(tcp._SocketCloser._closeSocket)
    assert "if self._writeDisconnected:" in inspect.getsource(fd.loseConnection)


def test_unverified_version_falls_back_to_write(monkeypatch: Any) -> None:
    monkeypatch.setattr(twisted, "__version__", "99.0.0")
    assert relay._eager_supported() is False


class EagerPathTests(unittest.TestCase):
    async def test_small_messages_bypass_the_write_buffer(self) -> None:
        """With eager send on, an echo round trip never goes through transport.write()."""
        tport = reactor.listenTCP(0, factory_of(Echo), interface="127.0.0.1")  # type: ignore[attr-defined]
        self.addCleanup(tport.stopListening)
        table = ForwardTable(reactor, registry_with(("b1", "127.77.0.2")), state_dir=tempdir(self))
        self.addCleanup(table.stopService)
        spec = ForwardSpec(
            "b1",
            "web",
            TCPListen(ipaddress.IPv4Address("127.77.0.2"), 0),
            TCPTarget(LOOP, tport.getHost().port),
        )
        info = await table.add(spec)
        writes: list[int] = []
        real_start = relay.TransportRelay.start

        def spy_start(self: relay.TransportRelay, inbound: Any, outbound: Any) -> None:
            for t in (inbound.transport, outbound.transport):
                orig = t.write
                t.write = lambda data, orig=orig: (writes.append(len(data)), orig(data))
            real_start(self, inbound, outbound)

        relay.TransportRelay.start = spy_start  # type: ignore[method-assign]
        self.addCleanup(setattr, relay.TransportRelay, "start", real_start)
        c = Collector(b"ping" * 16, fin=True)
        assert isinstance(info.bound, TCPListen)
        await connect_tcp("127.77.0.2", info.bound.port, c)
        await c.done
        assert bytes(c.received) == b"ping" * 16 and c.clean
        assert writes == [], "eager send not taken: the private-attribute pin is stale"
