"""The async control client: one typed method per command, a timeout on every call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.interfaces import IReactorTime, IReactorUNIX, IStreamClientEndpoint
from twisted.protocols import amp

from bottlenet import __version__
from bottlenet.control import commands as C
from bottlenet.control.protocol import HardenedAMP
from bottlenet.control.records import BottleRecord, ForwardRecord, StatsRecord
from bottlenet.control.results import AgentEndpoint, HelloResult, Page

T = TypeVar("T")
CLIENT_VERSION = f"bottlenet-async/{__version__}"


class ControlClient:
    """Wraps a connected AMP protocol; every call fails with TimeoutError after ``timeout``."""

    def __init__(self, proto: HardenedAMP, clock: IReactorTime, timeout: float = 10.0) -> None:
        self.proto = proto
        self.clock = clock
        self.timeout = timeout

    def _call(
        self, command: type[amp.Command], convert: Callable[[dict[str, Any]], T], **kw: Any
    ) -> Deferred[T]:
        d: Deferred[dict[str, Any]] = self.proto.callRemote(command, **kw)
        d.addTimeout(self.timeout, self.clock)
        return d.addCallback(convert)

    def close(self) -> None:
        self.proto.close()

    def hello(self, client_version: str = CLIENT_VERSION) -> Deferred[HelloResult]:
        return self._call(
            C.Hello,
            HelloResult.from_answer,
            client_version=client_version,
            protocols=list(C.SUPPORTED_PROTOCOLS),
        )

    def ping(self) -> Deferred[None]:
        return self._call(C.Ping, lambda _: None)

    def create_bottle(
        self, name: str, alias: str | None = None, spec: str | None = None
    ) -> Deferred[BottleRecord]:
        """``spec`` is the bottle spec as JSON text (None: a forward-only bottle)."""
        return self._call(C.CreateBottle, lambda a: a["bottle"], name=name, alias=alias, spec=spec)

    def verify_bottle(self, name: str) -> Deferred[tuple[BottleRecord, str]]:
        return self._call(C.VerifyBottle, lambda a: (a["bottle"], a["result"]), name=name)

    def set_egress_policy(self, bottle: str, hosts: list[str]) -> Deferred[tuple[str, ...]]:
        return self._call(
            C.SetEgressPolicy,
            lambda a: tuple(a["allow_hosts"]),
            bottle=bottle,
            allow_hosts=list(hosts),
        )

    def destroy_bottle(self, name: str) -> Deferred[None]:
        return self._call(C.DestroyBottle, lambda _: None, name=name)

    def list_bottles(
        self, offset: int = 0, limit: int | None = None
    ) -> Deferred[Page[BottleRecord]]:
        return self._call(
            C.ListBottles,
            lambda a: Page.from_answer(a, "bottles"),
            offset=offset,
            limit=limit,
        )

    def bottle_status(self, name: str) -> Deferred[BottleRecord]:
        return self._call(C.BottleStatus, lambda a: a["bottle"], name=name)

    def add_forward(
        self, bottle: str, label: str, target: str, port: int = 0
    ) -> Deferred[AgentEndpoint]:
        return self._call(
            C.AddForward,
            AgentEndpoint.from_answer,
            bottle=bottle,
            label=label,
            target=target,
            port=port,
        )

    def remove_forward(self, bottle: str, label: str) -> Deferred[None]:
        return self._call(C.RemoveForward, lambda _: None, bottle=bottle, label=label)

    def list_forwards(
        self, bottle: str | None = None, offset: int = 0, limit: int | None = None
    ) -> Deferred[Page[ForwardRecord]]:
        return self._call(
            C.ListForwards,
            lambda a: Page.from_answer(a, "forwards"),
            bottle=bottle,
            offset=offset,
            limit=limit,
        )

    def stats(
        self, bottle: str | None = None, offset: int = 0, limit: int | None = None
    ) -> Deferred[Page[StatsRecord]]:
        return self._call(
            C.Stats,
            lambda a: Page.from_answer(a, "stats"),
            bottle=bottle,
            offset=offset,
            limit=limit,
        )


def connect_control(
    reactor: Any,
    where: str | IStreamClientEndpoint,
    timeout: float = 10.0,
) -> Deferred[ControlClient]:
    """Connect to a control socket path (or any client endpoint) and wrap it."""
    endpoint: IStreamClientEndpoint
    if isinstance(where, str):
        unix_reactor: IReactorUNIX = reactor
        endpoint = UNIXClientEndpoint(unix_reactor, where, timeout=int(max(1, timeout)))
    else:
        endpoint = where
    d: Deferred[HardenedAMP] = connectProtocol(endpoint, HardenedAMP(pause_reading=False))
    return d.addCallback(lambda proto: ControlClient(proto, reactor, timeout))
