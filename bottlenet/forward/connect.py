"""A cheap client endpoint: a non-blocking connect straight on the reactor.

``TCP4ClientEndpoint`` builds, per connection, a ``_WrappingFactory``, a ``_WrappingProtocol``,
a ``Connector``, a ``tcp.Client`` (which resolves the host again and sets the socket
non-blocking with an extra syscall), a timeout ``DelayedCall`` and several Deferreds; and the
first connect attempt always waits one reactor pass for the socket to become writable. On a
loopback target the kernel completes the handshake inside the first ``connect()``, so a second
``connect()`` right away almost always reports success and the relay can start in the same
reactor pass. That setup chain was the largest part of the relay's cost per connection.

:class:`FastClientEndpoint` is an ``IStreamClientEndpoint`` for TCP (v4/v6) and UNIX stream
targets given as literal addresses: it creates a non-blocking socket (``SOCK_NONBLOCK``, or
``setblocking`` where the platform has no such flag),
tunes it before connecting, connects, and only when that is still in progress registers a
small write descriptor with the reactor. Attempts stay cancellable and time out; the timeouts
of one endpoint share a single lazily scheduled ``DelayedCall`` (none exists while nothing is
connecting, so an idle daemon has no timer). The transport it builds, :class:`HeldClient`, is
a ``tcp.Connection`` that starts paused like the accepted leg and can hand its socket over to
a splice relay (``detach_socket``).
"""

from __future__ import annotations

import errno
import os
import socket
from collections import deque
from typing import TYPE_CHECKING, Any, cast

from twisted.internet import abstract, error, tcp
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import (
    IDelayedCall,
    IProtocol,
    IProtocolFactory,
    IReactorFDSet,
    IReactorTime,
    IStreamClientEndpoint,
    IWriteDescriptor,
)
from twisted.python.failure import Failure
from zope.interface import implementer

from bottlenet.forward.listen import _StartsPaused

if TYPE_CHECKING:
    _ConnectionBase = tcp.Server
else:
    _ConnectionBase = tcp.Connection

_IN_PROGRESS = frozenset({errno.EINPROGRESS, errno.EALREADY, errno.EAGAIN, errno.EWOULDBLOCK})
_CONNECTED = frozenset({0, errno.EISCONN})
#: Linux creates the socket non-blocking; elsewhere (macOS has no SOCK_NONBLOCK) ``open`` sets
#: it, or a connect, and every write of the transport, could block the whole reactor.
_NONBLOCK = getattr(socket, "SOCK_NONBLOCK", 0)
_SOCK_FLAGS = socket.SOCK_STREAM | _NONBLOCK | getattr(socket, "SOCK_CLOEXEC", 0)

Address = IPv4Address | IPv6Address | UNIXAddress


class HeldClient(_StartsPaused, _ConnectionBase):
    """The transport of a connected outbound socket: a ``tcp.Connection`` that starts paused.

    Built only by :class:`FastClientEndpoint`, with a socket that is already non-blocking (so
    ``tcp.Connection.__init__``'s ``setblocking`` syscall is skipped).
    """

    def __init__(
        self, sock: socket.socket, protocol: IProtocol, reactor: Any, peer: Address
    ) -> None:
        abstract.FileDescriptor.__init__(self, reactor=reactor)
        self.socket = sock
        self.fileno = sock.fileno
        self.protocol = protocol
        self._peer = peer
        self.connected = 1
        self.logstr = "bottlenet.forward.client"

    def getPeer(self) -> Address:
        return self._peer

    def getHost(self) -> Address:
        name = self.socket.getsockname()
        if isinstance(self._peer, UNIXAddress):
            return UNIXAddress(name or None)
        if isinstance(self._peer, IPv6Address):
            return IPv6Address("TCP", name[0], name[1])
        return IPv4Address("TCP", name[0], name[1])

    def logPrefix(self) -> str:
        return self.logstr


@implementer(IWriteDescriptor)
class _Attempt:
    """A connect still in progress: writable means the handshake finished (or failed)."""

    __slots__ = ("deadline", "deferred", "endpoint", "factory", "sock")

    def __init__(
        self, endpoint: FastClientEndpoint, sock: socket.socket, factory: IProtocolFactory
    ) -> None:
        self.endpoint = endpoint
        self.sock: socket.socket | None = sock
        self.factory = factory
        self.deadline = endpoint._clock.seconds() + endpoint.timeout
        self.deferred: Deferred[IProtocol] = Deferred(self._cancel)

    def fileno(self) -> int:
        return self.sock.fileno() if self.sock is not None else -1

    def logPrefix(self) -> str:
        return "bottlenet.forward.connect"

    def doWrite(self) -> None:
        sock = self.sock
        if sock is None:
            return None
        err = sock.connect_ex(self.endpoint._sockaddr)
        if err in _IN_PROGRESS:
            return None
        factory, d = self._stop()
        if err in _CONNECTED:
            self.endpoint._connected(sock, factory, d)
        else:
            sock.close()
            d.errback(_connect_error(err))
        return None

    def connectionLost(self, reason: Failure) -> None:
        # The reactor gave up on the descriptor (EPOLLERR/HUP without a write event).
        sock = self.sock
        if sock is None:
            return
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) or errno.ECONNREFUSED
        _, d = self._stop()
        sock.close()
        d.errback(_connect_error(err))

    def expire(self) -> None:
        sock = self.sock
        if sock is None:
            return
        _, d = self._stop()
        sock.close()
        d.errback(error.TimeoutError(string="connect timed out"))

    def _cancel(self, d: Deferred[IProtocol]) -> None:
        sock = self.sock
        if sock is None:
            return
        self._stop()
        sock.close()
        d.errback(error.ConnectingCancelledError(self.endpoint.peer))

    def _stop(self) -> tuple[IProtocolFactory, Deferred[IProtocol]]:
        """Unregister and drop every reference (the timeout queue may keep this object)."""
        cast(IReactorFDSet, self.endpoint._reactor).removeWriter(self)
        self.sock = None
        factory, d = self.factory, self.deferred
        self.factory = _NO_FACTORY
        self.deferred = _NO_DEFERRED
        return factory, d


_NO_FACTORY: IProtocolFactory = cast(IProtocolFactory, None)
_NO_DEFERRED: Deferred[IProtocol] = cast("Deferred[IProtocol]", None)


def _connect_error(err: int) -> Exception:
    return error.getConnectError((err, os.strerror(err)))


@implementer(IStreamClientEndpoint)
class FastClientEndpoint:
    """``IStreamClientEndpoint`` connecting to a literal TCP or UNIX address (see module doc).

    ``tune_tcp`` sets TCP_NODELAY and SO_KEEPALIVE before connecting (a relay must not add
    Nagle delay, and long idle sessions need keepalive).
    """

    def __init__(
        self,
        reactor: Any,
        peer: Address,
        timeout: float = 30.0,
        *,
        tune_tcp: bool = True,
    ) -> None:
        self._reactor = reactor
        self._clock: IReactorTime = reactor
        self.peer = peer
        self.timeout = timeout
        self._tune = tune_tcp and not isinstance(peer, UNIXAddress)
        if isinstance(peer, UNIXAddress):
            assert peer.name is not None
            self._family = socket.AF_UNIX
            self._sockaddr: Any = peer.name
        elif isinstance(peer, IPv6Address):
            self._family = socket.AF_INET6
            self._sockaddr = (peer.host, peer.port, 0, 0)
        else:
            self._family = socket.AF_INET
            self._sockaddr = (peer.host, peer.port)
        self._pending: deque[_Attempt] = deque()
        self._timer: IDelayedCall | None = None

    def open(self) -> tuple[socket.socket | None, int]:
        """Start a connect: ``(sock, 0)`` connected, ``(sock, errno)`` still in progress, or
        ``(None, errno)`` failed. :meth:`connect` takes the pair on from there (``started``)."""
        try:
            sock = socket.socket(self._family, _SOCK_FLAGS)
        except OSError as e:
            return None, e.errno or errno.EMFILE
        try:
            if not _NONBLOCK:
                sock.setblocking(False)
            if self._tune:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sockaddr = self._sockaddr
            err = sock.connect_ex(sockaddr)
            if err in _IN_PROGRESS:
                # Loopback: the handshake usually completed inside the first connect().
                err = sock.connect_ex(sockaddr)
        except OSError as e:
            sock.close()
            return None, e.errno or errno.EINVAL
        if err in _CONNECTED:
            return sock, 0
        if err in _IN_PROGRESS:
            return sock, err
        sock.close()
        return None, err

    def connect(
        self,
        protocolFactory: IProtocolFactory,
        started: tuple[socket.socket | None, int] | None = None,
    ) -> Deferred[IProtocol]:
        """``IStreamClientEndpoint.connect``; ``started`` continues a connect :meth:`open`
        began (the relay's accept fast path falls back to transports with it)."""
        sock, err = self.open() if started is None else started
        if sock is None:
            return fail(_connect_error(err))
        if err == 0:
            d: Deferred[IProtocol] = Deferred()
            self._connected(sock, protocolFactory, d)
            return d
        attempt = _Attempt(self, sock, protocolFactory)
        cast(IReactorFDSet, self._reactor).addWriter(attempt)
        self._pending.append(attempt)
        if self._timer is None:
            self._timer = self._clock.callLater(self.timeout, self._expire)
        return attempt.deferred

    def _connected(
        self, sock: socket.socket, factory: IProtocolFactory, d: Deferred[IProtocol]
    ) -> None:
        try:
            protocol = factory.buildProtocol(self.peer)
            if protocol is None:
                sock.close()
                d.errback(error.ConnectError(string="the protocol factory refused"))
                return
            transport = HeldClient(sock, protocol, self._reactor, self.peer)
            protocol.makeConnection(transport)
        except BaseException:
            sock.close()
            d.errback(Failure())
            return
        d.callback(protocol)

    def _expire(self) -> None:
        """Time out every attempt past its deadline, then re-arm for the oldest live one."""
        self._timer = None
        pending = self._pending
        now = self._clock.seconds()
        while pending:
            head = pending[0]
            if head.sock is None:
                pending.popleft()
            elif head.deadline <= now:
                pending.popleft().expire()
            else:
                self._timer = self._clock.callLater(head.deadline - now, self._expire)
                return


__all__ = ["FastClientEndpoint", "HeldClient"]
