"""The forward table: every agent endpoint listener, its live relays and its counters.

This is the API the control plane and the config loader call. Every ``add`` re-checks the
binding invariant (own alias, or a path inside the bottle's own directory) right before it
binds, whatever the caller already checked; ``remove`` returns only once the listener and every
relay socket of the forward are closed, so a caller can safely reuse the address afterwards.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any, cast

from attrs import evolve, frozen
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.interfaces import IListeningPort, IStreamClientEndpoint
from twisted.internet.protocol import Factory
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure

from bottlenet.errors import (
    AlreadyExists,
    BindRefused,
    BottlenetError,
    Busy,
    InvalidArgument,
    NotFound,
    Unavailable,
    listen_reason,
    safe_repr,
)
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.budget import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_PER_BOTTLE,
    RESERVED_FDS,
    ConnectionBudget,
    IdleSweep,
)
from bottlenet.forward.capabilities import (
    ClosableEngines,
    FdBudgetedEngines,
    SocketStartingEngines,
)
from bottlenet.forward.connect import FastClientEndpoint
from bottlenet.forward.listen import BackoffTCP4ServerEndpoint, BackoffUNIXServerEndpoint
from bottlenet.forward.ratelimit import RateLimitedLogger
from bottlenet.forward.relay import (
    OUTCOME_ABORTED,
    OUTCOME_CLOSED,
    EngineFactory,
    Leg,
    Outcome,
    RelayFailure,
    RelaySession,
    TransportRelay,
)
from bottlenet.forward.spec import (
    MAX_CONNECTIONS_LIMIT,
    ForwardSpec,
    ListenSpec,
    TargetSpec,
    TCPListen,
    TCPTarget,
    UNIXListen,
    UNIXTarget,
    bottle_dir,
    check_bottle_name,
    check_label,
    check_port,
    check_unix_listen,
    target_root,
    targets_dir,
)
from bottlenet.forward.splice import engine_factory
from bottlenet.forward.targets import CheckedUNIXTarget, OwnSockets, check_target
from bottlenet.paths import ensure_private_dir, unix_path_state
from bottlenet.views import LazyView
from bottlenet.waiters import OneShot

if TYPE_CHECKING:
    from twisted.internet.interfaces import IAddress

#: At most one refusal (or relay failure) log event per forward per this many seconds.
REFUSAL_LOG_INTERVAL = 1.0
_REFUSAL_WHY = {
    "forward": "its max_connections are active",
    "bottle": "the bottle's connection budget is used up",
    "global": "the daemon's connection budget (or this bottle's fair share) is used up",
    "closing": "the forward is closing",
    "peer": "the connecting uid is not one this bottle's endpoints admit",
}
_FD_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE})


#: Linux's peer credentials on UNIX sockets; elsewhere the endpoints' file modes decide alone.
HAS_PEERCRED = hasattr(socket, "SO_PEERCRED")


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of a UNIX peer (``SO_PEERCRED``), or None where the platform has no such call."""
    so_peercred = getattr(socket, "SO_PEERCRED", None)
    if so_peercred is None or sock.family != socket.AF_UNIX:
        return None
    try:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, so_peercred, 12))
    except OSError:
        return None
    return int(uid)


@frozen
class ForwardCounters:
    """Counters of one forward. ``bytes_in`` = agent -> target, ``bytes_out`` = target -> agent."""

    accepted: int
    active: int
    refused: int
    failed: int
    bytes_in: int
    bytes_out: int


@frozen
class ForwardInfo:
    """A forward as it is: ``bound`` is the real address (port 0 resolved)."""

    spec: ForwardSpec
    bound: ListenSpec
    counters: ForwardCounters


Key = tuple[str, str]


class ForwardPhase(StrEnum):
    """Where a forward is: it changes once per add and once per remove, so a field, not a
    machine (as ``relay.Phase``).

    ``PENDING`` (its listener binding: the key is taken, the forward not listed yet), then
    ``LISTENING`` (listed, relaying), then ``CLOSING`` (listener stopped, relays aborted: its
    key stays taken until every fd is closed). A failed bind leaves the table from ``PENDING``.
    """

    PENDING = "pending"
    LISTENING = "listening"
    CLOSING = "closing"


# Module names for the members: ``_admit`` reads the phase once per connection (as relay.py).
_PENDING, _LISTENING, _CLOSING = ForwardPhase.PENDING, ForwardPhase.LISTENING, ForwardPhase.CLOSING


class _ForwardFactory(Factory):
    """One forward's listener factory, relay owner and counters.

    The connection cap is enforced here in ``buildProtocol`` (None = refused and closed with a
    reset), not with a ``policies`` wrapper, which would lose half-close.
    """

    log = Logger(namespace="bottlenet.forward")
    noisy = False

    def __init__(
        self,
        table: ForwardTable,
        spec: ForwardSpec,
        target: IStreamClientEndpoint,
        engine_factory: EngineFactory,
    ) -> None:
        self.table = table
        self.spec = spec
        self.bound: ListenSpec = spec.listen
        self.port: IListeningPort | None = None
        self.target = target
        self._engine_factory = engine_factory
        self._clock = table.reactor
        self.sessions: set[RelaySession] = set()
        self.accepted = 0
        self.refused = 0
        self.failed = 0
        self.done_in = 0
        self.done_out = 0
        self.phase = _PENDING
        #: Fires once the forward has left the table (every fd closed): what removals wait on.
        self.removed: OneShot[None] = OneShot()
        #: While set, accepted connections go to this factory instead of a relay.
        self.diverted: Factory | None = None
        #: Offered to the listener: accepted sockets skip transports when the engine can start
        #: from bare sockets (splice) and the target endpoint can hand one over (fast connect).
        engines: object = engine_factory  # a callable that may offer more (see capabilities)
        self.accept_socket: (
            Callable[[socket.socket, Callable[[Leg], object]], bool | None] | None
        ) = (
            self._accept_socket
            if isinstance(engines, SocketStartingEngines) and isinstance(target, FastClientEndpoint)
            else None
        )
        #: Offered to the listener: the SO_PEERCRED check, only where it can apply (a UNIX
        #: endpoint on a platform that has it); TCP listeners never call it.
        self.admit_peer: Callable[[socket.socket], bool] | None = (
            self._admit_peer if isinstance(spec.listen, UNIXListen) and HAS_PEERCRED else None
        )

    def buildProtocol(self, addr: IAddress | None) -> Any:
        if self.diverted is not None and self.phase is not _CLOSING:
            return self.diverted.buildProtocol(addr)
        session = self._admit()
        return None if session is None else session.inbound

    def _admit(self) -> RelaySession | None:
        """The admission point for every relayed connection (both paths): a new session
        counted, tracked and under the idle watch, or None (refused: the listener resets
        the connection)."""
        budget = self.table.budget
        if self.phase is _CLOSING:
            reason: str | None = "closing"
        elif len(self.sessions) >= self.spec.max_connections:
            reason = budget.refuse_forward()
        else:
            reason = budget.admit(self.spec.bottle)
        if reason is not None:
            self.refused += 1
            self._log_refusal(reason)
            return None
        self.accepted += 1
        session = RelaySession(self._clock, self.target, self, engine_factory=self._engine_factory)
        self.sessions.add(session)
        self.table.idle.started(session)
        return session

    def _admit_peer(self, sock: socket.socket) -> bool:
        """The listener's peer check (UNIX endpoints only): a bottle with admitted uids takes
        a connection only from one of them (``SO_PEERCRED``), as the control socket does."""
        uids = self.table.peers.get(self.spec.bottle)
        if uids is None:
            return True  # no uids given for this bottle: the file modes decide, as before
        if peer_uid(sock) in uids:
            return True
        self.refused += 1
        self._log_refusal("peer")
        return False

    def _accept_socket(self, sock: socket.socket, adopt: Callable[[Leg], object]) -> bool | None:
        """The listener's fast path (``listen.BackoffTCPPort``): admit, then relay the bare
        socket (``RelaySession.start_accepted``). False = refused (the listener resets);
        None = not a relay now (diverted): the listener goes the ``buildProtocol`` way."""
        if self.diverted is not None and self.phase is not _CLOSING:
            return None
        session = self._admit()
        if session is None:
            return False
        try:
            session.start_accepted(sock, adopt, self.target)  # type: ignore[arg-type]
        except BaseException:
            self.sessions.discard(session)
            self.table.budget.release(self.spec.bottle)
            self.table.idle.ended(session)
            raise
        return True

    def _log_refusal(self, reason: str) -> None:
        # One line per forward and reason per interval, whatever the agent does.
        self.table.limited_log.warn(
            ("refused", self.spec.bottle, self.spec.label, reason),
            "forward {bottle}/{label} refused a connection: {why}",
            bottle=self.spec.bottle,
            label=self.spec.label,
            reason=reason,
            why=_REFUSAL_WHY.get(reason, reason),
            max_connections=self.spec.max_connections,
        )

    # RelayOwner
    def relay_ended(
        self, session: RelaySession, outcome: Outcome, reason: RelayFailure | None
    ) -> None:
        if session in self.sessions:
            self.sessions.discard(session)
            self.table.budget.release(self.spec.bottle)
        self.table.idle.ended(session)
        bytes_in, bytes_out = session.bytes_in, session.bytes_out
        self.done_in += bytes_in
        self.done_out += bytes_out
        clean = outcome in (OUTCOME_CLOSED, OUTCOME_ABORTED)
        if not clean:
            self.failed += 1
            if reason is not None and reason.errno in _FD_EXHAUSTED:
                # The connect could not get a socket: stop accepting for a while (the
                # listener's EMFILE backoff) so further clients wait in the backlog instead of
                # being accepted only to be reset.
                exhausted = getattr(self.port, "exhausted", None)  # ExhaustiblePort
                if exhausted is not None:
                    exhausted(reason.errno)
        elif not self.table.log_clean_relay_ends:
            return
        # Metadata only: never payload bytes, never client-controlled values. An agent
        # decides how often its relays fail: those lines are rate-limited per forward.
        log = self.log.emit if clean else self._emit_failure
        log(
            self.log_level(outcome),
            "relay {bottle}/{label} {outcome}: {bytes_in} bytes in, {bytes_out} bytes out,"
            " {duration:.3f}s",
            bottle=self.spec.bottle,
            label=self.spec.label,
            outcome=outcome,
            reason=None if reason is None else reason.describe(),
            bytes_in=bytes_in,
            bytes_out=bytes_out,
            duration=self._clock.seconds() - session.started,
        )

    def _emit_failure(self, level: LogLevel, format: str, **kwargs: Any) -> None:
        key = ("relay", self.spec.bottle, self.spec.label, kwargs.get("outcome"))
        self.table.limited_log.emit(level, key, format, **kwargs)

    @staticmethod
    def log_level(outcome: Outcome) -> LogLevel:
        """Clean ends are debug (one per connection adds up); failures are info."""
        return LogLevel.debug if outcome in (OUTCOME_CLOSED, OUTCOME_ABORTED) else LogLevel.info

    def counters(self) -> ForwardCounters:
        live_in = live_out = 0
        for s in self.sessions:
            live_in += s.bytes_in
            live_out += s.bytes_out
        return ForwardCounters(
            accepted=self.accepted,
            active=len(self.sessions),
            refused=self.refused,
            failed=self.failed,
            bytes_in=self.done_in + live_in,
            bytes_out=self.done_out + live_out,
        )

    def info(self) -> ForwardInfo:
        return ForwardInfo(self.spec, self.bound, self.counters())

    def shutdown(self) -> defer.Deferred[None]:
        """Stop listening and abort every live relay; fires once all their fds are closed."""
        self.phase = _CLOSING
        waits: list[defer.Deferred[Any]] = []
        if self.port is not None:
            waits.append(defer.maybeDeferred(self.port.stopListening))
            self.port = None
        for session in list(self.sessions):
            waits.append(session.when_ended())
            session.abort()
        d = defer.gatherResults(waits, consumeErrors=True)
        return d.addCallback(lambda _: None)


class ForwardTable(Service):
    """All forwards of the daemon, keyed by (bottle, label)."""

    log = Logger(namespace="bottlenet.forward")

    def __init__(
        self,
        reactor: Any,
        aliases: AliasRegistry,
        *,
        state_dir: str,
        connect_timeout: float = 10.0,
        engine: str = "auto",
        per_bottle_connections: int = DEFAULT_PER_BOTTLE,
        max_connections: int | None = None,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        reserved_fds: int = RESERVED_FDS,
        clock: Any = None,
    ) -> None:
        """``engine``: ``auto`` (splice where supported), ``splice`` or ``portable``.

        Raises ValueError for an unknown or unsupported ``engine``. Relays connect to their
        targets through :meth:`client_endpoint`.
        """
        self.reactor = reactor
        self.aliases = aliases
        self.state_dir = state_dir
        self.connect_timeout = connect_timeout
        #: Emit the per-relay log event for clean ends too (debug level); failures always log.
        #: The benchmark entry point turns it off: no per-connection logging there.
        self.log_clean_relay_ends = True
        #: The relay engine for new connections (see ``splice.engine_factory``).
        self.engine_factory: EngineFactory = engine_factory(reactor, engine)
        self.engine = "portable" if self.engine_factory is TransportRelay else "splice"
        #: Every forward, whatever its phase: a key is taken from add until removed.
        self._forwards: dict[Key, _ForwardFactory] = {}
        #: Labels of each bottle's forwards: list(bottle) costs that bottle's forwards only.
        self._labels: dict[str, set[str]] = {}
        self._sorted_keys: list[Key] | None = None  # the listening keys sorted, until they change
        #: Forwards in LISTENING, in all and per bottle: the budget's listener fds and its
        #: fair-share divisor, read on every accepted connection (no scan of the table).
        self._listening_total = 0
        self._listening: dict[str, int] = {}
        self._stopping = False
        clock = reactor if clock is None else clock
        engines: object = self.engine_factory
        budgeted = engines if isinstance(engines, FdBudgetedEngines) else None
        self.budget = ConnectionBudget(
            per_bottle=per_bottle_connections,
            total=max_connections,
            listeners=lambda: self._listening_total,
            bottles=lambda: len(self._listening),
            reserved=reserved_fds,
            fds_per_relay=budgeted.fds_per_relay if budgeted is not None else 2,
            engine_fds=budgeted.engine_fds if budgeted is not None else 0,
        )
        self.idle = IdleSweep(clock, idle_timeout, self._relay_idle)
        #: Relays aborted by the idle timeout.
        self.idle_aborted = 0
        self.limited_log = RateLimitedLogger(self.log, clock, interval=REFUSAL_LOG_INTERVAL)
        #: The daemon's own sockets: no forward may target one (tap registers them).
        self.own_sockets = OwnSockets()
        self.own_sockets.extra_unix = self._unix_listen_paths
        #: The uids each bottle's UNIX endpoints admit (absent: file modes decide alone).
        self.peers: dict[str, frozenset[int]] = {}

    # Service
    def startService(self) -> None:
        self._stopping = False
        super().startService()
        total, per_bottle = self.budget.total, self.budget.per_bottle
        self.log.info(
            "relays: {engine} engine, at most {total} connections in all ({source}), "
            "{per_bottle} per bottle{capped}, idle timeout {idle}",
            engine=self.engine,
            total=total,
            source="--max-connections"
            if self.budget.configured_total is not None
            else "from the open-files limit",
            per_bottle=per_bottle,
            # a per-bottle cap above the total is not a contradiction: the total applies first
            capped=" (capped by the total)" if per_bottle > total else "",
            idle=f"{self.idle.timeout:g}s" if self.idle.timeout > 0 else "off",
        )

    def _relay_idle(self, session: RelaySession) -> None:
        self.idle_aborted += 1

    def stopService(self) -> defer.Deferred[None]:
        self._stopping = True
        super().stopService()
        waits = self._removals(self._forwards)

        def stopped(_: object) -> None:
            self.idle.stop()
            engines: object = self.engine_factory
            if isinstance(engines, ClosableEngines):
                engines.close()  # pooled pipes: no relay is left that could use them

        return defer.gatherResults(waits, consumeErrors=True).addCallback(stopped)

    def _unix_listen_paths(self) -> list[str]:
        return [
            f.spec.listen.path
            for f in self._forwards.values()
            if f.phase is _LISTENING and isinstance(f.spec.listen, UNIXListen)
        ]

    # Queries
    def get(self, bottle: str, label: str) -> ForwardInfo:
        return self._forward(bottle, label).info()

    def keys(self) -> list[Key]:
        """The (bottle, label) of every listening forward, sorted."""
        return sorted(self._listening_keys())

    def sessions(self, bottle: str, label: str) -> frozenset[RelaySession]:
        """The forward's live relays."""
        return frozenset(self._forward(bottle, label).sessions)

    def port(self, bottle: str, label: str) -> IListeningPort | None:
        """The forward's listening port (None once it is closing)."""
        return self._forward(bottle, label).port

    def target(self, bottle: str, label: str) -> IStreamClientEndpoint:
        """The endpoint the forward's relays connect through."""
        return self._forward(bottle, label).target

    def diverted_to(self, bottle: str, label: str) -> Factory | None:
        """The factory the forward's new connections go to instead of a relay (see divert)."""
        return self._forward(bottle, label).diverted

    def list(self, bottle: str | None = None) -> list[ForwardInfo]:
        return list(self.view(bottle))

    def view(self, bottle: str | None = None) -> Sequence[ForwardInfo]:
        """Like :meth:`list`, but each ForwardInfo is built only when it is read: a page of a
        listing costs the page, not every forward (the sorted keys are kept between calls)."""
        forwards = self._forwards
        if bottle is None:
            keys = self._sorted_keys
            if keys is None:
                keys = self._sorted_keys = sorted(self._listening_keys())
        else:
            keys = [
                (bottle, label)
                for label in sorted(self._labels.get(bottle, ()))
                if forwards[bottle, label].phase is _LISTENING
            ]
        return LazyView(keys, lambda k: forwards[k].info())

    def divert(self, bottle: str, label: str, factory: Factory | None) -> None:
        """Hand the forward's new connections to ``factory`` (None: back to the relay).

        For a check that must see connections on the real listener before it carries any
        traffic (the launch gate's host-side witness); live relays are not touched, and the
        relay path itself never looks at a diverted forward.
        """
        self._forward(bottle, label).diverted = factory

    # Changes
    def admit_peers(self, bottle: str, uids: frozenset[int] | None) -> None:
        """Let only ``uids`` connect to ``bottle``'s UNIX endpoints (None: lift the check)."""
        if uids is None:
            self.peers.pop(bottle, None)
        else:
            self.peers[bottle] = uids

    def add(self, spec: ForwardSpec) -> defer.Deferred[ForwardInfo]:
        """Bind ``spec``'s agent endpoint and start forwarding; fires with its ForwardInfo."""
        try:
            key = self._check_new(spec)
            created_dir = self._prepare_listen(spec)
        except BottlenetError as e:
            return defer.fail(e)
        except OSError as e:  # preparing the bottle dir or probing a stale socket
            return defer.fail(_bind_error(spec.listen, e))
        fwd = _ForwardFactory(self, spec, self._target_endpoint(spec), self.engine_factory)
        self._forwards[key] = fwd
        self._labels.setdefault(spec.bottle, set()).add(spec.label)
        d = self._server_endpoint(spec).listen(fwd)

        def listening(port: IListeningPort) -> ForwardInfo:
            fwd.port = port
            if isinstance(spec.listen, TCPListen):
                fwd.bound = TCPListen(spec.listen.alias, cast(IPv4Address, port.getHost()).port)
            fwd.phase = _LISTENING
            self._count_listening(spec.bottle, 1)
            self.log.info(
                "forward {bottle}/{label} listening on {listen} -> {target}",
                bottle=spec.bottle,
                label=spec.label,
                listen=fwd.bound.describe(),
                target=spec.target.describe(),
            )
            return fwd.info()

        def failed(f: Failure) -> Failure:
            self._drop(key)
            if created_dir is not None:
                try:
                    os.rmdir(created_dir)
                except OSError:
                    pass
            return Failure(_bind_error(spec.listen, f.value))

        return d.addCallbacks(listening, failed)

    def remove(self, bottle: str, label: str) -> defer.Deferred[None]:
        """Stop listening and abort the forward's relays; fires once every fd is closed."""
        fwd = self._forwards.get((bottle, label))
        if fwd is not None and fwd.phase is _PENDING:
            return defer.fail(Busy(f"forward {bottle}/{label} is still being added"))
        if fwd is None or fwd.phase is _CLOSING:
            return defer.fail(NotFound(f"no forward {safe_repr(bottle)}/{safe_repr(label)}"))
        return self._remove_key((bottle, label))

    def remove_bottle(self, bottle: str) -> defer.Deferred[None]:
        """Remove every forward of ``bottle`` (none is fine); fires once all are closed."""
        self.peers.pop(bottle, None)
        waits = self._removals([(bottle, label) for label in self._labels.get(bottle, ())])
        return defer.gatherResults(waits, consumeErrors=True).addCallback(lambda _: None)

    def rename_bottle(self, old: str, new: str) -> None:
        """``old``'s forwards become ``new``'s, listening on as they are (a warm pool's member
        taken by a create): their paths stay in ``old``'s directory (each spec's ``home``),
        their relays, counters, budget and admitted peers go with them."""
        if new in self._labels or new in self.peers:
            raise AlreadyExists(f"bottle {new} already has forwards")
        labels = self._labels.pop(old, set())
        for label in labels:
            fwd = self._forwards.pop((old, label))
            fwd.spec = evolve(fwd.spec, bottle=new, home=fwd.spec.home_dir)
            self._forwards[new, label] = fwd
        if labels:
            self._labels[new] = labels
        for counts in (self._listening, self.budget.active):
            if old in counts:
                counts[new] = counts.pop(old)
        if old in self.peers:
            self.peers[new] = self.peers.pop(old)
        self._sorted_keys = None

    # Internals
    def _forward(self, bottle: str, label: str) -> _ForwardFactory:
        """The listening forward (NotFound while it is still being added or removed)."""
        fwd = self._forwards.get((bottle, label))
        if fwd is None or fwd.phase is not _LISTENING:
            raise NotFound(f"no forward {safe_repr(bottle)}/{safe_repr(label)}")
        return fwd

    def _listening_keys(self) -> Iterator[Key]:
        return (k for k, f in self._forwards.items() if f.phase is _LISTENING)

    def _removals(self, keys: Iterable[Key]) -> Sequence[defer.Deferred[None]]:
        """Remove each listening forward of ``keys`` and wait for each closing one to be gone
        (remove_bottle, stopService); one still being added is left to its add."""
        waits: list[defer.Deferred[None]] = []
        for key in list(keys):
            fwd = self._forwards.get(key)
            if fwd is None:
                continue
            if fwd.phase is _LISTENING:
                waits.append(self._remove_key(key))
            elif fwd.phase is _CLOSING:
                waits.append(self._wait_removal(key))
        return waits

    def _remove_key(self, key: Key) -> defer.Deferred[None]:
        fwd = self._forwards[key]
        self._count_listening(key[0], -1)
        d = fwd.shutdown()  # CLOSING: the key stays taken (Busy) until every fd is closed

        def done(result: object) -> object:
            self._drop(key)
            self.log.info(
                "forward {bottle}/{label} removed", bottle=fwd.spec.bottle, label=fwd.spec.label
            )
            fwd.removed.fire(None)
            return result

        return d.addBoth(done)

    def _count_listening(self, bottle: str, delta: int) -> None:
        """A forward of ``bottle`` starts (1) or stops (-1) listening: the counts and the
        sorted listing follow."""
        self._listening_total += delta
        n = self._listening.get(bottle, 0) + delta
        if n:
            self._listening[bottle] = n
        else:
            del self._listening[bottle]
        self._sorted_keys = None

    def _wait_removal(self, key: Key) -> defer.Deferred[None]:
        return self._forwards[key].removed.when_fired()

    def _drop(self, key: Key) -> None:
        """The forward leaves the table (bind failed, or removed): its key is free again."""
        del self._forwards[key]
        labels = self._labels.get(key[0])
        if labels is not None:
            labels.discard(key[1])
            if not labels:
                del self._labels[key[0]]

    def _check_new(self, spec: ForwardSpec) -> Key:
        if self._stopping:
            raise Unavailable("the forward table is shutting down")
        if not isinstance(spec, ForwardSpec):
            raise InvalidArgument("not a ForwardSpec")
        check_bottle_name(spec.bottle)
        check_label(spec.label)
        key = (spec.bottle, spec.label)
        taken = self._forwards.get(key)
        if taken is not None and taken.phase is _CLOSING:
            raise Busy(f"forward {spec.bottle}/{spec.label} is still being removed")
        if taken is not None:
            raise AlreadyExists(f"forward {spec.bottle}/{spec.label} already exists")
        mc = spec.max_connections
        if isinstance(mc, bool) or not isinstance(mc, int) or not 1 <= mc <= MAX_CONNECTIONS_LIMIT:
            raise InvalidArgument(
                f"max_connections {safe_repr(mc)} is out of range 1-{MAX_CONNECTIONS_LIMIT}"
            )
        target = spec.target
        if isinstance(target, TCPTarget):
            if not isinstance(target.host, ipaddress.IPv4Address | ipaddress.IPv6Address):
                raise InvalidArgument("target host must be an IP address value")
            if not target.host.is_loopback:
                raise InvalidArgument(f"target host {target.host} is not a loopback address")
            check_port(target.port, allow_zero=False)
        elif not isinstance(target, UNIXTarget):
            raise InvalidArgument("unknown target kind")
        check_target(target, self._target_root(spec), self.aliases.pool, self.own_sockets)
        listen = spec.listen
        if isinstance(listen, TCPListen):
            self.aliases.check_owned(spec.bottle, listen.alias)
            check_port(listen.port, allow_zero=True)
        elif isinstance(listen, UNIXListen):
            check_unix_listen(listen, self.state_dir, spec.home_dir)
            for other in self._forwards.values():
                if other.phase is _LISTENING and other.spec.listen == listen:
                    raise BindRefused(f"cannot listen on {listen.describe()}: in use")
        else:
            raise InvalidArgument("unknown listen kind")
        return key

    def _prepare_listen(self, spec: ForwardSpec) -> str | None:
        """For a UNIX endpoint: make sure the bottle dir is ours and the path is free.

        Returns the bottle dir if this call created it (so a failed bind can remove it).
        """
        listen = spec.listen
        if not isinstance(listen, UNIXListen):
            return None
        bdir = bottle_dir(self.state_dir, spec.home_dir)
        os.makedirs(os.path.dirname(bdir), mode=0o700, exist_ok=True)
        # 0701 under per-VM uids: the VMMs pass through to their own sockets, nothing more.
        made = ensure_private_dir(bdir, name=f"bottle directory of {spec.bottle}", traversable=True)
        created = bdir if made else None
        state, _ = unix_path_state(listen.path)
        if state in ("symlink", "not-a-socket"):
            raise InvalidArgument(f"{listen.describe()} exists and is not a socket")
        if state in ("alive", "unknown"):  # unknown (e.g. EACCES): not ours to replace
            raise BindRefused(f"cannot listen on {listen.describe()}: in use by another process")
        if state == "stale":
            os.unlink(listen.path)  # a stale socket from a previous run
        return created

    def _server_endpoint(
        self, spec: ForwardSpec
    ) -> BackoffTCP4ServerEndpoint | BackoffUNIXServerEndpoint:
        backlog = min(1024, max(16, spec.max_connections))
        listen = spec.listen
        if isinstance(listen, TCPListen):
            return BackoffTCP4ServerEndpoint(
                self.reactor,
                listen.port,
                backlog=backlog,
                interface=str(listen.alias),
                start_paused=True,
            )
        return BackoffUNIXServerEndpoint(
            self.reactor, listen.path, backlog=backlog, mode=0o600, start_paused=True
        )

    def _target_endpoint(self, spec: ForwardSpec) -> IStreamClientEndpoint:
        endpoint = self.client_endpoint(spec.target)
        if isinstance(spec.target, UNIXTarget):
            root = self._target_root(spec)
            return CheckedUNIXTarget(
                endpoint, spec.target.path, root, self.own_sockets, spec.target.held
            )
        return endpoint

    def _target_root(self, spec: ForwardSpec) -> str:
        """The directory ``spec``'s UNIX target must stay inside (``forward.spec.target_root``)."""
        if isinstance(spec.target, UNIXTarget):
            return target_root(self.state_dir, spec.home_dir, spec.target.path)
        return targets_dir(self.state_dir, spec.bottle)

    def client_endpoint(self, target: TargetSpec) -> IStreamClientEndpoint:
        """How relays connect to ``target``: :class:`connect.FastClientEndpoint`, whose sockets
        are tuned before connecting and can be handed over to splice. The one connect path of
        the daemon; ``benchmarks/standalone.py --twisted-connect`` overrides it to time
        Twisted's own endpoints against it."""
        peer: IPv4Address | IPv6Address | UNIXAddress
        if isinstance(target, UNIXTarget):
            peer = UNIXAddress(target.path)
        elif isinstance(target.host, ipaddress.IPv6Address):
            peer = IPv6Address("TCP", str(target.host), target.port)
        else:
            peer = IPv4Address("TCP", str(target.host), target.port)
        return FastClientEndpoint(self.reactor, peer, self.connect_timeout)


def _bind_error(listen: ListenSpec, exc: BaseException) -> BottlenetError:
    """Map a listen failure to BindRefused with the address and the OS reason (no traceback)."""
    if isinstance(exc, BottlenetError):
        return exc
    reason = listen_reason(exc) or type(exc).__name__
    return BindRefused(f"cannot listen on {listen.describe()}: {reason}")


__all__ = ["ForwardCounters", "ForwardInfo", "ForwardTable"]
