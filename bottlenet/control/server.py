"""The control server: one connection's life and what each command does (responders).

Who may talk is each listener's admission (``control/context.py``: the UNIX socket's peer
uid, the TLS port's client certificate); both listeners serve one shared context.

Responders validate every argument with the spec validators *before* calling the backend,
so a bad value never reaches the service layer and never changes state. Mutating commands
are logged with the peer's uid and pid (UNIX) or certificate subject (TLS).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from attrs import evolve
from twisted.internet.interfaces import (
    IAddress,
    IHandshakeListener,
    IUNIXTransport,
)
from twisted.internet.protocol import Factory, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

import twisted
from bottlenet.bottles.attach import parse_exec_request, resize
from bottlenet.bottles.egresslayer import TransparentCount
from bottlenet.bottles.pooled import PoolUse
from bottlenet.bottles.spec import check_allow_hosts, parse_bottle_spec
from bottlenet.bottles.tenancy import Tenancy
from bottlenet.bottles.volumes import Requester, RequesterKind
from bottlenet.bottles.workload import DEFAULT_TAIL, MAX_TAIL
from bottlenet.control import commands as C
from bottlenet.control.backend import ControlBackend, NodeControl
from bottlenet.control.calls import MAX_WAIT
from bottlenet.control.context import Admission, ControlContext, PeerIdentity
from bottlenet.control.execbroker import ExecBridge
from bottlenet.control.identity import Identity, check_capability, mint_capability
from bottlenet.control.protocol import (
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
    pool_record,
    stats_record,
    transparent_record,
)
from bottlenet.control.scope import ScopedBackend
from bottlenet.errors import (
    Busy,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
    safe_repr,
)
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

if TYPE_CHECKING:
    from bottlenet.bottles.model import Bottle
    from bottlenet.forward.table import ForwardInfo
    from bottlenet.node.info import Capacity

T = TypeVar("T")
# A page's JSON value is trimmed to this many bytes (AMP's hard limit is 65,535).
PAGE_BYTE_BUDGET = 60_000
#: An Exec's ``time_limit`` (seconds) is at most a day.
MAX_EXEC_TIME_LIMIT = 86400
# A client version is logged as is only in this shape (name/dotted version, lowercase);
# anything else, however harmless its characters, as a length and a sha256 prefix.
_CLIENT_VERSION_RE = re.compile(r"[a-z][a-z0-9-]{0,31}/[0-9]{1,4}(\.[0-9]{1,4}){0,3}")


def _same(name: str) -> str:
    return name


def own_capacity(node: Capacity, scope: ScopedBackend) -> Capacity:
    """The node's capacity as a scoped peer is told it: its own bottles and their relay
    connections in place of everyone's (the node's limits as they are)."""
    bottles = scope.list_bottles()
    active = sum(f.counters.active for f in scope.list_forwards(None))
    return evolve(
        node,
        bottles=len(bottles),
        vm_bottles=sum(1 for b in bottles if b.has_vms),
        connections_used=active,
    )


def describe_client_version(value: str) -> str:
    """The client's self-description for the log: a known shape, else length + hash."""
    if _CLIENT_VERSION_RE.fullmatch(value):
        return repr(value)
    raw = value.encode("utf-8", "surrogatepass")
    return f"<{len(raw)} bytes sha256:{hashlib.sha256(raw).hexdigest()[:12]}>"


#: Default cap on concurrent control connections (per listener): 64 x 256 KiB of boxes.
DEFAULT_MAX_CONTROL_CONNECTIONS = 64
#: Highest cap ``--control-max-connections`` accepts (1 GiB of boxes at the worst).
MAX_CONTROL_CONNECTIONS = 4096


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
    records: Sequence[T],
    offset: int | None,
    limit: int | None,
    key: str,
    budget: int = PAGE_BYTE_BUDGET,
) -> dict[str, Any]:
    """A listing's answer: one page of ``records`` under ``key`` (at most ``MAX_PAGE`` items
    and ``budget`` JSON bytes), the ``total`` and the ``next_offset``."""
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
        key: page,
        "total": len(records),
        "next_offset": end if end < len(records) else None,
    }


def parse_pool_use(text: str) -> PoolUse:
    """``CreateBottle``'s ``pool``: auto, off or only."""
    try:
        return PoolUse(text)
    except ValueError:
        raise InvalidArgument(
            f"pool {safe_repr(text, 40)}: must be one of {', '.join(PoolUse)}"
        ) from None


async def _now(call: Callable[..., T], *args: Any) -> T:
    """A synchronous change as the awaitable ``_mutate`` logs."""
    return call(*args)


def requester_of(peer: PeerIdentity | None) -> Requester:
    """Who a create's volumes are checked for: a UNIX peer's own uid and groups (scoped or
    not); a TLS launcher (or a peer not known) has no local uid."""
    if peer is None or peer.kind != "unix" or peer.uid is None:
        return Requester(RequesterKind.REMOTE)
    gid = -1 if peer.gid is None else peer.gid
    return Requester.local(peer.uid, gid, peer.groups, scoped=peer.scoped)


class ControlLocator(SafeCommandLocator):
    """Responders for one connection; ``peer`` is set once the peer is authenticated."""

    log = Logger()

    def __init__(self, factory: ControlServerFactory) -> None:
        self.factory = factory
        self.context = factory.context
        self.backend: ControlBackend = factory.context.backend
        self.peer: PeerIdentity | None = None
        #: A scoped peer's uid (``--allow-uid UID:scoped``): each call is then seen through
        #: a :class:`ScopedBackend` of the capability it gives.
        self.scoped_uid: int | None = None
        self.on_command = factory.context.on_command
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
        smolvm = self.context.smolvm
        if not smolvm.settled:  # the daemon's one smolvm probe is still running
            await smolvm.when_settled()
        vm_uids, basis = smolvm.vm_uids()
        return {
            "server_version": self.context.server_version,
            "protocol": max(common),
            "features": list(C.FEATURES),
            "smolvm_available": smolvm.available,
            "smolvm_version": smolvm.version,
            "smolvm_source": smolvm.source,
            "smolvm_tested": smolvm.tested,
            "smolvm_tested_versions": list(smolvm.tested_versions),
            "vm_uids": vm_uids,
            "vm_uids_basis": basis,
            "guest_kit": smolvm.guest_kit(),
            "guest_kit_argv": smolvm.guest_kit_argv(),
        }

    @C.Ping.responder
    def ping(self) -> dict[str, Any]:
        return {}

    def _full_control(self, command: str) -> None:
        if self.scoped_uid is not None:
            raise PermissionDenied(f"{command}: a scoped peer may not ask for it")

    def _scope(self, capability: str | None, *, mint: bool = False) -> ScopedBackend | None:
        """A scoped peer's view for a call that gave ``capability`` (``mint``: a create
        without one gets a new one); None for a peer with full control."""
        if self.scoped_uid is None:
            return None
        if capability is not None:
            capability = check_capability(capability)
        elif mint:
            capability = mint_capability()
        return ScopedBackend(self.context.backend, Identity(self.scoped_uid, capability))

    def _view(self, capability: str | None) -> tuple[ControlBackend, Callable[[str], str]]:
        """The backend this call sees, and the node's name of a bottle it names."""
        scope = self._scope(capability)
        if scope is None:
            return self.backend, _same
        return scope, scope.inner

    def _node(self) -> NodeControl:
        node = self.context.node
        if node is None:
            raise Unavailable("this daemon has no node contract")
        return node

    @C.NodeInfo.responder
    def node_info(self, capability: str | None = None) -> dict[str, Any]:
        r = self._node().report()
        c = r.capacity
        scope = self._scope(capability)
        if scope is not None:  # its own bottles only: it learns nothing of others'
            c = own_capacity(c, scope)
        return {
            "server_version": self.context.server_version,
            "protocol": C.PROTOCOL_VERSION,
            "host": r.host,
            "labels": [f"{k}={v}" for k, v in r.labels],
            "privilege": r.privilege,
            "smolvm": r.smolvm,
            "smolvm_tested": r.smolvm_tested,
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
            "vm_uids_left": r.vm_uids_left,
            "vm_uids": r.vm_uids,
            # the node's business: a scoped peer learns nothing of its pools
            "pools": [pool_record(p) for p in r.pools] if scope is None else [],
        }

    @C.EnsurePool.responder
    async def ensure_pool(self, spec: str, size: int) -> dict[str, Any]:
        self._full_control("EnsurePool")
        doc = parse_spec_json(spec)
        node = self._node()
        await node.when_serving()  # its members kept from before the restart are counted
        report = await self._mutate("EnsurePool", f"size {size}", _now(node.ensure_pool, doc, size))
        return {"pool": pool_record(report)}

    @C.ListPools.responder
    def list_pools(self) -> dict[str, Any]:
        self._full_control("ListPools")
        return {"pools": [pool_record(p) for p in self._node().pool_reports()]}

    @C.RemovePool.responder
    async def remove_pool(self, spec_hash: str) -> dict[str, Any]:
        self._full_control("RemovePool")
        node = self._node()
        destroyed = await self._mutate(
            "RemovePool", safe_repr(spec_hash, 40), _now(node.remove_pool, spec_hash)
        )
        return {"destroyed": destroyed}

    @C.Drain.responder
    async def drain(self, wait: bool | None, timeout: float | None) -> dict[str, Any]:
        if timeout is not None and not 0 < timeout <= MAX_WAIT:
            raise InvalidArgument(f"timeout: more than 0 and at most {MAX_WAIT:g} seconds")
        self._full_control("Drain")
        node = self._node()
        await self._mutate("Drain", "node", _now(node.drain))
        # A wait without a timeout is bounded too (a week), as every Deferred held for a peer.
        empty = await node.when_empty(timeout or MAX_WAIT) if wait else node.held() == 0
        return {"draining": node.draining, "held": node.held(), "empty": empty}

    @C.Undrain.responder
    async def undrain(self) -> dict[str, Any]:
        self._full_control("Undrain")
        node = self._node()
        await self._mutate("Undrain", "node", _now(node.undrain))
        return {"draining": node.draining}

    def _record(self, bottle: Bottle, backend: ControlBackend) -> BottleRecord:
        return bottle_record(
            bottle,
            len(backend.list_forwards(bottle.name)),
            bridge=backend.bridge_status(bottle.name),
        )

    @C.CreateBottle.responder
    async def create_bottle(
        self,
        name: str,
        alias: str | None,
        spec: str | None,
        owner: str | None = None,
        lease_seconds: float | None = None,
        capability: str | None = None,
        pool: str | None = None,
    ) -> dict[str, Any]:
        name = check_bottle_name(name)
        addr = None if alias is None else parse_canonical_ipv4(alias, "alias")
        use = None if pool is None else parse_pool_use(pool)
        # INVALID_ARGUMENT before anything changes; the bottles layer gets the parsed spec.
        parsed = None if spec is None else parse_bottle_spec(name, parse_spec_json(spec))
        tenancy = Tenancy.requested(owner, lease_seconds, None)
        scope = self._scope(capability, mint=True)
        backend: ControlBackend = self.backend if scope is None else scope
        subject = name if scope is None else scope.inner(name)
        options: dict[str, Any] = {} if use is None else {"pool": use}
        create = (
            backend.create_bottle(name, addr, spec=parsed, **options)
            if tenancy is None and parsed is None
            else backend.create_bottle(
                name,
                addr,
                spec=parsed,
                tenancy=tenancy,
                requester=requester_of(self.peer),
                **options,
            )
        )
        bottle = await self._mutate("CreateBottle", subject, create)
        record = self._record(bottle, backend)
        if scope is not None:  # the secret its later calls present: told to its holder only
            record = evolve(record, capability=scope.identity.capability)
        return {"bottle": record}

    @C.RenewLease.responder
    async def renew_lease(
        self, name: str, seconds: float, capability: str | None = None
    ) -> dict[str, Any]:
        name = check_bottle_name(name)
        backend, inner = self._view(capability)
        node = self._node()
        # A restarted daemon answers a bottle it has not restored yet after its restore
        # (its owner's renewal must not look like a lost bottle).
        await node.when_serving()
        backend.get_bottle(name)  # NOT_FOUND for a scoped peer's other bottles
        node.renew_lease(inner(name), seconds)
        return {"bottle": self._record(backend.get_bottle(name), backend)}

    @C.VerifyBottle.responder
    async def verify_bottle(self, name: str, capability: str | None = None) -> dict[str, Any]:
        name = check_bottle_name(name)
        backend, inner = self._view(capability)
        bottle, verdict = await self._mutate(
            "VerifyBottle", inner(name), backend.verify_bottle(name)
        )
        return {"bottle": self._record(bottle, backend), "result": verdict.result.value}

    @C.SetEgressPolicy.responder
    async def set_egress_policy(
        self, bottle: str, allow_hosts: list[str], capability: str | None = None
    ) -> dict[str, Any]:
        bottle = check_bottle_name(bottle)
        hosts = check_allow_hosts(allow_hosts)
        backend, inner = self._view(capability)
        result = await self._mutate(
            "SetEgressPolicy", inner(bottle), backend.set_egress_policy(bottle, hosts)
        )
        return {"allow_hosts": list(result)}

    @C.DestroyBottle.responder
    async def destroy_bottle(self, name: str, capability: str | None = None) -> dict[str, Any]:
        name = check_bottle_name(name)
        backend, inner = self._view(capability)
        await self._mutate("DestroyBottle", inner(name), backend.destroy_bottle(name))
        # Its commands end with it (while it was being destroyed, a new Exec was BUSY).
        self.factory.end_exec_sessions_of(inner(name))
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
        capability: str | None = None,
    ) -> dict[str, Any]:
        check_bottle_name(bottle)
        backend, inner = self._view(capability)
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
                return backend.spawn_exec(bottle, request, bridge)
            return backend.spawn_exec(bottle, request, bridge, stdio=bridge.make_stdio())

        await self._attach(
            inner(bottle),
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
        """Start a command with a bridge (``bottle``: the node's name); the connection
        switches once the answer is out."""
        connection = self.connection
        if connection is None or connection.in_flight != 1:
            raise Busy(f"{what} needs a connection of its own (no other command in flight)")
        f, shared = self.factory, self.context
        if f.stopping:
            raise Unavailable("the daemon is stopping")
        peer = self.peer.describe() if self.peer else "?"
        bridge = ExecBridge(
            bottle=bottle,
            peer=peer,
            tty=tty,
            stdin=stdin,
            clock=shared.clock,
            resize=resize,
            on_end=shared.exec_sessions.discard,
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
        shared.exec_sessions.add(bridge)
        if not self._bottle_exists(bottle):  # destroyed while smolvm was starting the command
            f.end_exec_sessions_of(bottle)
        if connection.transport is None:  # the client left while smolvm was starting
            bridge.client_lost()
        else:
            connection.switch_after_answer(bridge)

    def _bottle_exists(self, name: str) -> bool:
        """Whether the node's bottle ``name`` is still there."""
        try:
            self.context.backend.get_bottle(name)
        except NotFound:
            return False
        return True

    @C.Logs.responder
    async def logs(
        self,
        bottle: str,
        tail: int | None,
        follow: bool | None,
        capability: str | None = None,
    ) -> dict[str, Any]:
        check_bottle_name(bottle)
        lines = DEFAULT_TAIL if tail is None else tail
        if not 0 <= lines <= MAX_TAIL:
            raise InvalidArgument(f"tail must be 0-{MAX_TAIL}")
        backend, inner = self._view(capability)
        await self._attach(
            inner(bottle),
            lambda bridge: backend.spawn_logs(bottle, lines, bool(follow), bridge),
            tty=False,
            stdin=False,
            what="logs",
        )
        return {}

    @C.Watch.responder
    def watch(self, bottle: str | None, capability: str | None = None) -> dict[str, Any]:
        scope = self._scope(capability)
        if bottle is not None:
            check_bottle_name(bottle)
            if scope is not None:
                bottle = scope.inner(bottle)
        hub = self.context.event_hub
        if hub is None or self.connection is None:
            raise Unavailable("this daemon publishes no events")
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
        # A gone bottle's traces are the host's business, whoever made it: full control.
        self._full_control("Leftovers")
        return {"leftovers": await self.backend.leftovers(name)}

    @C.ListBottles.responder
    def list_bottles(
        self, offset: int | None, limit: int | None, capability: str | None = None
    ) -> dict[str, Any]:
        backend, _ = self._view(capability)
        # Each record is built only when its page is (the forward count of one bottle is the
        # length of its lazy forward view): a page costs the page, not every bottle.
        records: LazyView[BottleRecord] = LazyView(
            backend.list_bottles(),
            lambda b: bottle_record(b, len(backend.list_forwards(b.name)), with_env=False),
        )
        return paginate(records, offset, limit, "bottles")

    @C.BottleStatus.responder
    def bottle_status(self, name: str, capability: str | None = None) -> dict[str, Any]:
        name = check_bottle_name(name)
        backend, _ = self._view(capability)
        return {"bottle": self._record(backend.get_bottle(name), backend)}

    @C.AddForward.responder
    async def add_forward(
        self,
        bottle: str,
        label: str,
        target: str,
        port: int | None,
        capability: str | None = None,
    ) -> dict[str, Any]:
        bottle = check_bottle_name(bottle)
        label = check_label(label)
        backend, inner = self._view(capability)
        root = self.context.unix_target_root
        target_spec = parse_target(
            target, unix_root=None if root is None else targets_dir(root, inner(bottle))
        )
        port = check_port(0 if port is None else port, allow_zero=True)
        info = await self._mutate(
            "AddForward",
            f"{inner(bottle)}/{label}",
            backend.add_forward(bottle, label, target_spec, port=port),
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
    async def remove_forward(
        self, bottle: str, label: str, capability: str | None = None
    ) -> dict[str, Any]:
        bottle = check_bottle_name(bottle)
        label = check_label(label)
        backend, inner = self._view(capability)
        await self._mutate(
            "RemoveForward", f"{inner(bottle)}/{label}", backend.remove_forward(bottle, label)
        )
        return {}

    def _forwards(self, backend: ControlBackend, bottle: str | None) -> Sequence[ForwardInfo]:
        """The forwards of ``bottle`` (NOT_FOUND for one ``backend`` does not know), or all."""
        if bottle is not None:
            check_bottle_name(bottle)
            backend.get_bottle(bottle)  # NOT_FOUND for an unknown bottle
        return backend.list_forwards(bottle)

    @C.ListForwards.responder
    def list_forwards(
        self,
        bottle: str | None,
        offset: int | None,
        limit: int | None,
        capability: str | None = None,
    ) -> dict[str, Any]:
        backend, _ = self._view(capability)
        records: LazyView[ForwardRecord] = LazyView(self._forwards(backend, bottle), forward_record)
        return paginate(records, offset, limit, "forwards")

    @C.Stats.responder
    def stats(
        self,
        bottle: str | None,
        offset: int | None,
        limit: int | None,
        capability: str | None = None,
    ) -> dict[str, Any]:
        backend, _ = self._view(capability)
        forwards = self._forwards(backend, bottle)
        layer = backend.transparent_stats(bottle)
        # The forwards, then one row per transparent egress target (label "transparent:T").
        rows: list[ForwardInfo | TransparentCount] = [*forwards, *layer]
        records: LazyView[StatsRecord] = LazyView(rows, _stats_row)
        return paginate(records, offset, limit, "stats")


def _stats_row(row: ForwardInfo | TransparentCount) -> StatsRecord:
    if isinstance(row, TransparentCount):
        return transparent_record(row)
    return stats_record(row)


@implementer(IHandshakeListener)
class ControlServerProtocol(HardenedAMP):
    """One control connection: its listener's admission lets the peer in before a single
    byte is parsed."""

    log = Logger()

    def __init__(self, factory: ControlServerFactory) -> None:
        self.control = ControlLocator(factory)
        self.admission = factory.admission
        super().__init__(locator=self.control, pause_reading=self.admission.pause_reading)
        self.control.connection = self
        self.factory = factory
        self.context = factory.context
        # Taken at accept (UNIX), or once the peer is authenticated (TLS: take_slot).
        self._holds_slot = self.admission.slot_at_accept

    def take_slot(self) -> bool:
        """One of the factory's capped slots for this connection, or False at the cap."""
        self._holds_slot = self.factory.take_slot()
        return self._holds_slot

    def release_slot(self) -> None:
        """Give the connection's slot back (once) to the factory's connection cap."""
        if self._holds_slot:
            self._holds_slot = False
            self.factory.open_connections -= 1

    def produce(self) -> None:
        """The transport's write buffer paces this connection (it pauses our parsing)."""
        self.ctransport.registerProducer(self, True)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.release_slot()
        self.admission.connection_lost(self)
        if self.context.event_hub is not None:
            self.context.event_hub.forget(self)
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
        self.admission.connection_made(self)

    def authenticated_as(self, peer: PeerIdentity) -> None:
        """The peer is who it may be: its boxes are parsed from now on (a scoped peer's
        through a view of its own bottles)."""
        self.control.peer = peer
        if peer.scoped and peer.uid is not None:
            self.control.scoped_uid = peer.uid
            # What a responder sees unless a call's capability says more: none of the bottles.
            self.control.backend = ScopedBackend(self.context.backend, Identity(peer.uid))
        self.peer_authenticated()

    def first_bytes_received(self) -> None:
        """Told by the TLS layer: this peer is not silent (see the handshake admission)."""
        self.admission.first_bytes(self)

    def handshakeCompleted(self) -> None:
        self.admission.handshake_completed(self)


class ControlServerFactory(Factory):
    """Builds one listener's control connections: the shared ``context`` behind this
    listener's ``admission`` (:class:`UnixAdmission` or :class:`TLSAdmission`), at most
    ``max_connections`` authenticated at once."""

    log = Logger()
    noisy = False

    def __init__(
        self,
        context: ControlContext,
        admission: Admission,
        *,
        max_connections: int = DEFAULT_MAX_CONTROL_CONNECTIONS,
    ) -> None:
        self.context = context
        self.admission = admission
        self.stopping = False
        #: Concurrent connections at most (their boxes are capped at 256 KiB each).
        self.max_connections = max_connections
        self.open_connections = 0
        #: Connections refused by the cap (metrics).
        self.refused = 0

    def end_exec_sessions(self) -> None:
        """The daemon stops: end every command still running for a client."""
        self.stopping = True
        for bridge in list(self.context.exec_sessions):
            bridge.terminate()

    def end_exec_sessions_of(self, bottle: str) -> None:
        """The bottle was destroyed: end the commands still running in it for a client."""
        for bridge in [b for b in self.context.exec_sessions if b.bottle == bottle]:
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
        self.context.refused_log.flush()

    def take_slot(self) -> bool:
        """One of the capped slots for a peer, or False (logged, rate-limited) at the cap."""
        if self.open_connections >= self.max_connections:
            # Each connection may buffer up to a 256 KiB box: the cap bounds that memory (and
            # the fds) whoever connects.
            self.refused += 1
            self.context.refused_log.warn(
                ("control-cap", self.admission.kind),
                "control: refused a connection: {max_connections} connections are open",
                max_connections=self.max_connections,
            )
            return False
        self.open_connections += 1
        return True

    def buildProtocol(self, addr: IAddress | None) -> ControlServerProtocol | None:
        if self.admission.slot_at_accept and not self.take_slot():
            return None  # Twisted closes the socket
        return ControlServerProtocol(self)
