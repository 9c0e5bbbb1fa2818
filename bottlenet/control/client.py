"""The async control client: ``call(c) -> Deferred[T]`` for each call of
:mod:`bottlenet.control.calls`, one typed method per call, a timeout on every call.

Each call takes ``timeout=``; without it, slow calls (:func:`~bottlenet.control.calls.is_slow`:
those that wait on smolvm) get ``vm_timeout`` (300 s), the rest ``timeout`` (10 s). Bottle events
come as a callback (:meth:`ControlClient.watch`) or an async iterator
(:meth:`ControlClient.events`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet.defer import Deferred, DeferredQueue
from twisted.internet.endpoints import (
    HostnameEndpoint,
    UNIXClientEndpoint,
    connectProtocol,
    wrapClientTLS,
)
from twisted.internet.interfaces import IReactorTime, IReactorUNIX, IStreamClientEndpoint

from bottlenet import __version__
from bottlenet.control import calls
from bottlenet.control import commands as C
from bottlenet.control.address import ControlAddress, TLSCredentials, parse_control_address
from bottlenet.control.calls import DEFAULT_TIMEOUT, VM_TIMEOUT, Call
from bottlenet.control.protocol import HardenedAMP, SafeCommandLocator
from bottlenet.control.records import (
    BottleRecord,
    EventRecord,
    ForwardRecord,
    PoolRecord,
    StatsRecord,
)
from bottlenet.control.results import (
    AgentEndpoint,
    DrainResult,
    HelloResult,
    NodeInfoRecord,
    Page,
)
from bottlenet.errors import InvalidArgument

T = TypeVar("T")
CLIENT_VERSION = f"bottlenet-async/{__version__}"

#: Events received but not yet taken from an :class:`EventStream`; beyond it the stream ends.
MAX_QUEUED_EVENTS = 4096


class ClientLocator(SafeCommandLocator):
    """The client's responders: the daemon's ``Event`` calls, handed to every listener."""

    def __init__(self) -> None:
        #: (listener, bottle or None for every bottle)
        self.listeners: list[tuple[Callable[[EventRecord], None], str | None]] = []

    @C.Event.responder
    def event(self, event: EventRecord) -> dict[str, Any]:
        for listener, bottle in list(self.listeners):
            if bottle is not None and bottle != event.bottle:
                continue
            try:
                listener(event)
            except Exception:
                self.log.failure("event listener failed")
        return {}


class EventStream:
    """``async for event in client.events():`` (ends with EventStreamOverflow if the
    consumer falls more than :data:`MAX_QUEUED_EVENTS` behind)."""

    def __init__(self) -> None:
        self._queue: DeferredQueue[EventRecord | None] = DeferredQueue()
        self.overflowed = False

    def put(self, event: EventRecord) -> None:
        if self.overflowed:
            return
        if len(self._queue.pending) >= MAX_QUEUED_EVENTS:
            self.overflowed = True
            self._queue.put(None)
            return
        self._queue.put(event)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> EventRecord:
        event = await self._queue.get()
        if event is None:
            raise EventStreamOverflow(f"more than {MAX_QUEUED_EVENTS} events were not taken")
        return event


class EventStreamOverflow(Exception):
    """The consumer of an EventStream fell too far behind."""


class ControlClient:
    """Wraps a connected AMP protocol; every call fails with TimeoutError after its timeout."""

    def __init__(
        self,
        proto: HardenedAMP,
        clock: IReactorTime,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        vm_timeout: float = VM_TIMEOUT,
        capability: str | None = None,
    ) -> None:
        self.proto = proto
        self.clock = clock
        self.timeout = timeout
        self.vm_timeout = vm_timeout
        #: A scoped peer's capability, given with every call about bottles (``calls``).
        self.capability = capability

    def call(self, c: Call[T], *, timeout: float | None = None) -> Deferred[T]:
        """Run one call: its converted answer, or its typed error (TimeoutError after
        ``timeout``, else the call's own limit: ``vm_timeout`` when it is slow)."""
        c = calls.presenting(c, self.capability)
        d: Deferred[dict[str, Any]] = self.proto.callRemote(C.BY_NAME[c.command], **c.arguments)
        d.addTimeout(
            c.limit(self.timeout, self.vm_timeout) if timeout is None else timeout, self.clock
        )
        return d.addCallback(c.convert)

    # -- events ------------------------------------------------------------------------

    def watch(
        self, listener: Callable[[EventRecord], None], bottle: str | None = None
    ) -> Deferred[int]:
        """Call ``listener(event)`` for every bottle event from now on; fires with the seq."""
        locator = self.proto.locator
        if not isinstance(locator, ClientLocator):
            raise TypeError("this connection was not made by connect_control")
        locator.listeners.append((listener, bottle))
        return self.call(calls.watch(bottle))

    def events(self, bottle: str | None = None) -> Deferred[EventStream]:
        """An async iterator of bottle events (subscribed once this fires)."""
        stream = EventStream()
        return self.watch(stream.put, bottle).addCallback(lambda _: stream)

    # -- every page --------------------------------------------------------------------

    def every_item(self, page: Callable[[int], Call[Page[T]]]) -> Deferred[list[T]]:
        """Every item of a paged listing: ``page(offset)`` is the call of one page."""

        async def every() -> list[T]:
            items: list[T] = []
            offset: int | None = 0
            while offset is not None:
                answer = await self.call(page(offset))
                items.extend(answer.items)
                offset = answer.next_offset
            return items

        return Deferred.fromCoroutine(every())

    def all_bottles(self) -> Deferred[list[BottleRecord]]:
        return self.every_item(lambda o: calls.list_bottles(o))

    def all_forwards(self, bottle: str | None = None) -> Deferred[list[ForwardRecord]]:
        return self.every_item(lambda o: calls.list_forwards(bottle, o))

    def all_stats(self, bottle: str | None = None) -> Deferred[list[StatsRecord]]:
        return self.every_item(lambda o: calls.stats(bottle, o))

    def close(self) -> None:
        self.proto.close()

    # -- one typed method per call (calls.py declares each) -----------------------------

    def hello(self, client_version: str = CLIENT_VERSION) -> Deferred[HelloResult]:
        return self.call(calls.hello(client_version))

    def ping(self, *, timeout: float | None = None) -> Deferred[None]:
        return self.call(calls.ping(), timeout=timeout)

    def create_bottle(
        self,
        name: str,
        alias: str | None = None,
        spec: str | None = None,
        *,
        owner: str | None = None,
        lease_seconds: float | None = None,
        pool: str | None = None,
        timeout: float | None = None,
    ) -> Deferred[BottleRecord]:
        """``spec`` is the bottle spec as JSON text (None: a forward-only bottle); ``owner``
        a label; ``lease_seconds``: the daemon destroys the bottle unless ``renew_lease``
        comes in time (plus its grace); ``pool``: ``auto`` (None), ``off`` or ``only``, whether
        it may take a warm pool's bottle of its spec."""
        call = calls.create_bottle(name, alias, spec, owner, lease_seconds, pool)
        return self.call(call, timeout=timeout)

    def renew_lease(
        self, name: str, seconds: float, *, timeout: float | None = None
    ) -> Deferred[BottleRecord]:
        return self.call(calls.renew_lease(name, seconds), timeout=timeout)

    def verify_bottle(
        self, name: str, *, timeout: float | None = None
    ) -> Deferred[tuple[BottleRecord, str]]:
        return self.call(calls.verify_bottle(name), timeout=timeout)

    def set_egress_policy(
        self, bottle: str, hosts: list[str], *, timeout: float | None = None
    ) -> Deferred[tuple[str, ...]]:
        return self.call(calls.set_egress_policy(bottle, hosts), timeout=timeout)

    def destroy_bottle(self, name: str, *, timeout: float | None = None) -> Deferred[None]:
        return self.call(calls.destroy_bottle(name), timeout=timeout)

    def list_bottles(
        self, offset: int = 0, limit: int | None = None, *, timeout: float | None = None
    ) -> Deferred[Page[BottleRecord]]:
        return self.call(calls.list_bottles(offset, limit), timeout=timeout)

    def bottle_status(self, name: str, *, timeout: float | None = None) -> Deferred[BottleRecord]:
        return self.call(calls.bottle_status(name), timeout=timeout)

    def add_forward(
        self, bottle: str, label: str, target: str, port: int = 0, *, timeout: float | None = None
    ) -> Deferred[AgentEndpoint]:
        return self.call(calls.add_forward(bottle, label, target, port), timeout=timeout)

    def remove_forward(
        self, bottle: str, label: str, *, timeout: float | None = None
    ) -> Deferred[None]:
        return self.call(calls.remove_forward(bottle, label), timeout=timeout)

    def list_forwards(
        self,
        bottle: str | None = None,
        offset: int = 0,
        limit: int | None = None,
        *,
        timeout: float | None = None,
    ) -> Deferred[Page[ForwardRecord]]:
        return self.call(calls.list_forwards(bottle, offset, limit), timeout=timeout)

    def node_info(self, *, timeout: float | None = None) -> Deferred[NodeInfoRecord]:
        """This node for a placer: identity, labels, capacity, health, draining."""
        return self.call(calls.node_info(), timeout=timeout)

    def drain(self, *, wait: bool = False, timeout: float | None = None) -> Deferred[DrainResult]:
        """Refuse new bottles (``DRAINING``); ``wait``: answer once the node holds none, or
        ``timeout`` seconds passed (``empty`` says which)."""
        return self.call(calls.drain(wait, timeout))

    def undrain(self, *, timeout: float | None = None) -> Deferred[None]:
        return self.call(calls.undrain(), timeout=timeout)

    def ensure_pool(
        self, spec: str, size: int, *, timeout: float | None = None
    ) -> Deferred[PoolRecord]:
        """Keep ``size`` bottles of ``spec`` (JSON text) ready for creates of that spec."""
        return self.call(calls.ensure_pool(spec, size), timeout=timeout)

    def list_pools(self, *, timeout: float | None = None) -> Deferred[tuple[PoolRecord, ...]]:
        return self.call(calls.list_pools(), timeout=timeout)

    def remove_pool(self, spec_hash: str, *, timeout: float | None = None) -> Deferred[int]:
        """Forget the pool of ``spec_hash``; how many of its bottles were destroyed."""
        return self.call(calls.remove_pool(spec_hash), timeout=timeout)

    def stats(
        self,
        bottle: str | None = None,
        offset: int = 0,
        limit: int | None = None,
        *,
        timeout: float | None = None,
    ) -> Deferred[Page[StatsRecord]]:
        return self.call(calls.stats(bottle, offset, limit), timeout=timeout)


def connect_control(
    reactor: Any,
    where: str | IStreamClientEndpoint,
    timeout: float = DEFAULT_TIMEOUT,
    *,
    vm_timeout: float = VM_TIMEOUT,
    tls: TLSCredentials | None = None,
    capability: str | None = None,
) -> Deferred[ControlClient]:
    """Connect to a control socket path, ``tls:HOST:PORT`` (with ``tls`` credentials, else
    from the environment) or any client endpoint, and wrap it (``capability``: a scoped
    peer's, given with every call about bottles)."""
    endpoint: IStreamClientEndpoint
    if isinstance(where, str):
        address = parse_control_address(where)
        if address.kind == "tls":
            endpoint = _tls_endpoint(reactor, address, tls, timeout)
        else:
            assert address.path is not None
            unix_reactor: IReactorUNIX = reactor
            endpoint = UNIXClientEndpoint(unix_reactor, address.path, timeout=int(max(1, timeout)))
    else:
        endpoint = where
    proto = HardenedAMP(locator=ClientLocator(), pause_reading=False)
    d: Deferred[HardenedAMP] = connectProtocol(endpoint, proto)
    return d.addCallback(
        lambda p: ControlClient(p, reactor, timeout, vm_timeout=vm_timeout, capability=capability)
    )


def _tls_endpoint(
    reactor: Any, address: ControlAddress, tls: TLSCredentials | None, timeout: float
) -> IStreamClientEndpoint:
    from twisted.internet import ssl

    creds = tls or TLSCredentials.from_env(os.environ)
    if creds is None:
        raise InvalidArgument("a tls: control address needs a client certificate, key and CA")
    assert address.host is not None and address.port is not None
    try:
        with open(creds.cert, "rb") as f:
            cert_pem = f.read()
        with open(creds.key, "rb") as f:
            key_pem = f.read()
        with open(creds.ca, "rb") as f:
            ca_pem = f.read()
        options = ssl.optionsForClientTLS(
            address.host,
            trustRoot=ssl.Certificate.loadPEM(ca_pem),
            clientCertificate=ssl.PrivateCertificate.loadPEM(cert_pem + b"\n" + key_pem),
        )
    except (OSError, ValueError, Exception) as e:
        raise InvalidArgument(f"cannot load the TLS client credentials: {e}") from None
    inner = HostnameEndpoint(reactor, address.host, address.port, timeout=timeout)
    return wrapClientTLS(options, inner)
