"""Prometheus metrics over HTTP (``--metrics ENDPOINT``), loopback or UNIX socket only.

The text exposition format (version 0.0.4) is written by hand: it is small, and it keeps
``prometheus_client`` out of the daemon (the tests use it to parse what we write). What is
measured comes from a :class:`MetricsSource` (a snapshot of the forward table and the bottle
registry, read at scrape time) and from two recorders the daemon feeds as things happen:
:class:`CallStats` (smolvm calls) and :class:`CommandStats` (control commands).

Label values are only ever validated names; anything else is dropped (forwards, bottles)
or counted as ``other`` (recorders), and escaped per the format regardless.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from attrs import define, field, frozen
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint, UNIXServerEndpoint
from twisted.internet.interfaces import (
    IAddress,
    IDelayedCall,
    IReactorTime,
    IStreamServerEndpoint,
    ITCPTransport,
)
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.pages import notFound
from twisted.web.resource import IResource, Resource
from twisted.web.server import Request, Site

from bottlenet import __version__
from bottlenet.errors import InvalidArgument, safe_repr
from bottlenet.forward.ratelimit import RateLimitedLogger
from bottlenet.forward.spec import (
    BOTTLE_NAME_RE,
    LABEL_RE,
    AliasPool,
    parse_canonical_ipv4,
)
from bottlenet.paths import MAX_SUN_PATH, Description, split_description

if TYPE_CHECKING:  # the real records, named for the type checker only
    from bottlenet.bottles.model import Bottle
    from bottlenet.forward.table import ForwardInfo

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
# smolvm calls range from tens of milliseconds (list) to minutes (create, first image pull).
DURATION_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
NAME_RE = re.compile(r"[A-Za-z0-9_.]{1,64}")
STATE_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}")
OTHER = "other"
MAX_SERIES = 1000


# -- the --metrics endpoint ---------------------------------------------------------------


@frozen
class MetricsEndpoint:
    """A validated ``--metrics`` endpoint: loopback TCP or a UNIX socket, never a wildcard."""

    kind: str  # "tcp" | "tcp6" | "unix"
    port: int = 0
    interface: str = ""
    path: str = ""
    mode: int = 0o600

    def describe(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        if self.kind == "tcp6":
            return f"[{self.interface}]:{self.port}"
        return f"{self.interface}:{self.port}"

    def endpoint(self, reactor: Any) -> IStreamServerEndpoint:
        """Built from the validated fields, never by re-parsing the string."""
        if self.kind == "unix":
            return UNIXServerEndpoint(reactor, self.path, mode=self.mode)
        if self.kind == "tcp6":
            return TCP6ServerEndpoint(reactor, self.port, interface=self.interface)
        return TCP4ServerEndpoint(reactor, self.port, interface=self.interface)


def _arguments(description: Description, positional: str, allowed: set[str]) -> dict[str, str]:
    if len(description.positional) > 1:
        raise ValueError("only the first argument may be positional")
    args = dict(description.options)
    if description.positional:
        if positional in args:
            raise ValueError(f"{positional} given twice")
        args[positional] = description.positional[0]
    for key in args:
        if key not in allowed:
            raise ValueError(f"unknown argument {safe_repr(key)}")
    return args


def _port(text: str | None) -> int:
    if text is None or not text.isdigit() or len(text) > 5 or int(text) > 65535:
        raise ValueError(f"port {safe_repr(text)} must be a number 0-65535")
    return int(text)


def parse_metrics_endpoint(text: object, alias_pool: AliasPool | None = None) -> MetricsEndpoint:
    """Parse ``--metrics``; raise InvalidArgument for anything not loopback-only.

    Accepted: ``tcp:PORT:interface=127.x.y.z``, ``tcp6:PORT:interface=\\:\\:1``,
    ``unix:/abs/path[:mode=0600]``. A missing interface means every address and is refused,
    as is any address inside the bottle alias pool (an agent could reach it).
    """
    if not isinstance(text, str) or not text:
        raise InvalidArgument(f"metrics endpoint {safe_repr(text)} must be a non-empty string")
    try:
        description = split_description(text)
        kind = description.kind
        if kind in ("tcp", "tcp6"):
            return _parse_tcp(kind, description, alias_pool)
        if kind == "unix":
            return _parse_unix(description)
        raise ValueError(
            "use tcp:PORT:interface=127.0.0.1, tcp6:PORT:interface=\\:\\:1 or unix:PATH"
        )
    except ValueError as e:
        raise InvalidArgument(f"metrics endpoint {safe_repr(text)}: {e}") from None


def _parse_tcp(
    kind: str, description: Description, alias_pool: AliasPool | None
) -> MetricsEndpoint:
    args = _arguments(description, "port", {"port", "interface"})
    port = _port(args.get("port"))
    interface = args.get("interface")
    if not interface:
        raise ValueError(
            "no interface= given, which listens on every address; name a loopback address, "
            f"e.g. {kind}:{port}:interface=" + ("127.0.0.1" if kind == "tcp" else "\\:\\:1")
        )
    if kind == "tcp6":
        if interface != "::1":
            raise ValueError("the only IPv6 interface allowed is ::1 (write interface=\\:\\:1)")
        return MetricsEndpoint("tcp6", port, "::1")
    try:
        addr = parse_canonical_ipv4(interface, "interface")
    except InvalidArgument as e:
        raise ValueError(e.message) from None
    if not addr.is_loopback:
        raise ValueError(f"interface {addr} is not a loopback address")
    if alias_pool is not None and addr in alias_pool.network:
        raise ValueError(f"interface {addr} is inside the alias pool {alias_pool.network}")
    return MetricsEndpoint("tcp", port, str(ipaddress.IPv4Address(addr)))


def _parse_unix(description: Description) -> MetricsEndpoint:
    args = _arguments(description, "path", {"path", "mode"})
    path = args.get("path", "")
    if not path.startswith("/") or "\x00" in path:
        raise ValueError("the socket path must be absolute")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_SUN_PATH:
        raise ValueError(f"the socket path is longer than {MAX_SUN_PATH} bytes")
    mode_text = args.get("mode", "0600")
    if not re.fullmatch(r"0?[0-7]{3}", mode_text):
        raise ValueError(f"mode {safe_repr(mode_text)} must be octal, e.g. 0600")
    mode = int(mode_text, 8)
    if mode & 0o007:
        raise ValueError(f"mode {mode:04o} gives every local user access; use 0600 or 0660")
    return MetricsEndpoint("unix", path=path, mode=mode)


# -- what is measured ---------------------------------------------------------------------


class MetricsSource(Protocol):
    """A snapshot read at each scrape; both calls must be cheap and synchronous."""

    def forwards(self) -> Iterable[ForwardInfo]: ...
    def bottles(self) -> Iterable[Bottle]: ...
    def transparent(self) -> Iterable[tuple[str, str, int]]: ...
    def vm_uids_left(self) -> int | None: ...


@frozen
class SnapshotSource:
    """A :class:`MetricsSource` from two callables, e.g. ``table.list`` and
    ``registry.list_bottles``."""

    list_forwards: Callable[[], Iterable[ForwardInfo]]
    list_bottles: Callable[[], Iterable[Bottle]] = tuple
    #: (bottle, outcome, connects) of each bottle's transparent egress layer.
    list_transparent: Callable[[], Iterable[tuple[str, str, int]]] = tuple
    count_vm_uids: Callable[[], int | None] = lambda: None

    def forwards(self) -> Iterable[ForwardInfo]:
        return self.list_forwards()

    def bottles(self) -> Iterable[Bottle]:
        return self.list_bottles()

    def transparent(self) -> Iterable[tuple[str, str, int]]:
        return self.list_transparent()

    def vm_uids_left(self) -> int | None:
        return self.count_vm_uids()


def _name(value: object, allowed: frozenset[str] | None) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        return OTHER
    if allowed is not None and value not in allowed:
        return OTHER
    return value


@define
class _Histogram:
    buckets: list[int]
    count: int = 0
    total: float = 0.0


@define
class CallStats:
    """smolvm call counts and durations by subcommand and result (a histogram).

    ``record("create", "ok", 1.7)``. Names outside ``[A-Za-z0-9_.]{1,64}`` (or outside the
    allow-lists, when given) are recorded as ``other``; so are new pairs past ``MAX_SERIES``.
    """

    subcommands: frozenset[str] | None = None
    results: frozenset[str] | None = None
    buckets: tuple[float, ...] = DURATION_BUCKETS
    _series: dict[tuple[str, str], _Histogram] = field(factory=dict, init=False)

    def record(self, subcommand: str, result: str, seconds: float) -> None:
        key = (_name(subcommand, self.subcommands), _name(result, self.results))
        if key not in self._series and len(self._series) >= MAX_SERIES:
            key = (OTHER, OTHER)
        h = self._series.get(key)
        if h is None:
            h = self._series[key] = _Histogram([0] * len(self.buckets))
        seconds = seconds if math.isfinite(seconds) and seconds > 0 else 0.0
        h.count += 1
        h.total += seconds
        for i, bound in enumerate(self.buckets):
            if seconds <= bound:
                h.buckets[i] += 1

    def snapshot(self) -> dict[tuple[str, str], tuple[list[int], int, float]]:
        """``{(subcommand, result): (cumulative bucket counts, count, sum)}``."""
        return {k: (list(h.buckets), h.count, h.total) for k, h in self._series.items()}


@define
class CommandStats:
    """Control commands by name and result code: ``record("CreateBottle", "OK")``."""

    commands: frozenset[str] | None = None
    results: frozenset[str] | None = None
    _counts: dict[tuple[str, str], int] = field(factory=dict, init=False)

    def record(self, command: str, result_code: str) -> None:
        key = (_name(command, self.commands), _name(result_code, self.results))
        if key not in self._counts and len(self._counts) >= MAX_SERIES:
            key = (OTHER, OTHER)
        self._counts[key] = self._counts.get(key, 0) + 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        return dict(self._counts)


# -- the exposition format ----------------------------------------------------------------


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{escape_label_value(v)}"' for k, v in pairs) + "}"


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: Sequence[tuple[str, str]], value: float) -> None:
        self.lines.append(f"{name}{_labels(labels)} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


_RELAY_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("bottlenet_relays_active", "gauge", "Relays open now (ForwardCounters.active)."),
    (
        "bottlenet_relays_accepted_total",
        "counter",
        "Connections accepted on the agent endpoint (ForwardCounters.accepted).",
    ),
    (
        "bottlenet_relays_refused_total",
        "counter",
        "Connections the forward refused (ForwardCounters.refused).",
    ),
    (
        "bottlenet_relays_failed_total",
        "counter",
        "Relays that failed (ForwardCounters.failed).",
    ),
)


def _collect_forwards(
    forwards: Iterable[ForwardInfo],
) -> tuple[dict[tuple[str, str], list[int]], int]:
    totals: dict[tuple[str, str], list[int]] = {}
    invalid = 0
    for info in forwards:
        bottle, label = info.spec.bottle, info.spec.label
        if not (
            isinstance(bottle, str)
            and BOTTLE_NAME_RE.fullmatch(bottle)
            and isinstance(label, str)
            and LABEL_RE.fullmatch(label)
        ):
            invalid += 1
            continue
        c = info.counters
        values = [c.active, c.accepted, c.refused, c.failed, c.bytes_in, c.bytes_out]
        row = totals.setdefault((bottle, label), [0] * 6)
        for i, v in enumerate(values):
            row[i] += int(v)
    return totals, invalid


def _vm_uids(w: _Writer, left: int | None) -> None:
    """The per-VM uids left, once the daemon (as root) has counted them."""
    if left is not None:
        name = "bottlenet_vm_uids_left"
        w.family(name, "gauge", "Per-VM uids the smolvm data dir can still give out (as root).")
        w.sample(name, [], left)


def render_metrics(
    source: MetricsSource,
    smolvm: CallStats | None = None,
    control: CommandStats | None = None,
    refusals: Callable[[], Iterable[tuple[str, str, int]]] | None = None,
) -> str:
    """The whole scrape, in the Prometheus text format 0.0.4."""
    w = _Writer()
    w.family("bottlenet_build_info", "gauge", "Always 1; the version is a label.")
    w.sample("bottlenet_build_info", [("version", _name(__version__, None))], 1)

    forwards, invalid = _collect_forwards(source.forwards())
    keys = sorted(forwards)
    for index, (name, kind, help_text) in enumerate(_RELAY_FAMILIES):
        w.family(name, kind, help_text)
        for bottle, label in keys:
            labels = [("bottle", bottle), ("forward", label)]
            w.sample(name, labels, forwards[(bottle, label)][index])
    w.family(
        "bottlenet_relay_bytes_total",
        "counter",
        "Bytes relayed: direction in = agent to target, out = target to agent.",
    )
    for bottle, label in keys:
        row = forwards[(bottle, label)]
        for direction, value in (("in", row[4]), ("out", row[5])):
            labels = [("bottle", bottle), ("forward", label), ("direction", direction)]
            w.sample("bottlenet_relay_bytes_total", labels, value)

    states: dict[str, int] = {}
    for bottle_info in source.bottles():
        state: str = bottle_info.state
        if not isinstance(state, str) or not STATE_RE.fullmatch(state):
            state = OTHER
        states[state] = states.get(state, 0) + 1
    w.family("bottlenet_bottles", "gauge", "Bottles by state.")
    for state in sorted(states):
        w.sample("bottlenet_bottles", [("state", state)], states[state])

    name = "bottlenet_transparent_connects_total"
    w.family(name, "counter", "Transparent egress connects by bottle and outcome (no targets).")
    for bottle, outcome, n in source.transparent():
        w.sample(name, [("bottle", _name(bottle, None)), ("outcome", _name(outcome, None))], n)

    _vm_uids(w, source.vm_uids_left())
    if smolvm is not None:
        name = "bottlenet_smolvm_call_duration_seconds"
        w.family(name, "histogram", "smolvm CLI calls by subcommand and result, and their time.")
        for (sub, result), (buckets, count, total) in sorted(smolvm.snapshot().items()):
            base = [("subcommand", sub), ("result", result)]
            for bound, n in zip(smolvm.buckets, buckets, strict=True):
                w.sample(f"{name}_bucket", [*base, ("le", _number(float(bound)))], n)
            w.sample(f"{name}_bucket", [*base, ("le", "+Inf")], count)
            w.sample(f"{name}_sum", base, total)
            w.sample(f"{name}_count", base, count)

    if control is not None:
        name = "bottlenet_control_commands_total"
        w.family(name, "counter", "Control-socket commands by name and result code.")
        for (command, result), n in sorted(control.snapshot().items()):
            w.sample(name, [("command", command), ("result", result)], n)

    if refusals is not None:
        name = "bottlenet_connections_refused_total"
        w.family(name, "counter", "Connections refused at accept, by listener and limit.")
        for listener, reason, n in sorted(refusals()):
            labels = [("listener", _name(listener, None)), ("reason", _name(reason, None))]
            w.sample(name, labels, n)

    w.family(
        "bottlenet_metrics_invalid_series",
        "gauge",
        "Series left out of this scrape because a label failed validation (a bug if not 0).",
    )
    w.sample("bottlenet_metrics_invalid_series", [], invalid)
    return w.text()


# -- serving ------------------------------------------------------------------------------


class MetricsResource(Resource):
    """``GET /metrics``: renders a fresh scrape each time."""

    isLeaf = True
    log = Logger()

    def __init__(self, render: Callable[[], str]) -> None:
        super().__init__()
        self._render = render

    def render_GET(self, request: Request) -> bytes:
        try:
            body = self._render()
        except Exception:
            self.log.failure("rendering metrics failed")
            request.setResponseCode(500)
            request.setHeader(b"content-type", b"text/plain; charset=utf-8")
            return b"metrics collection failed\n"
        request.setHeader(b"content-type", CONTENT_TYPE)
        return body.encode("utf-8")


class _Root(Resource):
    """Only ``/metrics`` exists; everything else is a plain 404."""

    def getChild(self, path: bytes, request: IRequest) -> IResource:
        return notFound()


class _QuietSite(Site):
    """No access log: a scrape every few seconds would drown the daemon's own lines."""

    noisy = False

    def log(self, request: http.Request) -> None:
        pass


#: Default cap on concurrent metrics connections, and their HTTP idle timeout (seconds).
DEFAULT_MAX_METRICS_CONNECTIONS = 16
METRICS_IDLE_TIMEOUT = 15


def metrics_site(
    source: MetricsSource,
    reactor: IReactorTime,
    smolvm: CallStats | None = None,
    control: CommandStats | None = None,
    refusals: Callable[[], Iterable[tuple[str, str, int]]] | None = None,
) -> Site:
    """A ``Site`` serving ``/metrics`` (and nothing else)."""
    root = _Root()
    root.putChild(
        b"metrics", MetricsResource(lambda: render_metrics(source, smolvm, control, refusals))
    )
    return _QuietSite(root, reactor=reactor, timeout=METRICS_IDLE_TIMEOUT)


#: Seconds from a request's first byte to its answer: a total deadline, because the idle
#: timeout restarts on every byte (one header byte every few seconds held a slot forever).
METRICS_REQUEST_DEADLINE = 10.0


class _RequestDeadline(ProtocolWrapper):
    """Closes the connection when a request has not been answered within the deadline
    counted from its first byte (a slow sender cannot hold one of the capped slots)."""

    def __init__(self, factory: CappedFactory, wrapped: Any) -> None:
        super().__init__(factory, wrapped)
        self._capped = factory
        self._deadline: IDelayedCall | None = None

    def dataReceived(self, data: bytes) -> None:
        if self._deadline is None:
            self._deadline = self._capped.clock.callLater(METRICS_REQUEST_DEADLINE, self._too_slow)
        super().dataReceived(data)

    def write(self, data: bytes) -> None:
        self._answered()
        super().write(data)

    def writeSequence(self, data: Iterable[bytes]) -> None:
        self._answered()
        super().writeSequence(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._answered()
        super().connectionLost(reason)

    def _answered(self) -> None:
        """The answer started (or the connection ended): the next request's first byte
        starts a new deadline."""
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        self._capped.slow += 1
        self._capped.refused_log.warn(
            ("metrics-deadline",),
            "metrics: closed a connection whose request took over {deadline}s to arrive",
            deadline=METRICS_REQUEST_DEADLINE,
        )
        cast(ITCPTransport, self.transport).abortConnection()


class CappedFactory(WrappingFactory[_RequestDeadline]):
    """At most ``limit`` connections at once; more are closed at accept, counted, logged
    rate-limited. (Any local user can reach a TCP metrics port: this keeps it from
    exhausting the daemon's fds.) Each request must arrive within
    :data:`METRICS_REQUEST_DEADLINE` of its first byte."""

    log = Logger()
    noisy = False
    protocol = _RequestDeadline

    def __init__(self, wrapped: Site, limit: int, clock: IReactorTime) -> None:
        super().__init__(wrapped)
        self.limit = limit
        self.clock = clock
        self.refused = 0
        #: Connections closed by the request deadline.
        self.slow = 0
        self.refused_log = RateLimitedLogger(self.log, clock, interval=10.0)

    def buildProtocol(self, addr: IAddress | None) -> ProtocolWrapper | None:  # type: ignore[override]
        if len(self.protocols) >= self.limit:
            self.refused += 1
            self.refused_log.warn(
                ("metrics-cap",),
                "metrics: refused a connection: {limit} connections are open",
                limit=self.limit,
            )
            return None
        return super().buildProtocol(addr)
