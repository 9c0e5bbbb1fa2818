"""Listening ports for agent endpoints, with an accept loop that survives fd exhaustion.

Twisted's ``tcp.Port.doRead`` logs and returns when ``accept()`` fails with EMFILE/ENFILE
(after its one reserved descriptor is used up, or at once for ENFILE), and epoll reports the
listener readable again immediately: a busy loop at 100% CPU for as long as the process is at
its limit (twisted#5368). The ports here stop reading the listener instead and try again after
a timer backoff (0.1 s doubling to 1 s); connections wait in the kernel backlog meanwhile.

This overrides ``doRead`` of ``tcp.Port``/``unix.Port``, a private-API dependency (it uses
``transport``, ``sessionno``, ``numberAccepts`` and ``_buildAddr``); the real-socket tests in
``tests/forward`` exercise it on the Twisted version in use. A refused connection (the factory
returns None) is closed with SO_LINGER 0, so the client sees a reset, not a clean EOF.

The endpoints are :class:`IStreamServerEndpoint` providers like ``TCP4ServerEndpoint`` and
``UNIXServerEndpoint``, which cannot be told which port class to use. SO_REUSEPORT is never set.
"""

from __future__ import annotations

import errno
import os
import socket
from socket import SO_LINGER, SOL_SOCKET
from typing import TYPE_CHECKING, Any, cast

from twisted.internet import defer, tcp, unix
from twisted.internet.interfaces import (
    IDelayedCall,
    IListeningPort,
    IProtocol,
    IProtocolFactory,
    IReactorFDSet,
    IReactorTime,
    IStreamServerEndpoint,
)
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from bottlenet.forward.spec import LINGER_RST

BACKOFF_FIRST = 0.1
BACKOFF_MAX = 1.0
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_RETRY = frozenset({errno.ECONNABORTED, errno.EPERM, errno.EPROTO, errno.EINTR})


if TYPE_CHECKING:
    _PortBase = tcp.Port
    _ServerBase = tcp.Server
else:
    _PortBase = object
    _ServerBase = object


def _no_fileno() -> int:
    return -1


def _reset(skt: socket.socket) -> None:
    """Close a refused connection with SO_LINGER 0: the client sees a reset, not an EOF."""
    skt.setsockopt(SOL_SOCKET, SO_LINGER, LINGER_RST)
    skt.close()


class _StartsPaused(_ServerBase):
    """An accepted transport that does not read until its first ``resumeProducing()``.

    A relay pauses its accepted leg at once anyway (until the target is connected); starting
    paused saves registering the socket with epoll only to unregister it again. ``Port.transport``
    is documented as replaceable with anything taking ``Server.__init__``'s arguments.

    While it is still held (never read, never written), :meth:`detach_socket` hands the socket
    over for good to a relay that moves bytes itself (``splice.SpliceRelay``).
    """

    _held = True

    def startReading(self) -> None:
        if not self._held:
            super().startReading()

    def resumeProducing(self) -> None:
        self._held = False
        super().resumeProducing()

    def detachable(self) -> bool:
        """True while the transport never read, wrote or started closing (nothing buffered)."""
        return (
            self._held
            and bool(self.connected)
            and not self.disconnecting
            and not self.disconnected
            and not self.dataBuffer
            and not self._tempDataLen
            and self.producer is None
            # trap 5: splice needs non-blocking sockets
            and self.socket.gettimeout() == 0.0
        )

    def detach_socket(self) -> socket.socket | None:
        """Give the socket away, or None if it is not :meth:`detachable`.

        Afterwards the transport is inert: it is not connected, so ``write``,
        ``loseConnection``, ``abortConnection`` and ``resumeProducing`` are no-ops, its
        ``fileno()`` is -1, and it no longer refers to the socket, so nothing in Twisted can
        shut down, linger-reset or close the socket (traps 2: a ``dup()`` would not protect it).
        """
        if not self.detachable():
            return None
        sock = self.socket
        self.connected = 0
        self.disconnected = 1
        self.fileno = _no_fileno
        del self.socket
        return sock


class HeldTCPServer(_StartsPaused, tcp.Server):
    """``tcp.Server`` that starts paused."""


class HeldUNIXServer(_StartsPaused, unix.Server):
    """``unix.Server`` that starts paused."""


class _BackoffAccept(_PortBase):
    """Mixin for ``tcp.Port`` subclasses: our own accept loop (see the module docstring)."""

    log = Logger()

    _full_batches = False
    #: (family, type, proto) of accepted sockets, as ints (set when listening starts).
    _sock_args: tuple[int, int, int] = (0, 0, 0)
    _backoff_call: IDelayedCall | None = None
    _backoff_delay: float = 0.0
    #: How many times accept() hit fd exhaustion (for tests and stats).
    exhausted_count: int = 0

    def doRead(self) -> None:
        lsock = self.socket
        raw_accept = lsock._accept  # type: ignore[union-attr]
        # socket.accept() minus its per-call enum conversions (family/type properties): the
        # listener is non-blocking, so it would not touch the new socket's timeout either.
        family, type_, proto = self._sock_args
        factory = self.factory
        assert factory is not None
        fast = getattr(factory, "accept_socket", None)  # capabilities.SocketAcceptingFactory
        # Who may connect at all (a UNIX endpoint's SO_PEERCRED uid), before any relay
        # (capabilities.PeerCheckingFactory).
        peer_ok = getattr(factory, "admit_peer", None)
        limit = self.numberAccepts
        accepted = 0
        while accepted < limit:
            try:
                fd, addr = raw_accept()
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno in _EXHAUSTED:
                    self._pause_accepting(e.errno)
                    return
                if e.errno in _RETRY:
                    continue
                self.log.failure("accept() failed", Failure())
                return
            skt = socket.socket(family, type_, proto, fd)
            accepted += 1
            self._backoff_delay = 0.0
            if peer_ok is not None and not peer_ok(skt):
                _reset(skt)
                continue
            try:
                handled = None
                if fast is not None:
                    # The factory relays the bare socket itself when it can (True), refuses
                    # it (False), or leaves it to buildProtocol (None).
                    handled = fast(
                        skt, lambda protocol, skt=skt, addr=addr: self._adopt(skt, addr, protocol)
                    )
                    if handled is False:
                        _reset(skt)
                if handled is None:
                    protocol = factory.buildProtocol(self._buildAddr(addr))
                    if protocol is None:
                        _reset(skt)
                        continue
                    self._adopt(skt, addr, protocol)
            except Exception:
                self.log.failure("setting up an accepted connection failed", Failure())
                skt.close()
            if self._backoff_call is not None:
                return  # exhausted() was called meanwhile: leave the rest in the backlog
        # Adaptive batch size: ask for no more than we got last time, which saves a failing
        # accept() per wakeup when connections come one at a time; grow after two full batches
        # in a row (Twisted grows after one, so a sequential client costs it an EAGAIN every
        # other connection).
        if accepted == limit:
            if self._full_batches:
                self.numberAccepts = limit + 20
            self._full_batches = True
        else:
            self._full_batches = False
            self.numberAccepts = max(1, accepted)

    def _adopt(self, skt: socket.socket, addr: Any, protocol: IProtocol) -> None:
        """Wrap an accepted socket in this port's transport and connect ``protocol`` to it."""
        s = self.sessionno
        self.sessionno = s + 1
        transport = self.transport(skt, protocol, addr, self, s, self.reactor)
        protocol.makeConnection(transport)

    def startListening(self) -> None:
        super().startListening()
        s = self.socket
        self._sock_args = (int(s.family), int(s.type), s.proto)

    def exhausted(self, err: int) -> None:
        """The process ran out of fds elsewhere (a relay's connect): back off as for accept."""
        if self._backoff_call is None and self.connected and not self.disconnecting:
            self._pause_accepting(err)

    def _pause_accepting(self, err: int) -> None:
        self.exhausted_count += 1
        self.stopReading()
        if self._backoff_delay == 0.0:
            self.log.warn(
                "accept paused: {error}; retrying with backoff",
                error=errno.errorcode.get(err, str(err)),
            )
            delay = BACKOFF_FIRST
        else:
            delay = min(BACKOFF_MAX, self._backoff_delay * 2)
        self._backoff_delay = delay
        clock = cast(IReactorTime, self.reactor)
        self._backoff_call = clock.callLater(delay, self._resume_accepting)

    def _resume_accepting(self) -> None:
        self._backoff_call = None
        if not self.connected or self.disconnecting:
            return
        # A relay needs two fds (accepted + outbound): only accept again once both are
        # available, else every retry would accept one client just to reset it.
        probes: list[int] = []
        try:
            for _ in range(2):
                probes.append(os.dup(self.socket.fileno()))
        except OSError as e:
            if e.errno in _EXHAUSTED:
                self._pause_accepting(e.errno)
                return
        finally:
            for fd in probes:
                os.close(fd)
        self.startReading()

    def _cancel_backoff(self) -> None:
        if self._backoff_call is not None and self._backoff_call.active():
            self._backoff_call.cancel()
        self._backoff_call = None


class BackoffTCPPort(_BackoffAccept, tcp.Port):
    """A ``tcp.Port`` whose accept loop backs off on EMFILE/ENFILE.

    TCP_NODELAY and SO_KEEPALIVE are set on the listening socket: Linux copies both to every
    accepted socket, which saves two setsockopt calls per connection (tested).
    """

    def createInternetSocket(self) -> socket.socket:
        s: socket.socket = tcp.Port.createInternetSocket(self)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        return s

    def connectionLost(self, reason: Failure) -> None:
        self._cancel_backoff()
        tcp.Port.connectionLost(self, reason)


class BackoffUNIXPort(_BackoffAccept, unix.Port):
    """A ``unix.Port`` whose accept loop backs off on EMFILE/ENFILE."""

    def connectionLost(self, reason: Failure) -> None:
        self._cancel_backoff()
        unix.Port.connectionLost(self, reason)


@implementer(IStreamServerEndpoint)
class BackoffTCP4ServerEndpoint:
    """Like ``TCP4ServerEndpoint`` (same arguments), listening with :class:`BackoffTCPPort`."""

    def __init__(
        self,
        reactor: IReactorFDSet,
        port: int,
        backlog: int = 50,
        interface: str = "",
        *,
        start_paused: bool = False,
    ) -> None:
        self._reactor = reactor
        self._port = port
        self._backlog = backlog
        self._interface = interface
        self._start_paused = start_paused

    def listen(self, protocolFactory: IProtocolFactory) -> defer.Deferred[IListeningPort]:
        def go() -> IListeningPort:
            port = BackoffTCPPort(
                self._port, protocolFactory, self._backlog, self._interface, self._reactor
            )
            if self._start_paused:
                port.transport = HeldTCPServer
            port.startListening()
            return port

        return defer.execute(go)


@implementer(IStreamServerEndpoint)
class BackoffUNIXServerEndpoint:
    """Like ``UNIXServerEndpoint`` (no lock file), listening with :class:`BackoffUNIXPort`."""

    def __init__(
        self,
        reactor: IReactorFDSet,
        address: str,
        backlog: int = 50,
        mode: int = 0o600,
        *,
        start_paused: bool = False,
    ) -> None:
        self._reactor = reactor
        self._address = address
        self._backlog = backlog
        self._mode = mode
        self._start_paused = start_paused

    def listen(self, protocolFactory: IProtocolFactory) -> defer.Deferred[IListeningPort]:
        def go() -> IListeningPort:
            port = BackoffUNIXPort(
                os.fsencode(self._address),
                protocolFactory,
                self._backlog,
                self._mode,
                self._reactor,
            )
            if self._start_paused:
                port.transport = HeldUNIXServer
            port.startListening()
            return port

        return defer.execute(go)


__all__ = [
    "BACKOFF_FIRST",
    "BACKOFF_MAX",
    "BackoffTCP4ServerEndpoint",
    "BackoffTCPPort",
    "BackoffUNIXPort",
    "BackoffUNIXServerEndpoint",
    "HeldTCPServer",
    "HeldUNIXServer",
]
