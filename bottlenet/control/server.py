"""The control server: who may talk (peer check) and what each command does (responders).

Responders validate every argument with the spec validators *before* calling the backend,
so a bad value never reaches the service layer and never changes state. Mutating commands
are logged with the peer's uid and pid (UNIX) or certificate subject (TLS).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from attrs import frozen
from cryptography.x509.oid import NameOID
from OpenSSL.crypto import X509
from twisted.internet.interfaces import (
    IAddress,
    IHandshakeListener,
    IReactorTime,
    ISSLTransport,
    IUNIXTransport,
)
from twisted.internet.protocol import Factory, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

import twisted
from bottlenet.bottles.attach import parse_exec_request, resize
from bottlenet.bottles.spec import check_allow_hosts, parse_bottle_spec
from bottlenet.bottles.tenancy import Tenancy, creator_of_uid
from bottlenet.bottles.workload import DEFAULT_TAIL, MAX_TAIL
from bottlenet.control import commands as C
from bottlenet.control.admission import HandshakeAdmission, peer_source
from bottlenet.control.backend import ControlBackend, NodeControl
from bottlenet.control.calls import MAX_WAIT
from bottlenet.control.events import EventHub
from bottlenet.control.execbroker import ExecBridge
from bottlenet.control.peercred import PeerCredentials, get_peer_credentials
from bottlenet.control.protocol import (
    CommandObserver,
    HardenedAMP,
    SafeCommandLocator,
    amp_private_names_verified,
)
from bottlenet.control.records import (
    BottleRecord,
    ForwardRecord,
    StatsRecord,
    bottle_record,
    encode_records,
    forward_record,
    stats_record,
)
from bottlenet.control.scope import Creators, ScopedBackend
from bottlenet.errors import (
    Busy,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
    safe_repr,
)
from bottlenet.forward.ratelimit import RateLimitedLogger
from bottlenet.forward.spec import (
    TCPListen,
    check_bottle_name,
    check_label,
    check_port,
    parse_canonical_ipv4,
    parse_target,
    targets_dir,
)
from bottlenet.views import LazyView
from bottlenet.waiters import OneShot

if TYPE_CHECKING:
    from bottlenet.bottles.model import Bottle
    from bottlenet.forward.table import ForwardInfo

T = TypeVar("T")
# A page's JSON value is trimmed to this many bytes (AMP's hard limit is 65,535).
PAGE_BYTE_BUDGET = 60_000
MAX_CLIENT_VERSION = 128
#: An Exec's ``time_limit`` (seconds) is at most a day.
MAX_EXEC_TIME_LIMIT = 86400
# A client version is logged as is only in this shape (name/dotted version, lowercase);
# anything else, however harmless its characters, as a length and a sha256 prefix.
_CLIENT_VERSION_RE = re.compile(r"[a-z][a-z0-9-]{0,31}/[0-9]{1,4}(\.[0-9]{1,4}){0,3}")


def describe_client_version(value: str) -> str:
    """The client's self-description for the log: a known shape, else length + hash."""
    if _CLIENT_VERSION_RE.fullmatch(value):
        return repr(value)
    raw = value.encode("utf-8", "surrogatepass")
    return f"<{len(raw)} bytes sha256:{hashlib.sha256(raw).hexdigest()[:12]}>"


#: At most one "refused peer" line per uid per this many seconds (a peer can retry at will).
REFUSED_PEER_LOG_INTERVAL = 10.0
#: Default cap on concurrent control connections (per listener): 64 x 256 KiB of boxes.
DEFAULT_MAX_CONTROL_CONNECTIONS = 64
#: Highest cap ``--control-max-connections`` accepts (1 GiB of boxes at the worst).
MAX_CONTROL_CONNECTIONS = 4096


@frozen
class PeerIdentity:
    """An authenticated peer, as it appears in logs."""

    kind: Literal["unix", "tls"]
    uid: int | None = None
    pid: int | None = None
    subject: str | None = None
    #: ``--allow-uid UID:scoped``: it sees and acts on the bottles it created only.
    scoped: bool = False

    def describe(self) -> str:
        if self.kind == "unix":
            scoped = " (scoped)" if self.scoped else ""
            return f"uid={self.uid} pid={self.pid if self.pid is not None else '?'}{scoped}"
        return f"tls subject={self.subject}"


#: No spec field needs a longer integer (memory sizes are MiB, ports 5 digits).
MAX_SPEC_INT_DIGITS = 20


def parse_spec_json(text: str) -> dict[str, Any]:
    """The ``spec`` argument: one JSON object (no NaN/Infinity, bounded nesting)."""

    def reject(_: str) -> Any:
        raise InvalidArgument("spec: NaN and Infinity are not allowed")

    def bounded_int(literal: str) -> int:
        # int() of a 5000-digit literal raises ValueError (CPython's 4300-digit limit), and
        # no spec field needs more than a few digits.
        if len(literal.lstrip("-")) > MAX_SPEC_INT_DIGITS:
            raise InvalidArgument(f"spec: integers have at most {MAX_SPEC_INT_DIGITS} digits")
        return int(literal)

    try:
        doc = json.loads(text, parse_constant=reject, parse_int=bounded_int)
    except (json.JSONDecodeError, RecursionError):
        raise InvalidArgument("spec: not valid JSON") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("spec: must be a JSON object")
    return doc


def paginate(
    records: Sequence[T], offset: int | None, limit: int | None, budget: int = PAGE_BYTE_BUDGET
) -> dict[str, Any]:
    """One page of ``records``: at most ``MAX_PAGE`` items and ``budget`` JSON bytes."""
    start = 0 if offset is None else offset
    if start < 0:
        raise InvalidArgument("offset must be >= 0")
    count = C.MAX_PAGE if limit is None else limit
    if count < 1:
        raise InvalidArgument("limit must be >= 1")
    count = min(count, C.MAX_PAGE)
    page: list[T] = []
    size = 2
    for record in records[start : start + count]:
        size += len(encode_records([record])) - 1  # minus brackets, plus a comma
        if size > budget and page:
            break
        page.append(record)
    end = start + len(page)
    return {
        "items": page,
        "total": len(records),
        "next_offset": end if end < len(records) else None,
    }


class ControlLocator(SafeCommandLocator):
    """Responders for one connection; ``peer`` is set once the peer is authenticated."""

    log = Logger()

    def __init__(self, factory: ControlServerFactory) -> None:
        self.factory = factory
        self.backend: ControlBackend = factory.backend
        self.peer: PeerIdentity | None = None
        self.on_command = factory.on_command
        self.connection: ControlServerProtocol | None = None

    async def _mutate(self, command: str, subject: str, action: Awaitable[T]) -> T:
        peer = self.peer
        fields = {
            "command": command,
            "subject": subject,
            "peer": peer.describe() if peer else "?",
            "uid": peer.uid if peer else None,
            "pid": peer.pid if peer else None,
        }
        self.log.info("control: {command} {subject} requested by {peer}", **fields)
        try:
            result = await action
        except Exception as e:
            code = getattr(e, "code", "INTERNAL")
            self.log.info("control: {command} {subject} failed: {code}", code=code, **fields)
            raise
        self.log.info("control: {command} {subject} done", **fields)
        return result

    @C.Hello.responder
    async def hello(self, client_version: str, protocols: list[int]) -> dict[str, Any]:
        common = set(protocols) & set(C.SUPPORTED_PROTOCOLS)
        self.log.info(
            "control: hello from {peer} client={client} protocols={protocols}",
            peer=self.peer.describe() if self.peer else "?",
            client=describe_client_version(client_version),
            protocols=sorted(common),
        )
        if not common:
            raise C.UnsupportedProtocol(
                f"no common protocol version: daemon speaks {list(C.SUPPORTED_PROTOCOLS)}"
            )
        f = self.factory
        if not f.smolvm_settled.fired:  # the daemon's one smolvm probe is still running
            await f.smolvm_settled.when_fired()
        vm_uids, basis = f.vm_uids_now() if f.vm_uids_now is not None else (f.vm_uids, None)
        return {
            "server_version": f.server_version,
            "protocol": max(common),
            "features": list(C.FEATURES),
            "smolvm_available": f.smolvm_available,
            "smolvm_version": f.smolvm_version,
            "smolvm_source": f.smolvm_source,
            "vm_uids": vm_uids,
            "vm_uids_basis": basis,
        }

    @C.Ping.responder
    def ping(self) -> dict[str, Any]:
        return {}

    def _full_control(self, command: str) -> None:
        if isinstance(self.backend, ScopedBackend):
            raise PermissionDenied(f"{command}: a scoped peer may not ask for it")

    def _node(self) -> NodeControl:
        node = self.factory.node
        if node is None:
            raise Unavailable("this daemon has no node contract")
        return node

    @C.NodeInfo.responder
    def node_info(self) -> dict[str, Any]:
        r = self._node().report()
        c = r.capacity
        return {
            "server_version": self.factory.server_version,
            "protocol": C.PROTOCOL_VERSION,
            "host": r.host,
            "labels": [f"{k}={v}" for k, v in r.labels],
            "privilege": r.privilege,
            "smolvm": r.smolvm,
            "vm_possible": r.vm_possible,
            "vm_why_not": r.vm_why_not,
            "kvm": r.kvm,
            "max_bottles": c.max_bottles,
            "bottles": c.bottles,
            "vm_bottles": c.vm_bottles,
            "connections_used": c.connections_used,
            "connections_total": c.connections_total,
            "health": r.health,
            "health_reasons": list(r.reasons),
            "draining": r.draining,
        }

    @C.Drain.responder
    async def drain(self, wait: bool | None, timeout: float | None) -> dict[str, Any]:
        if timeout is not None and not 0 < timeout <= MAX_WAIT:
            raise InvalidArgument(f"timeout: more than 0 and at most {MAX_WAIT:g} seconds")
        self._full_control("Drain")
        node = self._node()

        async def drain() -> None:
            node.drain()

        await self._mutate("Drain", "node", drain())
        # A wait without a timeout is bounded too (a week), as every Deferred held for a peer.
        empty = await node.when_empty(timeout or MAX_WAIT) if wait else node.held() == 0
        return {"draining": node.draining, "held": node.held(), "empty": empty}

    @C.Undrain.responder
    async def undrain(self) -> dict[str, Any]:
        self._full_control("Undrain")
        node = self._node()

        async def undrain() -> None:
            node.undrain()

        await self._mutate("Undrain", "node", undrain())
        return {"draining": node.draining}

    def _record(self, bottle: Bottle) -> BottleRecord:
        return bottle_record(
            bottle,
            len(self.backend.list_forwards(bottle.name)),
            bridge=self.backend.bridge_status(bottle.name),
        )

    @C.CreateBottle.responder
    async def create_bottle(
        self,
        name: str,
        alias: str | None,
        spec: str | None,
        owner: str | None = None,
        lease_seconds: float | None = None,
    ) -> dict[str, Any]:
        name = check_bottle_name(name)
        addr = None if alias is None else parse_canonical_ipv4(alias, "alias")
        # INVALID_ARGUMENT before anything changes; the bottles layer gets the parsed spec.
        parsed = None if spec is None else parse_bottle_spec(name, parse_spec_json(spec))
        tenancy = Tenancy.requested(owner, lease_seconds, None)
        create = (
            self.backend.create_bottle(name, addr, spec=parsed)
            if tenancy is None
            else self.backend.create_bottle(name, addr, spec=parsed, tenancy=tenancy)
        )
        bottle = await self._mutate("CreateBottle", name, create)
        return {"bottle": self._record(bottle)}

    @C.RenewLease.responder
    def renew_lease(self, name: str, seconds: float) -> dict[str, Any]:
        name = check_bottle_name(name)
        self.backend.get_bottle(name)  # NOT_FOUND for a scoped peer's other bottles
        self._node().renew_lease(name, seconds)
        return {"bottle": self._record(self.backend.get_bottle(name))}

    @C.VerifyBottle.responder
    async def verify_bottle(self, name: str) -> dict[str, Any]:
        name = check_bottle_name(name)
        bottle, verdict = await self._mutate("VerifyBottle", name, self.backend.verify_bottle(name))
        return {"bottle": self._record(bottle), "result": verdict.result.value}

    @C.SetEgressPolicy.responder
    async def set_egress_policy(self, bottle: str, allow_hosts: list[str]) -> dict[str, Any]:
        bottle = check_bottle_name(bottle)
        hosts = check_allow_hosts(allow_hosts)
        result = await self._mutate(
            "SetEgressPolicy", bottle, self.backend.set_egress_policy(bottle, hosts)
        )
        return {"allow_hosts": list(result)}

    @C.DestroyBottle.responder
    async def destroy_bottle(self, name: str) -> dict[str, Any]:
        name = check_bottle_name(name)
        await self._mutate("DestroyBottle", name, self.backend.destroy_bottle(name))
        # Its commands end with it (while it was being destroyed, a new Exec was BUSY).
        self.factory.end_exec_sessions_of(name)
        return {}

    @C.Exec.responder
    async def exec_command(
        self,
        bottle: str,
        argv: list[str],
        env: list[str] | None,
        user: str | None,
        workdir: str | None,
        stdin: bool | None,
        tty: bool | None,
        rows: int | None,
        cols: int | None,
        fds: bool | None = None,
        time_limit: int | None = None,
    ) -> dict[str, Any]:
        check_bottle_name(bottle)
        if time_limit is not None and not 1 <= time_limit <= MAX_EXEC_TIME_LIMIT:
            raise InvalidArgument(f"time_limit: 1-{MAX_EXEC_TIME_LIMIT} seconds")
        request = parse_exec_request(
            argv,
            env=env or (),
            user=user,
            workdir=workdir,
            stdin=bool(stdin),
            tty=bool(tty),
            rows=rows,
            cols=cols,
        )
        # File descriptors only where they can travel (a UNIX socket) and fit (no terminal:
        # the pty stays the daemon's, as resizes need it); anyone else gets frames.
        transport = self.connection.transport if self.connection is not None else None
        with_fds = bool(fds) and not request.tty and IUNIXTransport.providedBy(transport)

        def spawn(bridge: ExecBridge) -> Awaitable[object]:
            if not with_fds:
                return self.backend.spawn_exec(bottle, request, bridge)
            return self.backend.spawn_exec(bottle, request, bridge, stdio=bridge.make_stdio())

        await self._attach(
            bottle,
            spawn,
            tty=request.tty,
            stdin=request.stdin,
            what="exec",
            fds=with_fds,
            time_limit=time_limit,
        )
        return {"tty": request.tty, "fds": with_fds}

    async def _attach(
        self,
        bottle: str,
        spawn: Callable[[ExecBridge], Awaitable[object]],
        *,
        tty: bool,
        stdin: bool,
        what: str,
        fds: bool = False,
        time_limit: int | None = None,
    ) -> None:
        """Start a command with a bridge; the connection switches once the answer is out."""
        connection = self.connection
        if connection is None or connection.in_flight != 1:
            raise Busy(f"{what} needs a connection of its own (no other command in flight)")
        f = self.factory
        if f.stopping:
            raise Unavailable("the daemon is stopping")
        peer = self.peer.describe() if self.peer else "?"
        bridge = ExecBridge(
            bottle=bottle,
            peer=peer,
            tty=tty,
            stdin=stdin,
            clock=f.clock,
            resize=resize,
            on_end=f.exec_sessions.discard,
            fds=fds,
        )
        self.log.info(
            "control: {what} in bottle {bottle} requested by {peer} "
            "(tty={tty}, stdin={stdin}, fds={fds})",
            what=what,
            bottle=bottle,
            peer=peer,
            tty=tty,
            stdin=stdin,
            fds=fds,
            uid=self.peer.uid if self.peer else None,
            pid=self.peer.pid if self.peer else None,
        )
        try:
            await spawn(bridge)
        except BaseException:
            bridge.close_fds()
            raise
        bridge.spawned()
        if time_limit is not None:
            bridge.set_deadline(time_limit)
        f.exec_sessions.add(bridge)
        if not self._bottle_exists(bottle):  # destroyed while smolvm was starting the command
            f.end_exec_sessions_of(bottle)
        if connection.transport is None:  # the client left while smolvm was starting
            bridge.client_lost()
        else:
            connection.switch_after_answer(bridge)

    def _bottle_exists(self, name: str) -> bool:
        try:
            self.backend.get_bottle(name)
        except NotFound:
            return False
        return True

    @C.Logs.responder
    async def logs(self, bottle: str, tail: int | None, follow: bool | None) -> dict[str, Any]:
        check_bottle_name(bottle)
        lines = DEFAULT_TAIL if tail is None else tail
        if not 0 <= lines <= MAX_TAIL:
            raise InvalidArgument(f"tail must be 0-{MAX_TAIL}")
        await self._attach(
            bottle,
            lambda bridge: self.backend.spawn_logs(bottle, lines, bool(follow), bridge),
            tty=False,
            stdin=False,
            what="logs",
        )
        return {}

    @C.Watch.responder
    def watch(self, bottle: str | None) -> dict[str, Any]:
        if bottle is not None:
            check_bottle_name(bottle)
        hub = self.factory.event_hub
        if hub is None or self.connection is None:
            raise Unavailable("this daemon publishes no events")
        scope = self.backend if isinstance(self.backend, ScopedBackend) else None
        seq = hub.watch(self.connection, bottle, None if scope is None else scope.sees)
        self.log.info(
            "control: {peer} watches events (from seq {seq})",
            peer=self.peer.describe() if self.peer else "?",
            seq=seq,
        )
        return {"seq": seq}

    @C.Leftovers.responder
    async def leftovers(self, name: str) -> dict[str, Any]:
        name = check_bottle_name(name)
        return {"leftovers": await self.backend.leftovers(name)}

    @C.ListBottles.responder
    def list_bottles(self, offset: int | None, limit: int | None) -> dict[str, Any]:
        backend = self.backend
        # Each record is built only when its page is (the forward count of one bottle is the
        # length of its lazy forward view): a page costs the page, not every bottle.
        records: LazyView[BottleRecord] = LazyView(
            backend.list_bottles(),
            lambda b: bottle_record(b, len(backend.list_forwards(b.name)), with_env=False),
        )
        page = paginate(records, offset, limit)
        return {
            "bottles": page["items"],
            "total": page["total"],
            "next_offset": page["next_offset"],
        }

    @C.BottleStatus.responder
    def bottle_status(self, name: str) -> dict[str, Any]:
        name = check_bottle_name(name)
        return {"bottle": self._record(self.backend.get_bottle(name))}

    @C.AddForward.responder
    async def add_forward(
        self, bottle: str, label: str, target: str, port: int | None
    ) -> dict[str, Any]:
        bottle = check_bottle_name(bottle)
        label = check_label(label)
        root = self.factory.unix_target_root
        target_spec = parse_target(
            target, unix_root=None if root is None else targets_dir(root, bottle)
        )
        port = check_port(0 if port is None else port, allow_zero=True)
        info = await self._mutate(
            "AddForward",
            f"{bottle}/{label}",
            self.backend.add_forward(bottle, label, target_spec, port=port),
        )
        bound = info.bound
        result: dict[str, Any] = {"forward": forward_record(info)}
        if isinstance(bound, TCPListen):
            result["host"] = str(bound.alias)
            result["port"] = bound.port
        else:
            result["path"] = bound.path
        return result

    @C.RemoveForward.responder
    async def remove_forward(self, bottle: str, label: str) -> dict[str, Any]:
        bottle = check_bottle_name(bottle)
        label = check_label(label)
        await self._mutate(
            "RemoveForward", f"{bottle}/{label}", self.backend.remove_forward(bottle, label)
        )
        return {}

    def _forwards(self, bottle: str | None) -> Sequence[ForwardInfo]:
        if bottle is not None:
            check_bottle_name(bottle)
            self.backend.get_bottle(bottle)  # NOT_FOUND for an unknown bottle
        return self.backend.list_forwards(bottle)

    @C.ListForwards.responder
    def list_forwards(
        self, bottle: str | None, offset: int | None, limit: int | None
    ) -> dict[str, Any]:
        records: LazyView[ForwardRecord] = LazyView(self._forwards(bottle), forward_record)
        page = paginate(records, offset, limit)
        return {
            "forwards": page["items"],
            "total": page["total"],
            "next_offset": page["next_offset"],
        }

    @C.Stats.responder
    def stats(self, bottle: str | None, offset: int | None, limit: int | None) -> dict[str, Any]:
        records: LazyView[StatsRecord] = LazyView(self._forwards(bottle), stats_record)
        page = paginate(records, offset, limit)
        return {"stats": page["items"], "total": page["total"], "next_offset": page["next_offset"]}


@implementer(IHandshakeListener)
class ControlServerProtocol(HardenedAMP):
    """One control connection: authenticate the peer before parsing a single byte."""

    log = Logger()

    def __init__(self, factory: ControlServerFactory) -> None:
        self.control = ControlLocator(factory)
        super().__init__(locator=self.control, pause_reading=factory.transport_kind != "tls")
        self.control.connection = self
        self.factory = factory
        # A TLS connection takes its slot once its certificate is verified (handshakeCompleted).
        self._holds_slot = factory.transport_kind != "tls"

    def release_slot(self) -> None:
        """Give the connection's slot back (once) to the factory's connection cap."""
        if self._holds_slot:
            self._holds_slot = False
            self.factory.open_connections -= 1

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.release_slot()
        if self.factory.admission is not None:
            self.factory.admission.settled(self)
        if self.factory.event_hub is not None:
            self.factory.event_hub.forget(self)
        super().connectionLost(reason)

    @property
    def peer(self) -> PeerIdentity | None:
        return self.control.peer

    def log_fields(self) -> dict[str, object]:
        peer = self.peer
        if peer is None:
            return {"peer": "unauthenticated"}
        return {"peer": peer.describe(), "uid": peer.uid, "pid": peer.pid}

    def connectionMade(self) -> None:
        if self.factory.transport_kind == "tls":
            # Authenticated in handshakeCompleted, before any application data flows; until
            # then the admission's deadline and caps bound what this connection may hold.
            if self.factory.admission is not None:
                self.factory.admission.admit(
                    self, peer_source(self.transport), self._abort_unauthenticated
                )
            self.ctransport.registerProducer(self, True)
            return
        handle = self.ctransport.getHandle()
        if not isinstance(handle, socket.socket) or handle.family != socket.AF_UNIX:
            self.drop("not a UNIX socket: refusing a peer without credentials")
            return
        try:
            cred = self.factory.peer_credentials(handle)
        except OSError:
            self.drop("could not read peer credentials")
            return
        scoped = cred.uid in self.factory.scoped_uids
        if cred.uid not in self.factory.allowed_uids and not scoped:
            self.release_slot()  # a refused peer never holds one of the capped slots
            self.factory.refused_log.warn(
                ("refused-peer", cred.uid),
                "control: refused peer uid={uid} pid={pid}",
                uid=cred.uid,
                pid=cred.pid,
            )
            self.abort()
            return
        self.ctransport.registerProducer(self, True)
        self.authenticated_as(PeerIdentity("unix", uid=cred.uid, pid=cred.pid, scoped=scoped))

    def authenticated_as(self, peer: PeerIdentity) -> None:
        """The peer is who it may be: its boxes are parsed from now on (a scoped peer's
        through a view of its own bottles)."""
        self.control.peer = peer
        if peer.scoped and peer.uid is not None:
            self.control.backend = ScopedBackend(
                self.factory.backend, creator_of_uid(peer.uid), self.factory.creators
            )
        self.peer_authenticated()

    def first_bytes_received(self) -> None:
        """Told by the TLS layer: this peer is not silent (see the handshake admission)."""
        if self.factory.admission is not None:
            self.factory.admission.spoke(self)

    def _abort_unauthenticated(self) -> None:
        """Ended by the handshake admission (deadline or cap); it logged why, rate-limited."""
        self.abort()

    def handshakeCompleted(self) -> None:
        if self.factory.admission is not None:
            self.factory.admission.settled(self)
        cert = cast(X509 | None, ISSLTransport(self.transport).getPeerCertificate())
        if cert is None:
            self.drop("TLS peer presented no certificate")
            return
        if not self.factory.take_slot():
            self._abort_unauthenticated()
            return
        self._holds_slot = True
        names = cert.to_cryptography().subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        subject = str(names[0].value) if names else ""
        peer = PeerIdentity("tls", subject=safe_repr(subject))
        self.authenticated_as(peer)
        self.log.info("control: TLS peer {peer} authenticated", peer=peer.describe())


class ControlServerFactory(Factory):
    """Builds control connections.

    ``allowed_uids`` is the whole allow-list (see ``peercred.default_allowed_uids``).
    ``transport_kind="tls"`` is for the optional TLS listener, where the client certificate
    (verified by the TLS layer) stands in for peer credentials.
    ``clock`` (the reactor; a ``Clock`` in tests) rate-limits the refused-peer log per uid,
    flushes the suppressed counts, times the TLS handshake deadline and exec time limits.
    ``on_command(command, result)`` hears every handled command (the daemon's metrics).
    """

    log = Logger()
    noisy = False

    def __init__(
        self,
        backend: ControlBackend,
        *,
        server_version: str,
        smolvm_version: str | None,
        allowed_uids: frozenset[int],
        smolvm_available: bool | None = None,
        peer_credentials: PeerCredentials = get_peer_credentials,
        unix_target_root: str | None = None,
        clock: IReactorTime,
        transport_kind: Literal["unix", "tls"] = "unix",
        refused_log: RateLimitedLogger | None = None,
        on_command: CommandObserver | None = None,
        event_hub: EventHub | None = None,
        exec_sessions: set[ExecBridge] | None = None,
        max_connections: int = DEFAULT_MAX_CONTROL_CONNECTIONS,
        node: NodeControl | None = None,
        scoped_uids: frozenset[int] = frozenset(),
        creators: Creators | None = None,
    ) -> None:
        self.backend = backend
        #: ``--allow-uid UID:scoped`` uids: each sees and acts on its own bottles only.
        self.scoped_uids = scoped_uids
        #: Who created which bottle, for scoped peers' events (shared with the TLS factory).
        self.creators = creators or Creators(lambda subscriber: lambda: None)
        #: The node contract (NodeInfo, Drain, Undrain); None: those answer UNAVAILABLE.
        self.node = node
        self.event_hub = event_hub
        #: Live exec sessions (shared with the TLS factory); ended when the daemon stops.
        self.exec_sessions: set[ExecBridge] = set() if exec_sessions is None else exec_sessions
        self.stopping = False
        #: Concurrent connections at most (their boxes are capped at 256 KiB each).
        self.max_connections = max_connections
        self.open_connections = 0
        #: Connections refused by the cap (metrics).
        self.refused = 0
        self.on_command = on_command
        self.server_version = server_version
        self.smolvm_version = smolvm_version
        #: Where the daemon's smolvm came from (``Smolvm.describe()``), once it is known.
        self.smolvm_source: str | None = None
        #: smolvm's privilege model (``vmctl.smolvm.VmUids``), once a smolvm is known.
        self.vm_uids: str | None = None
        #: Set by the daemon: the model and its basis now (seen at a VM start, or expected).
        self.vm_uids_now: Callable[[], tuple[str | None, str | None]] | None = None
        self.smolvm_available = (
            smolvm_version is not None if smolvm_available is None else smolvm_available
        )
        #: Settled once the daemon's smolvm probe has (``tap.BottlenetService``): Hello waits
        #: for it, so its smolvm fields are right from the first call (under socket
        #: activation that call comes as soon as the reactor runs). Settled where none runs.
        self.smolvm_settled: OneShot[None] = OneShot()
        self.smolvm_settled.fire(None)
        self.allowed_uids = allowed_uids
        self.peer_credentials = peer_credentials
        self.unix_target_root = unix_target_root
        self.transport_kind: Literal["unix", "tls"] = transport_kind
        self.clock = clock
        self.refused_log = refused_log or RateLimitedLogger(
            self.log,
            clock,
            interval=REFUSED_PEER_LOG_INTERVAL,
            max_keys=1024,
            # A one-shot timer only while refusals were dropped: no periodic wakeup.
            auto_flush=True,
        )
        #: TLS only: the handshake deadline and the caps on unauthenticated connections.
        self.admission: HandshakeAdmission | None = None
        if transport_kind == "tls":
            self.admission = HandshakeAdmission(self.clock, self.refused_log)

    def end_exec_sessions(self) -> None:
        """The daemon stops: end every command still running for a client."""
        self.stopping = True
        for bridge in list(self.exec_sessions):
            bridge.terminate()

    def end_exec_sessions_of(self, bottle: str) -> None:
        """The bottle was destroyed: end the commands still running in it for a client."""
        for bridge in [b for b in self.exec_sessions if b.bottle == bottle]:
            self.log.info(
                "control: ending an exec session in destroyed bottle {bottle} ({peer})",
                bottle=bottle,
                peer=bridge.peer,
            )
            bridge.terminate()

    def startFactory(self) -> None:
        if not amp_private_names_verified():
            # HardenedAMP overrides and reads private AMP names (protocol.AMP_PRIVATE_NAMES).
            self.log.warn(
                "control: Twisted {version} is not one HardenedAMP was checked against"
                " (AMP_VERIFIED_TWISTED): its private AMP names may have changed",
                version=twisted.__version__,
            )

    def stopFactory(self) -> None:
        self.end_exec_sessions()
        self.refused_log.flush()

    def for_tls(self) -> ControlServerFactory:
        """The same service for the TLS listener (client certificates instead of uids)."""
        tls = ControlServerFactory(
            self.backend,
            server_version=self.server_version,
            smolvm_version=self.smolvm_version,
            smolvm_available=self.smolvm_available,
            allowed_uids=self.allowed_uids,
            peer_credentials=self.peer_credentials,
            unix_target_root=self.unix_target_root,
            transport_kind="tls",
            clock=self.clock,
            refused_log=self.refused_log,
            on_command=self.on_command,
            event_hub=self.event_hub,
            exec_sessions=self.exec_sessions,
            max_connections=self.max_connections,
            node=self.node,
            scoped_uids=self.scoped_uids,
            creators=self.creators,
        )
        tls.smolvm_source = self.smolvm_source
        tls.vm_uids = self.vm_uids
        tls.vm_uids_now = self.vm_uids_now
        tls.smolvm_settled = self.smolvm_settled
        return tls

    def take_slot(self) -> bool:
        """One of the capped slots for a peer, or False (logged, rate-limited) at the cap."""
        if self.open_connections >= self.max_connections:
            # Each connection may buffer up to a 256 KiB box: the cap bounds that memory (and
            # the fds) whoever connects.
            self.refused += 1
            self.refused_log.warn(
                ("control-cap", self.transport_kind),
                "control: refused a connection: {max_connections} connections are open",
                max_connections=self.max_connections,
            )
            return False
        self.open_connections += 1
        return True

    def buildProtocol(self, addr: IAddress | None) -> ControlServerProtocol | None:
        if self.transport_kind == "tls":
            return ControlServerProtocol(self)  # slot at handshakeCompleted, see admission
        if not self.take_slot():
            return None  # Twisted closes the socket
        return ControlServerProtocol(self)
