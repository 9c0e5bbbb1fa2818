"""What the control listeners share, and how each one lets a peer in.

The daemon serves one control service through up to two doors: the UNIX socket and the
optional TLS port. As the transit relay's TCP and WebSocket connections feed one server state
through one client interface, both doors' factories hold one :class:`ControlContext` (the
backend, the clock, the exec sessions, the refused-peer log, the command observer, the facts
Hello reports) and differ only in their :class:`Admission`: the peer's uid from
``SO_PEERCRED`` (:class:`UnixAdmission`) or a client certificate verified by the TLS
handshake (:class:`TLSAdmission`).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from attrs import Factory, define, field, frozen
from cryptography.x509.oid import NameOID
from OpenSSL.crypto import X509
from twisted.internet.interfaces import IReactorTime, ISSLTransport
from twisted.logger import Logger

from bottlenet.control.admission import HandshakeAdmission, peer_source
from bottlenet.control.peercred import PeerCredentials, get_peer_credentials
from bottlenet.errors import safe_repr
from bottlenet.forward.ratelimit import RateLimitedLogger
from bottlenet.waiters import OneShot

if TYPE_CHECKING:
    from twisted.internet.defer import Deferred

    from bottlenet.control.backend import ControlBackend, NodeControl
    from bottlenet.control.events import EventHub
    from bottlenet.control.execbroker import ExecBridge
    from bottlenet.control.protocol import CommandObserver, IControlTransport

#: At most one "refused peer" line per uid per this many seconds (a peer can retry at will).
REFUSED_PEER_LOG_INTERVAL = 10.0


@frozen
class PeerIdentity:
    """An authenticated peer, as it appears in logs."""

    kind: Literal["unix", "tls"]
    uid: int | None = None
    pid: int | None = None
    subject: str | None = None
    #: ``--allow-uid UID:scoped``: it sees and acts on the bottles it created only.
    scoped: bool = False
    #: A UNIX peer's primary gid and supplementary groups (what its volumes are checked with).
    gid: int | None = None
    groups: tuple[int, ...] = ()

    def describe(self) -> str:
        if self.kind == "unix":
            scoped = " (scoped)" if self.scoped else ""
            return f"uid={self.uid} pid={self.pid if self.pid is not None else '?'}{scoped}"
        return f"tls subject={self.subject}"


def _no_vm_uids() -> tuple[str | None, str | None]:
    return None, None


def _settled() -> OneShot[None]:
    settled: OneShot[None] = OneShot()
    settled.fire(None)
    return settled


@define
class SmolvmFacts:
    """What Hello says of the daemon's smolvm, learned once from the daemon's one probe.

    Hello waits while the probe runs (:meth:`probing` until :meth:`settle`), so its smolvm
    fields are right from the first call: under socket activation that call comes as soon as
    the reactor runs. Settled from the start where no probe runs (tests, a daemon without
    smolvm).
    """

    version: str | None = None
    available: bool = field(default=Factory(lambda self: self.version is not None, True))
    #: Where the daemon's smolvm came from (``Smolvm.describe()``), once it is known.
    source: str | None = None
    #: False once the probe found a version outside the tested ones (None: not known).
    tested: bool | None = None
    #: The versions bottlenet is tested with, said with an untested one.
    tested_versions: tuple[str, ...] = ()
    #: smolvm's privilege model and its basis now (seen at a VM start, or expected).
    vm_uids: Callable[[], tuple[str | None, str | None]] = _no_vm_uids
    #: bottlenet's guest kit as ``status`` shows it (``KitKeeper.describe``; None: unknown).
    guest_kit: Callable[[], str | None] = lambda: None
    #: The ready kit's program as a guest runs it (``KitKeeper.guest_argv``; None: none).
    guest_kit_argv: Callable[[], list[str] | None] = lambda: None
    _settled: OneShot[None] = field(factory=_settled, init=False)

    @property
    def settled(self) -> bool:
        return self._settled.fired

    def when_settled(self) -> Deferred[None]:
        """A Deferred that fires once the probe has answered (at once if it has)."""
        return self._settled.when_fired()

    def probing(self, source: str, vm_uids: Callable[[], tuple[str | None, str | None]]) -> None:
        """The daemon's probe starts: Hello waits for :meth:`settle`, not a guess."""
        self.source, self.vm_uids = source, vm_uids
        self._settled = OneShot()

    def learned(
        self,
        version: str,
        available: bool,
        source: str,
        tested: bool = True,
        tested_versions: tuple[str, ...] = (),
    ) -> None:
        """The probe answered with smolvm's version (``available``: a supported one;
        ``tested``: one of ``tested_versions``, those bottlenet is tested with)."""
        self.version, self.available, self.source = version, available, source
        self.tested, self.tested_versions = tested, tested_versions

    def settle(self) -> None:
        """The probe is over, answered or failed: the waiting Hellos answer now."""
        self._settled.fire(None)


def _refused_log(context: ControlContext) -> RateLimitedLogger:
    return RateLimitedLogger(
        context.log,
        context.clock,
        interval=REFUSED_PEER_LOG_INTERVAL,
        max_keys=1024,
        # A one-shot timer only while refusals were dropped: no periodic wakeup.
        auto_flush=True,
    )


@frozen(kw_only=True)
class ControlContext:
    """The control service both listeners serve: one value, shared by their factories.

    ``clock`` (the reactor; a ``Clock`` in tests) rate-limits the refused-peer log per key,
    flushes the suppressed counts, times the TLS handshake deadline and exec time limits.
    ``on_command(command, result)`` hears every handled command (the daemon's metrics).
    """

    log = Logger()

    backend: ControlBackend
    server_version: str
    clock: IReactorTime
    smolvm: SmolvmFacts = field(factory=SmolvmFacts)
    on_command: CommandObserver | None = None
    #: Live exec sessions of both listeners; each factory ends them when it stops.
    exec_sessions: set[ExecBridge] = field(factory=set)
    refused_log: RateLimitedLogger = field(default=Factory(_refused_log, takes_self=True))
    event_hub: EventHub | None = None
    #: The node contract (NodeInfo, Drain, Undrain); None: those answer UNAVAILABLE.
    node: NodeControl | None = None
    #: The state dir, under which each bottle's UNIX forward targets live.
    unix_target_root: str | None = None


class Arrival(Protocol):
    """What an admission asks of a new control connection (``ControlServerProtocol``)."""

    @property
    def transport(self) -> Any: ...
    @property
    def ctransport(self) -> IControlTransport: ...
    @property
    def context(self) -> ControlContext: ...
    def produce(self) -> None:
        """The transport's write buffer paces the connection from now on."""

    def drop(self, why: str) -> None: ...
    def abort(self) -> None: ...
    def take_slot(self) -> bool: ...
    def release_slot(self) -> None: ...
    def authenticated_as(self, peer: PeerIdentity) -> None: ...


class Admission(Protocol):
    """How one listener lets a peer in: the one thing the UNIX and the TLS door do apart."""

    #: The listener's label in the cap's log key and the refusal metrics (``unix``, ``tls``).
    @property
    def kind(self) -> Literal["unix", "tls"]: ...

    #: Whether a connection takes its capped slot when accepted (else once authenticated).
    @property
    def slot_at_accept(self) -> bool: ...

    #: Whether reading pauses with parsing (never under TLS: it would stall the handshake).
    @property
    def pause_reading(self) -> bool: ...

    def connection_made(self, conn: Arrival) -> None: ...
    def first_bytes(self, conn: Arrival) -> None: ...
    def handshake_completed(self, conn: Arrival) -> None: ...
    def connection_lost(self, conn: Arrival) -> None: ...


@frozen
class UnixAdmission:
    """The UNIX socket's door: the peer's uid (``SO_PEERCRED``) against the allow-list.

    ``allowed_uids`` is the whole allow-list (see ``peercred.default_allowed_uids``);
    ``scoped_uids`` (``--allow-uid UID:scoped``) each see and act on their own bottles only.
    The slot is taken at accept (a refused peer gives it back at once), and reading pauses
    with parsing (back-pressure on a peer that does not read its answers).
    """

    allowed_uids: frozenset[int]
    scoped_uids: frozenset[int] = frozenset()
    peer_credentials: PeerCredentials = get_peer_credentials
    kind: Literal["unix", "tls"] = field(default="unix", init=False)
    slot_at_accept: bool = field(default=True, init=False)
    pause_reading: bool = field(default=True, init=False)

    def connection_made(self, conn: Arrival) -> None:
        handle = conn.ctransport.getHandle()
        if not isinstance(handle, socket.socket) or handle.family != socket.AF_UNIX:
            conn.drop("not a UNIX socket: refusing a peer without credentials")
            return
        try:
            cred = self.peer_credentials(handle)
        except OSError:
            conn.drop("could not read peer credentials")
            return
        scoped = cred.uid in self.scoped_uids
        if cred.uid not in self.allowed_uids and not scoped:
            conn.release_slot()  # a refused peer never holds one of the capped slots
            conn.context.refused_log.warn(
                ("refused-peer", cred.uid),
                "control: refused peer uid={uid} pid={pid}",
                uid=cred.uid,
                pid=cred.pid,
            )
            conn.abort()
            return
        conn.produce()
        conn.authenticated_as(
            PeerIdentity(
                "unix",
                uid=cred.uid,
                pid=cred.pid,
                scoped=scoped,
                gid=cred.gid,
                groups=cred.groups,
            )
        )

    def first_bytes(self, conn: Arrival) -> None:
        """Only the TLS layer reports first bytes."""

    def handshake_completed(self, conn: Arrival) -> None:
        """A UNIX socket has no handshake."""

    def connection_lost(self, conn: Arrival) -> None:
        """Nothing to forget: the slot is the connection's own."""


@frozen
class TLSAdmission:
    """The TLS port's door: a client certificate, verified by the TLS layer, in place of a
    uid. Until the handshake completes the connection holds no slot, and the
    :class:`HandshakeAdmission` bounds it (deadline, caps per source and in total)."""

    handshakes: HandshakeAdmission
    kind: Literal["unix", "tls"] = field(default="tls", init=False)
    slot_at_accept: bool = field(default=False, init=False)
    pause_reading: bool = field(default=False, init=False)
    log = Logger()

    @classmethod
    def of(cls, context: ControlContext) -> TLSAdmission:
        """The TLS door of ``context``: its clock times the deadline, its log says why."""
        return cls(HandshakeAdmission(context.clock, context.refused_log))

    def connection_made(self, conn: Arrival) -> None:
        # Authenticated in handshake_completed, before any application data flows; until
        # then the deadline and caps bound what this connection may hold.
        self.handshakes.admit(conn, peer_source(conn.transport), conn.abort)
        conn.produce()

    def first_bytes(self, conn: Arrival) -> None:
        """This peer is not silent: it gives way only once no silent one is left."""
        self.handshakes.spoke(conn)

    def handshake_completed(self, conn: Arrival) -> None:
        self.handshakes.settled(conn)
        cert = cast(X509 | None, ISSLTransport(conn.transport).getPeerCertificate())
        if cert is None:
            conn.drop("TLS peer presented no certificate")
            return
        if not conn.take_slot():
            conn.abort()  # the cap logged why, rate-limited
            return
        names = cert.to_cryptography().subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        subject = str(names[0].value) if names else ""
        peer = PeerIdentity("tls", subject=safe_repr(subject))
        conn.authenticated_as(peer)
        self.log.info("control: TLS peer {peer} authenticated", peer=peer.describe())

    def connection_lost(self, conn: Arrival) -> None:
        self.handshakes.settled(conn)
