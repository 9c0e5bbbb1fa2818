"""An in-memory ControlBackend and helpers to drive a server protocol on a StringTransport."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

from twisted.internet.address import UNIXAddress
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.protocols import amp

from bottlenet.bottles.model import Bottle
from bottlenet.bottles.spec import BottleSpec
from bottlenet.bottles.tenancy import Tenancy
from bottlenet.bottles.volumes import Requester
from bottlenet.control import codec
from bottlenet.control.context import (
    Admission,
    ControlContext,
    SmolvmFacts,
    TLSAdmission,
    UnixAdmission,
)
from bottlenet.control.framing import BoxParser
from bottlenet.control.peercred import PeerCred
from bottlenet.control.server import (
    DEFAULT_MAX_CONTROL_CONNECTIONS,
    ControlServerFactory,
    ControlServerProtocol,
)
from bottlenet.errors import AlreadyExists, NotFound
from bottlenet.forward.spec import ForwardSpec, TargetSpec, TCPListen
from bottlenet.forward.table import ForwardCounters, ForwardInfo

OWN_UID = 1000


class FakeBackend:
    """Implements ControlBackend in memory with the real value types; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.bottles: dict[str, Bottle] = {}
        self.forwards: dict[str, tuple[ForwardInfo, ...]] = {}
        self.next_alias = 2
        self.next_port = 43000
        self.fail_with: Exception | None = None

    def _check(self) -> None:
        if self.fail_with is not None:
            raise self.fail_with

    async def create_bottle(
        self,
        name: str,
        alias: ipaddress.IPv4Address | None = None,
        *,
        spec: BottleSpec | None = None,
        tenancy: Tenancy | None = None,
        requester: Requester | None = None,
    ) -> Bottle:
        self.calls.append(("create_bottle", (name, alias) if spec is None else (name, alias, spec)))
        self._check()
        if name in self.bottles:
            raise AlreadyExists(f"bottle {name!r} exists")
        if alias is None:
            alias = ipaddress.IPv4Address(f"127.77.0.{self.next_alias}")
            self.next_alias += 1
        b = Bottle(name, str(alias), 1700000000.5, tenancy=tenancy)
        self.bottles[name] = b
        self.forwards[name] = ()
        return b

    async def destroy_bottle(self, name: str) -> None:
        self.calls.append(("destroy_bottle", (name,)))
        self._check()
        self.get_bottle(name)
        del self.bottles[name]
        del self.forwards[name]

    def list_bottles(self) -> list[Bottle]:
        self.calls.append(("list_bottles", ()))
        self._check()
        return [self.bottles[k] for k in sorted(self.bottles)]

    def get_bottle(self, name: str) -> Bottle:
        self._check()
        try:
            return self.bottles[name]
        except KeyError:
            raise NotFound(f"no bottle {name!r}") from None

    async def add_forward(
        self, bottle: str, label: str, target: TargetSpec, port: int = 0
    ) -> ForwardInfo:
        self.calls.append(("add_forward", (bottle, label, target, port)))
        self._check()
        b = self.get_bottle(bottle)
        if any(f.spec.label == label for f in self.forwards[bottle]):
            raise AlreadyExists(f"forward {label!r} exists")
        assert b.alias is not None
        alias = ipaddress.IPv4Address(b.alias)
        real = port or self.next_port
        self.next_port += 1
        spec = ForwardSpec(bottle, label, TCPListen(alias, port), target)
        fwd = ForwardInfo(spec, TCPListen(alias, real), counters(accepted=1, bytes_in=5))
        self.forwards[bottle] = (*self.forwards[bottle], fwd)
        return fwd

    async def remove_forward(self, bottle: str, label: str) -> None:
        self.calls.append(("remove_forward", (bottle, label)))
        self._check()
        self.get_bottle(bottle)
        kept = tuple(f for f in self.forwards[bottle] if f.spec.label != label)
        if len(kept) == len(self.forwards[bottle]):
            raise NotFound(f"no forward {label!r}")
        self.forwards[bottle] = kept

    def bridge_status(self, name: str) -> str | None:
        return None

    def transparent_stats(self, bottle: str | None = None) -> list[Any]:
        return []

    def list_forwards(self, bottle: str | None = None) -> list[ForwardInfo]:
        self.calls.append(("list_forwards", (bottle,)))
        self._check()
        names = [bottle] if bottle is not None else sorted(self.bottles)
        for n in names:
            self.get_bottle(n)
        return [f for n in names for f in self.forwards[n]]

    @property
    def mutations(self) -> list[tuple[str, tuple[Any, ...]]]:
        return [c for c in self.calls if not c[0].startswith("list")]


def counters(**values: int) -> ForwardCounters:
    fields = dict.fromkeys(("accepted", "active", "refused", "failed", "bytes_in", "bytes_out"), 0)
    fields.update(values)
    return ForwardCounters(**fields)


def make_factory(
    backend: FakeBackend | None = None,
    uid: int = OWN_UID,
    *,
    allowed_uids: frozenset[int] = frozenset({OWN_UID}),
    scoped_uids: frozenset[int] = frozenset(),
    max_connections: int = DEFAULT_MAX_CONTROL_CONNECTIONS,
    smolvm_version: str | None = None,
    tls: bool = False,
    **context: Any,
) -> ControlServerFactory:
    """A control factory over ``backend`` whose peers all have ``uid`` (the UNIX door's
    credentials) or, with ``tls``, the TLS door of the same kind of context."""

    def creds(sock: socket.socket) -> PeerCred:
        return PeerCred(uid=uid, pid=4242)

    context.setdefault("server_version", "0.1.0")
    context.setdefault("clock", Clock())
    shared = ControlContext(
        backend=backend or FakeBackend(), smolvm=SmolvmFacts(smolvm_version), **context
    )
    admission: Admission = (
        TLSAdmission.of(shared)
        if tls
        else UnixAdmission(allowed_uids, scoped_uids, peer_credentials=creds)
    )
    return ControlServerFactory(shared, admission, max_connections=max_connections)


class UNIXStringTransport(StringTransport):
    """A StringTransport whose handle is a real (unconnected) AF_UNIX socket."""

    def __init__(self) -> None:
        super().__init__(UNIXAddress(None), UNIXAddress(None))
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.aborted = False

    def getHandle(self) -> socket.socket:
        return self.sock

    def abortConnection(self) -> None:
        self.aborted = True
        super().abortConnection()


class Conn:
    """A server protocol on a StringTransport, with a tiny synchronous client."""

    def __init__(self, factory: ControlServerFactory | None = None) -> None:
        self.factory = factory or make_factory()
        self.transport = UNIXStringTransport()
        self.proto: ControlServerProtocol = self.factory.buildProtocol(None)
        self.proto.makeConnection(self.transport)
        self.parser = BoxParser(max_box_bytes=1 << 24)
        self.tag = 0

    def close(self) -> None:
        self.transport.sock.close()

    def send(self, data: bytes) -> None:
        self.proto.dataReceived(data)

    def boxes(self) -> list[amp.AmpBox]:
        self.parser.feed(self.transport.value())
        self.transport.clear()
        out = []
        while (box := self.parser.next_box()) is not None:
            out.append(box)
        return out

    def call(self, command: type[amp.Command], **kw: Any) -> dict[str, Any]:
        self.tag += 1
        self.send(codec.encode_request(command, b"%x" % self.tag, kw))
        (box,) = self.boxes()
        return codec.decode_answer(command, box)
