"""The daemon's settings: its options, checked into one frozen value before anything is built.

:class:`Options` parses the command line; the numeric flags are checked by their coerce
functions while it parses. :func:`settings_from` checks everything else (the alias pool, the
config file, ``--metrics``, the TLS options, the launch gate's targets, ``--control``,
``--smolvm``) and returns one :class:`DaemonSettings`. Every problem is a
:class:`StartupError`: one line on stderr (``bottlenet: error: ...``), exit status 1, no
traceback. Nothing here binds, locks or writes; :mod:`bottlenet.tap` does that, then builds.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import sysconfig
from collections.abc import Callable, Mapping
from functools import wraps
from typing import Any, TypeVar

from attrs import frozen
from twisted.logger import Logger, LogLevel
from twisted.python import usage

from bottlenet import __version__
from bottlenet.bottles.config import ConfigError, DaemonConfig, load_config
from bottlenet.bottles.probe import GateSettings
from bottlenet.bottles.registry import DEFAULT_MAX_BOTTLES
from bottlenet.control.endpoints import (
    ControlListenError,
    SystemdDescription,
    UNIXDescription,
    inherited_socket_path,
    parse_control_description,
)
from bottlenet.control.peercred import default_allowed_uids
from bottlenet.control.server import DEFAULT_MAX_CONTROL_CONNECTIONS, MAX_CONTROL_CONNECTIONS
from bottlenet.errors import BottlenetError
from bottlenet.forward import fastreactor
from bottlenet.forward.budget import DEFAULT_IDLE_TIMEOUT, DEFAULT_PER_BOTTLE, reserved_fds
from bottlenet.forward.spec import DEFAULT_POOL, AliasPool
from bottlenet.forward.splice import check_engine
from bottlenet.node.info import check_labels, parse_label
from bottlenet.node.lease import DEFAULT_GRACE
from bottlenet.ops import logs, metrics
from bottlenet.paths import MAX_SUN_PATH, default_control_endpoint, default_state_dir
from bottlenet.probe.plan import DEFAULT_DNS_NAME, DEFAULT_OUTSIDE, Target, check_dns_name
from vmctl.service import SmolvmChoice, StartupRefused, choose_smolvm
from vmctl.uidranges import DEFAULT_LEDGER

T = TypeVar("T")
log = Logger()


class StartupError(SystemExit):
    """A setting the daemon must not start with: one line on stderr, exit status 1.

    A ``SystemExit`` so that the runner (twist, twistd) prints exactly ``bottlenet: error:
    MESSAGE`` and no traceback; ``message`` is the line without its prefix.
    """

    def __init__(self, message: str) -> None:
        super().__init__(f"bottlenet: error: {message}")
        self.message = message


def bounded_int(lo: int, hi: int, noun: str = "an integer") -> Callable[[str], int]:
    """An option coerce function: decimal digits naming an integer in ``[lo, hi]``."""

    def coerce(value: str) -> int:
        try:
            number = int(value) if value.isdigit() else None  # no sign, space or underscore
        except ValueError:  # a digit int() does not read ("²")
            number = None
        if number is None or not lo <= number <= hi:
            raise ValueError(f"must be {noun} {lo}-{hi}")
        return number

    coerce.coerceDoc = f"{noun[0].upper()}{noun[1:]} {lo}-{hi}."  # type: ignore[attr-defined]
    return coerce


def bounded_seconds(hi: int, *, zero_is_off: bool) -> Callable[[str], float]:
    """An option coerce function: seconds in ``(0, hi]``, or ``[0, hi]`` where 0 turns it off."""
    text = f"0-{hi} (0: off)" if zero_is_off else f"in (0, {hi}]"

    def coerce(value: str) -> float:
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if not (0 <= seconds if zero_is_off else 0 < seconds) or not seconds <= hi:
            raise ValueError(f"must be a number of seconds {text}")  # NaN too
        return seconds

    coerce.coerceDoc = f"Seconds {text}."  # type: ignore[attr-defined]
    return coerce


def relay_engine(value: str) -> str:
    """An option coerce function: a relay engine this host runs."""
    return check_engine(value)


relay_engine.coerceDoc = "auto, splice or portable."  # type: ignore[attr-defined]


def _flagged(name: str, coerce: Callable[[str], T]) -> Callable[[str], T]:
    """``coerce`` whose ValueError ends the process as ``bottlenet: error: --NAME: why``.

    Twisted would turn it into a usage error (exit status 64 and the whole help text); the
    daemon's contract for a bad value is one line and status 1, as for every other check.
    """

    @wraps(coerce)  # keeps coerceDoc for --help
    def checked(value: str) -> T:
        try:
            return coerce(value)
        except ValueError as e:
            raise StartupError(f"--{name}: {e}") from None

    return checked


def _coerced(rows: list[list[Any]]) -> list[list[Any]]:
    """``optParameters`` rows with each coerce function bound to its flag's name."""
    return [[*row[:4], _flagged(row[0], row[4])] if len(row) == 5 else row for row in rows]


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "Run the bottlenet host daemon: it binds each bottle's agent endpoints and relays "
        "their bytes to the sidecar's services (its exposed UNIX sockets; raw TCP ports only "
        "where a spec opts in)."
    )
    # Defaults are written as a user would type them (README's table quotes them); the
    # numeric ones are coerced once in postOptions, given values while they are parsed.
    optParameters = _coerced(
        [
            ["state-dir", None, None, "State directory (default: $XDG_STATE_HOME/bottlenet)."],
            ["config", None, None, "TOML file declaring forward-only bottles."],
            ["alias-pool", None, DEFAULT_POOL, "Loopback network that bottle aliases come from."],
            [
                "connect-timeout",
                None,
                "10",
                "Seconds to wait for a forward's target to accept.",
                bounded_seconds(600, zero_is_off=False),
            ],
            [
                "sidecar-ready-timeout",
                None,
                "60",
                "Seconds a new sidecar's services get to answer on their sockets "
                "(SIDECAR_NOT_READY after).",
                bounded_seconds(600, zero_is_off=False),
            ],
            [
                "control",
                None,
                None,
                "Control socket endpoint: unix:PATH, an absolute PATH or "
                "systemd:domain=UNIX:name=NAME "
                "(default: unix:$XDG_RUNTIME_DIR/bottlenet/control.sock).",
            ],
            [
                "control-max-connections",
                None,
                str(DEFAULT_MAX_CONTROL_CONNECTIONS),
                "Most connections each control listener holds at once (an exec session or a "
                "watcher holds one for as long as it runs).",
                bounded_int(1, MAX_CONTROL_CONNECTIONS),
            ],
            [
                "control-tls-port",
                None,
                None,
                "Also serve control over TLS on this TCP port.",
                bounded_int(1, 65535, "a port"),
            ],
            ["control-tls-interface", None, None, "Address the TLS control listener binds."],
            ["control-tls-key", None, None, "PEM private key of the TLS control listener."],
            ["control-tls-cert", None, None, "PEM certificate of the TLS control listener."],
            ["control-tls-ca", None, None, "PEM CA that signs accepted client certificates."],
            [
                "smolvm",
                None,
                None,
                "Path to the smolvm binary (default: smolvm on PATH, else the one of the "
                "bottlenet[vm] extra).",
            ],
            [
                "smolvm-data-dir",
                None,
                None,
                "smolvm's own state directory (default: <state-dir>/smolvm), passed as "
                "--state-dir (as SMOLVM_DATA_DIR to a smolvm without it).",
            ],
            [
                "uid-ledger",
                None,
                DEFAULT_LEDGER,
                "As root: the host's record of which smolvm data dir owns which per-VM uids "
                "(every daemon on a host must share it).",
            ],
            [
                "guest-kit",
                None,
                "auto",
                "bottlenet's guest kit: auto (built at start, cached in <state-dir>/kit), off "
                "(the images' python3 and /bin/sh run bottlenet's guest commands), or a "
                "directory to cache it in instead.",
            ],
            [
                "log-format",
                None,
                None,
                "json (one object per line) or text (default: the runner's).",
            ],
            [
                "relay-engine",
                None,
                "auto",
                "How relays move bytes: auto (splice where supported), splice or portable.",
                relay_engine,
            ],
            [
                "metrics",
                None,
                None,
                "Where Prometheus /metrics is served: unix:PATH, or "
                "tcp:PORT:interface=127.x.y.z (any local user can read a TCP port), or none "
                "(default: unix:STATE-DIR/metrics.sock).",
            ],
            [
                "metrics-max-connections",
                None,
                str(metrics.DEFAULT_MAX_METRICS_CONNECTIONS),
                "Most /metrics connections open at once.",
                bounded_int(1, 1024),
            ],
            [
                "max-bottles",
                None,
                str(DEFAULT_MAX_BOTTLES),
                "Most bottles the daemon holds at once.",
                bounded_int(1, 65536),
            ],
            [
                "lease-grace",
                None,
                f"{DEFAULT_GRACE:g}",
                "Seconds a bottle whose lease ran out is kept before the daemon destroys it "
                "(its owner may still renew it).",
                bounded_seconds(86400, zero_is_off=True),
            ],
            [
                "max-bottle-connections",
                None,
                str(DEFAULT_PER_BOTTLE),
                "Most relayed connections one bottle holds at once (all its forwards together).",
                bounded_int(1, 1 << 20),
            ],
            [
                "max-connections",
                None,
                None,
                "Most relayed connections in the daemon (default: from the open-files limit, "
                "keeping room for the control socket); each bottle keeps a fair share of it.",
                bounded_int(1, 1 << 20),
            ],
            [
                "idle-timeout",
                None,
                f"{DEFAULT_IDLE_TIMEOUT:g}",
                "Close a relayed connection after this many seconds without a byte either way "
                "(0: never).",
                bounded_seconds(7 * 86400, zero_is_off=True),
            ],
            [
                "gate-outside",
                None,
                DEFAULT_OUTSIDE,
                "An IP:PORT outside the host that the launch gate requires unreachable from a "
                "guest (by TCP, UDP and ICMP).",
            ],
            [
                "gate-dns-name",
                None,
                DEFAULT_DNS_NAME,
                "A DNS name the launch gate requires not to resolve inside a guest.",
            ],
        ]
    )
    optFlags = [
        [
            "unsafe-skip-isolation-probe",
            None,
            "Do not run the isolation probe before an agent's workload starts (UNSAFE; "
            "every bottle created so says so in its status).",
        ],
    ]

    def __init__(self) -> None:
        super().__init__()
        self["allow-uid"] = []
        self["label"] = []
        self["scoped-uid"] = []
        self["volume-root"] = []

    def opt_volume_root(self, value: str) -> None:
        """A directory under which scoped peers' read-write volumes and TLS launchers'
        volumes may lie (repeatable; none by default: such volumes are refused)."""
        self["volume-root"].append(value)

    def opt_label(self, value: str) -> None:
        """A label of this node, KEY=VALUE, reported by NodeInfo (repeatable)."""
        try:
            parse_label(value)
        except BottlenetError as e:
            raise usage.UsageError(f"--label: {e.message}") from None
        self["label"].append(value)

    def parseOptions(self, options: list[str] | None = None) -> None:
        """Parse; a usage error (an unknown option, a bad ``--allow-uid`` or ``--log-format``)
        is one line and status 1 like every other bad value, not Twisted's whole help text."""
        try:
            super().parseOptions(options)
        except usage.UsageError as e:
            raise StartupError(f"{e} (see --help)") from None

    def opt_allow_uid(self, value: str) -> None:
        """Also accept control connections from this uid (repeatable); UID:scoped lets it
        act only on the bottles whose capability a call presents (docs/protocol.md)."""
        uid, sep, scope = value.partition(":")
        if not uid.isdigit() or int(uid) > 2**32 - 2:
            raise usage.UsageError(f"--allow-uid: {uid!r} is not a uid")
        if sep and scope != "scoped":
            raise usage.UsageError(f"--allow-uid: {value!r}: UID or UID:scoped")
        self["scoped-uid" if sep else "allow-uid"].append(int(uid))

    def postOptions(self) -> None:
        for name, _, default, _, *coerce in self.optParameters:
            if coerce and self[name] is default and default is not None:
                self[name] = coerce[0](default)  # a default as typed: the same value out
        if self.parent is not None:
            # Under twist/twistd: unless --reactor chose one, run on the epoll reactor without
            # a log context per event (the relays' fast path; docs/performance.md). The runner
            # installs its default reactor only after this, so the fast one is the default.
            fastreactor.install_unless_chosen()
        # twist/twistd read their log settings after the plugin's options: choose ours now.
        logs.install_log_format(self.parent, self["log-format"])

    def opt_version(self) -> None:
        """Print the version and exit."""
        print(f"bottlenet {__version__}")
        sys.exit(0)


@frozen
class TLSSettings:
    """All five ``--control-tls-*`` options, checked."""

    port: int
    interface: str
    key: str
    cert: str
    ca: str


@frozen
class RelayBudgets:
    """``--max-bottle-connections``, ``--max-connections``, ``--idle-timeout``, and the fds
    kept out of the relay budget for the control listeners."""

    per_bottle_connections: int
    max_connections: int | None
    idle_timeout: float
    reserved_fds: int


@frozen
class DaemonSettings:
    """Every option and the config file, checked: what :func:`compose` builds the daemon from."""

    state_dir: str
    pool: AliasPool
    config: DaemonConfig
    config_path: str
    connect_timeout: float
    #: Seconds a new sidecar's services get to answer (``bottles/readiness.py``).
    sidecar_ready_timeout: float
    relay_engine: str
    budgets: RelayBudgets
    max_bottles: int
    control: str
    #: The control socket's path (None for systemd): no forward may target it.
    control_path: str | None
    control_cap: int
    allowed_uids: frozenset[int]
    tls: TLSSettings | None
    metrics: metrics.MetricsEndpoint | None
    metrics_cap: int
    gate: GateSettings
    skip_probe: bool
    smolvm: SmolvmChoice
    #: Every path the daemon reads or serves: no agent volume may be, hold or lie inside one.
    protected_paths: tuple[str, ...]
    log_relay_ends: bool
    #: ``--label KEY=VALUE``s, sorted by key (NodeInfo).
    labels: tuple[tuple[str, str], ...] = ()
    #: ``--lease-grace``: seconds between a lease running out and its bottle's reap.
    lease_grace: float = DEFAULT_GRACE
    #: ``--allow-uid UID:scoped``: peers that act only on the bottles whose capability a call
    #: presents (``control/scope.py``).
    scoped_uids: frozenset[int] = frozenset()
    #: ``--volume-root``: where scoped peers' rw volumes and TLS launchers' volumes may lie.
    volume_roots: tuple[str, ...] = ()
    #: ``--guest-kit``: where the guest kit is cached (None: off).
    kit_dir: str | None = None


def settings_from(options: Options, environ: Mapping[str, str] | None = None) -> DaemonSettings:
    """Check every option and the config file; one frozen value out, or a StartupError.

    Touches nothing on disk but reads: the config file, and ``--smolvm``'s ``--version``.
    """
    env = os.environ if environ is None else environ
    try:
        pool = AliasPool.parse(options["alias-pool"])
    except BottlenetError as e:
        raise StartupError(f"--alias-pool: {e.message}") from None
    state_dir = options["state-dir"] or default_state_dir(env)
    config, config_path = DaemonConfig(()), options["config"]
    if config_path is not None:
        try:
            config = load_config(config_path, pool, state_dir)
        except ConfigError as e:
            raise StartupError(str(e)) from None
    metrics_spec = _metrics_option(options, pool, state_dir)
    tls = _tls_options(options, pool)
    control = options["control"] or default_control_endpoint(env, state_dir)
    try:  # a bad --control stops the daemon here, before any listener is bound
        parse_control_description(control)
    except ControlListenError as e:
        raise StartupError(str(e)) from None
    try:
        smolvm = choose_smolvm(
            options["smolvm"],
            options["smolvm-data-dir"],
            environ=env,
            default_data_dir=os.path.join(state_dir, "smolvm"),
            uid_ledger=options["uid-ledger"],
        )
    except StartupRefused as e:
        raise StartupError(e.message) from None
    control_cap = options["control-max-connections"]
    scoped = frozenset(options["scoped-uid"])
    both = scoped & default_allowed_uids(options["allow-uid"])
    if both:
        raise StartupError(
            f"--allow-uid: uid {min(both)} is given both scoped and with full control (the "
            "daemon's own uid always has full control)"
        )
    try:
        labels = check_labels(options["label"])
    except BottlenetError as e:
        raise StartupError(f"--label: {e.message}") from None
    return DaemonSettings(
        state_dir=state_dir,
        pool=pool,
        config=config,
        config_path=config_path or "",
        connect_timeout=options["connect-timeout"],
        sidecar_ready_timeout=options["sidecar-ready-timeout"],
        relay_engine=options["relay-engine"],
        budgets=RelayBudgets(
            options["max-bottle-connections"],
            options["max-connections"],
            options["idle-timeout"],
            # the TLS listener has a cap of its own: keep room for both
            reserved_fds(control_cap * (2 if tls is not None else 1)),
        ),
        max_bottles=options["max-bottles"],
        control=control,
        control_path=_unix_path(control),
        control_cap=control_cap,
        allowed_uids=default_allowed_uids(options["allow-uid"]),
        tls=tls,
        metrics=metrics_spec,
        metrics_cap=options["metrics-max-connections"],
        gate=_gate_settings(options, tls, metrics_spec),
        skip_probe=options["unsafe-skip-isolation-probe"],
        smolvm=smolvm,
        protected_paths=_own_paths(state_dir, control, smolvm, tls, metrics_spec, config_path, env),
        log_relay_ends=logs_relay_ends(options.parent),
        labels=labels,
        lease_grace=options["lease-grace"],
        scoped_uids=scoped,
        volume_roots=_volume_roots(options["volume-root"]),
        kit_dir=_kit_dir(options["guest-kit"], state_dir),
    )


def _kit_dir(value: str, state_dir: str) -> str | None:
    """``--guest-kit``: ``auto`` is the state directory's, ``off`` none, else an absolute
    directory (its ``kit/`` folder holds the kits)."""
    if value == "off":
        return None
    if value == "auto":
        return state_dir
    if not os.path.isabs(value):
        raise StartupError("--guest-kit: use auto, off or an absolute directory")
    return value


def _metrics_option(
    options: Options, pool: AliasPool, state_dir: str
) -> metrics.MetricsEndpoint | None:
    """``--metrics``: by default a 0600 UNIX socket in the private state dir; TCP only when
    asked for (it is open to every local user); ``none`` serves nothing."""
    text = options["metrics"]
    if text == "none":
        return None
    if text is None:
        path = os.path.join(os.path.abspath(state_dir), "metrics.sock")
        if len(path.encode("utf-8", "surrogateescape")) > MAX_SUN_PATH:
            log.warn("no /metrics: {path} is too long for a UNIX socket; use --metrics", path=path)
            return None
        return metrics.MetricsEndpoint("unix", path=path, mode=0o600)
    try:
        return metrics.parse_metrics_endpoint(text, pool)
    except BottlenetError as e:
        raise StartupError(f"--metrics: {e.message}") from None


#: What systemd tells a unit about its own directories (each may list several, ``:``-separated).
SYSTEMD_DIRS = (
    "RUNTIME_DIRECTORY",
    "STATE_DIRECTORY",
    "CACHE_DIRECTORY",
    "LOGS_DIRECTORY",
    "CONFIGURATION_DIRECTORY",
    "CREDENTIALS_DIRECTORY",
)


def _own_paths(
    state_dir: str,
    control: str,
    smolvm: SmolvmChoice,
    tls: TLSSettings | None,
    metrics_spec: metrics.MetricsEndpoint | None,
    config_path: str | None,
    environ: Mapping[str, str],
) -> tuple[str, ...]:
    """Every path the daemon reads or serves: its state, smolvm's data and the uid ledger
    (``--uid-ledger``: a VM that could write it would hand uids around), the control socket's
    directory (a ``systemd:`` one's from the inherited descriptor, and the unit's own
    directories systemd names), the metrics socket's, the TLS key, certificate and CA, the
    config file, smolvm's binary and libraries, and its own install (the ``bottlenet`` and
    ``vmctl`` packages, the interpreter's library and site directories, the venv). No agent
    volume may be, hold or lie inside one (``bottles/volumes.py``)."""
    paths = [state_dir]
    try:
        described = parse_control_description(control)
    except ControlListenError:
        described = None
    if isinstance(described, UNIXDescription):
        paths.append(os.path.dirname(os.path.abspath(described.path)))
    elif isinstance(described, SystemdDescription):
        found = inherited_socket_path(described)
        if found is not None:
            paths.append(os.path.dirname(found))
    for name in SYSTEMD_DIRS:
        paths.extend(p for p in environ.get(name, "").split(":") if os.path.isabs(p))
    if smolvm.data_dir:
        paths.append(smolvm.data_dir)
    paths.append(smolvm.uid_ledger)
    if smolvm.install is not None:
        paths.extend(
            p
            for p in (smolvm.install.binary, smolvm.install.lib_dir, smolvm.install.agent_rootfs)
            if p
        )
    if metrics_spec is not None and metrics_spec.kind == "unix" and metrics_spec.path:
        paths.append(os.path.dirname(os.path.abspath(metrics_spec.path)))
    if tls is not None:
        paths.extend((tls.key, tls.cert, tls.ca))
    if config_path:
        paths.append(config_path)
    paths.extend(install_paths())
    return tuple(dict.fromkeys(os.path.realpath(p) for p in paths))


def install_paths() -> tuple[str, ...]:
    """Where the daemon's own code lives: its packages (an editable install's checkout
    included), the interpreter's library and site directories, and the venv."""
    import bottlenet
    import vmctl

    found = []
    for package in (bottlenet, vmctl):
        where = os.path.dirname(os.path.abspath(package.__file__ or ""))
        found += [where, os.path.dirname(where)]
    found += [p for k, p in sysconfig.get_paths().items() if k in _CODE_PATHS]
    if sys.prefix != sys.base_prefix:
        found.append(sys.prefix)
    return tuple(found)


_CODE_PATHS = ("stdlib", "platstdlib", "purelib", "platlib", "scripts")


def _volume_roots(given: list[str]) -> tuple[str, ...]:
    """``--volume-root``s: absolute existing directories (their real paths)."""
    roots = []
    for root in given:
        if not os.path.isabs(root) or not os.path.isdir(root):
            raise StartupError(f"--volume-root: {root} is not an absolute existing directory")
        roots.append(os.path.realpath(root))
    return tuple(dict.fromkeys(roots))


def _unix_path(control: str) -> str | None:
    """The control socket's path for ``--control unix:...`` (None for systemd or a bad value)."""
    try:
        described = parse_control_description(control)
    except ControlListenError:
        return None  # ControlService reports it at start
    return described.path if isinstance(described, UNIXDescription) else None


def logs_relay_ends(runner_options: Any) -> bool:
    """Whether the daemon logs a line (debug) for every cleanly ended relay.

    Only under ``twist --log-level debug``: at any other level the event would be built and
    dropped for every connection (a measurable share of a short connection's cost, see
    docs/performance.md). Failed relays are always logged; counters count every relay.
    """
    if runner_options is None or "fileLogObserverFactory" not in runner_options:
        return False
    return runner_options.get("logLevel") is LogLevel.debug


def _gate_settings(
    options: Options, tls: TLSSettings | None, metrics_spec: metrics.MetricsEndpoint | None
) -> GateSettings:
    """The gate's stand-in-able targets, plus the daemon's own TCP services to find closed."""
    try:
        outside = Target.parse(f"tcp:{options['gate-outside']}")
        dns_name = check_dns_name(options["gate-dns-name"])
    except BottlenetError as e:
        raise StartupError(f"--gate-outside/--gate-dns-name: {e.message}") from None
    ports = []
    if tls is not None:
        ports.append(tls.port)
    if metrics_spec is not None and metrics_spec.kind != "unix" and metrics_spec.port:
        ports.append(metrics_spec.port)
    return GateSettings(outside=str(outside)[4:], dns_name=dns_name, host_ports=tuple(ports))


def _tls_options(options: Options, pool: AliasPool) -> TLSSettings | None:
    """All five --control-tls-* options, or none of them.

    The interface is one IP address, never a wildcard (it would listen on every address,
    the bottles' aliases included) nor an address of the alias pool (an alias-mode guest
    reaches every port of its own alias).
    """
    names = ["port", "interface", "key", "cert", "ca"]  # the port is checked by its coerce
    values = {n: options[f"control-tls-{n}"] for n in names}
    given = [n for n in names if values[n] is not None]
    if not given:
        return None
    missing = [f"--control-tls-{n}" for n in names if values[n] is None]
    if missing:
        raise StartupError(f"--control-tls-{given[0]} also needs {', '.join(missing)}")
    try:
        interface = ipaddress.ip_address(values["interface"])
    except ValueError:
        raise StartupError("--control-tls-interface: must be one IP address") from None
    mapped = getattr(interface, "ipv4_mapped", None) or interface
    if interface.is_unspecified:
        raise StartupError("--control-tls-interface: a wildcard listens on every address; name one")
    if isinstance(mapped, ipaddress.IPv4Address) and mapped in pool.network:
        raise StartupError(
            f"--control-tls-interface: {interface} is inside the alias pool {pool.network}"
        )
    for n in ("key", "cert", "ca"):
        if not os.path.isfile(values[n]):
            raise StartupError(f"--control-tls-{n}: {values[n]} is not a readable file")
    return TLSSettings(
        values["port"], values["interface"], values["key"], values["cert"], values["ca"]
    )
