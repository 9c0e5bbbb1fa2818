"""The optional capabilities the data plane probes for, declared in one place.

Some engines, ports, factories, transports and reactors offer more than their interface: the
splice engine starts from two bare sockets, the backoff port can pause its accepts, the quiet
reactor can run a call after its epoll batch. Code that uses such a thing probes for it; the
probe names the Protocol below, so what it relies on is written down and type-checked once.

Outside the per-connection path a probe is an ``isinstance`` against the Protocol. On that
path (the accept loop, a relay's start, a relay's end) it stays a ``getattr`` (an
``isinstance`` on a runtime-checkable Protocol costs several attribute lookups), and the
comment beside it names the Protocol.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from bottlenet.forward.relay import Leg


@runtime_checkable
class SocketStartingEngines(Protocol):
    """An engine factory whose engines can start from two bare sockets
    (``splice.SpliceEngines``): a forward then offers its listener the accept fast path."""

    start_sockets_supported: bool


@runtime_checkable
class SocketStartingEngine(Protocol):
    """An engine built by :class:`SocketStartingEngines` (``splice.SpliceRelay``)."""

    def start_sockets(self, a: socket.socket, b: socket.socket) -> None:
        """Relay between the accepted socket ``a`` and the target's ``b``; owns both."""


@runtime_checkable
class ClosableEngines(Protocol):
    """An engine factory holding resources of its own (pooled pipes), closed on stop."""

    def close(self) -> None: ...


@runtime_checkable
class FdBudgetedEngines(Protocol):
    """An engine factory that tells the connection budget what it holds: the most fds one
    relay may hold, and the fds of the engine itself."""

    fds_per_relay: int
    engine_fds: int


@runtime_checkable
class ExhaustiblePort(Protocol):
    """A listening port that can pause its accepts when the process runs out of fds
    (``listen.BackoffTCPPort``): a forward tells it when a relay's connect hit EMFILE."""

    def exhausted(self, err: int) -> None: ...


@runtime_checkable
class SocketAcceptingFactory(Protocol):
    """A listener's factory that can take a freshly accepted bare socket itself (the accept
    fast path of ``listen._BackoffAccept``). None: no fast path for this factory.

    The callable returns True (relayed), False (refused: reset it) or None (not now: go the
    ``buildProtocol`` way); its second argument wraps the socket in the listener's transport.
    """

    accept_socket: Callable[[socket.socket, Callable[[Leg], object]], bool | None] | None


@runtime_checkable
class PeerCheckingFactory(Protocol):
    """A listener's factory that decides, per accepted socket, whether its peer may connect
    at all (a UNIX endpoint's ``SO_PEERCRED`` uid). None: every peer may."""

    admit_peer: Callable[[socket.socket], bool] | None


@runtime_checkable
class DetachableTransport(Protocol):
    """A transport that can hand its socket over (``listen._StartsPaused``: the held server
    transports and the fast client endpoint's): what the splice engine takes over."""

    def detachable(self) -> bool: ...

    def detach_socket(self) -> socket.socket | None: ...


@runtime_checkable
class BatchingReactor(Protocol):
    """The quiet reactor's extensions (``fastreactor``) the splice engine uses when present."""

    def call_after_batch(self, f: Callable[[], object]) -> bool: ...

    def forget_until_closed(self, descriptor: object) -> bool: ...


__all__ = [
    "BatchingReactor",
    "ClosableEngines",
    "DetachableTransport",
    "ExhaustiblePort",
    "FdBudgetedEngines",
    "PeerCheckingFactory",
    "SocketAcceptingFactory",
    "SocketStartingEngine",
    "SocketStartingEngines",
]
