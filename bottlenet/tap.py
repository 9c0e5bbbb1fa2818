"""``twistd bottlenet`` / ``twist bottlenet``: options and the service tree.

Everything that can be checked before the reactor runs (options, the config file, the state
directory) is checked in :func:`makeService`; a problem there ends the process with one line
on stderr and a non-zero exit, before anything is bound.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred, gatherResults, succeed
from twisted.internet.interfaces import IProtocolFactory
from twisted.logger import Logger, LogLevel
from twisted.python import usage
from twisted.python.systemd import ListenFDs

from bottlenet import __version__
from bottlenet.bottles.config import ConfigError, DaemonConfig, load_config
from bottlenet.bottles.lifecycle import VMLifecycle, VMOptions
from bottlenet.bottles.model import SOURCE_CONFIG
from bottlenet.bottles.probe import GateSettings
from bottlenet.bottles.recovery import Recovery, RecoveryService
from bottlenet.bottles.registry import DEFAULT_MAX_BOTTLES, BottleRegistry
from bottlenet.bottles.store import StateError, StateStore
from bottlenet.control.commands import ALL_COMMANDS, CONTROL_ERRORS
from bottlenet.control.endpoints import control_endpoint, tls_control_endpoint
from bottlenet.control.events import EventHub
from bottlenet.control.peercred import default_allowed_uids
from bottlenet.control.server import ControlServerFactory
from bottlenet.errors import BottlenetError
from bottlenet.forward import fastreactor
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import DEFAULT_POOL, AliasPool
from bottlenet.forward.table import ForwardTable
from bottlenet.ops import logs, metrics, rlimits, sdnotify
from bottlenet.ops.fatal import fatal_stop, fatal_stopper
from bottlenet.ops.listening import ListeningService
from bottlenet.paths import (
    PrivateDirError,
    default_control_endpoint,
    default_state_dir,
    ensure_private_dir,
)
from bottlenet.probe.plan import DEFAULT_DNS_NAME, DEFAULT_OUTSIDE, Target, check_dns_name
from vmctl import errors as vmctl_errors
from vmctl.errors import VmctlError
from vmctl.service import make_smolvm
from vmctl.smolvm import CANCELLED, INTERNAL, SUBCOMMANDS, Smolvm


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "Run the bottlenet host daemon: it binds each bottle's agent endpoints and relays "
        "their bytes to the sidecar's raw ports."
    )
    optParameters = [
        ["state-dir", None, None, "State directory (default: $XDG_STATE_HOME/bottlenet)."],
        ["config", None, None, "TOML file declaring forward-only bottles."],
        ["alias-pool", None, DEFAULT_POOL, "Loopback network that bottle aliases come from."],
        ["connect-timeout", None, "10", "Seconds to wait for a forward's target to accept."],
        [
            "control",
            None,
            None,
            "Control socket endpoint: unix:PATH or systemd:domain=UNIX:name=NAME "
            "(default: unix:$XDG_RUNTIME_DIR/bottlenet/control.sock).",
        ],
        ["control-tls-port", None, None, "Also serve control over TLS on this TCP port."],
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
        ["log-format", None, None, "json (one object per line) or text (default: the runner's)."],
        [
            "relay-engine",
            None,
            "auto",
            "How relays move bytes: auto (splice where supported), splice or portable.",
        ],
        ["metrics", None, None, "Serve Prometheus /metrics on a loopback endpoint."],
        ["max-bottles", None, str(DEFAULT_MAX_BOTTLES), "Most bottles the daemon holds at once."],
        [
            "gate-outside",
            None,
            DEFAULT_OUTSIDE,
            "An IP:PORT outside the host that the launch gate requires unreachable from a "
            "guest (by TCP and ICMP).",
        ],
        [
            "gate-dns-name",
            None,
            DEFAULT_DNS_NAME,
            "A DNS name the launch gate requires not to resolve inside a guest.",
        ],
    ]
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

    def opt_allow_uid(self, value: str) -> None:
        """Also accept control connections from this uid (repeatable)."""
        if not value.isdigit() or int(value) > 2**32 - 2:
            raise usage.UsageError(f"--allow-uid: {value!r} is not a uid")
        self["allow-uid"].append(int(value))

    def postOptions(self) -> None:
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


def _fail(message: str) -> SystemExit:
    """One clear line on stderr, exit status 1, no traceback."""
    return SystemExit(f"bottlenet: error: {message}")


class ConfigBottles(Service):
    """Creates the config file's bottles and binds their forwards when the daemon starts.

    If any bind fails, everything bound so far is removed again and the daemon exits
    non-zero: it never runs with half of its configuration.
    """

    log = Logger()

    def __init__(self, reactor: Any, registry: BottleRegistry, config: DaemonConfig, path: str):
        self._reactor = reactor
        self._registry = registry
        self._config = config
        self._path = path
        self.ready: Deferred[None] = Deferred()

    def startService(self) -> None:
        super().startService()
        d = Deferred.fromCoroutine(self._bind_all())
        d.addCallbacks(self.ready.callback, self._failed)

    async def _bind_all(self) -> None:
        for i, bottle in enumerate(self._config.bottles):
            await self._registry.create_bottle(bottle.name, bottle.alias, source=SOURCE_CONFIG)
            for j, fwd in enumerate(bottle.forwards):
                key = f"bottle[{i}].forward[{j}]"
                try:
                    # The forward table logs "forward B/L listening on ..." itself.
                    await self._registry.add_forward(
                        bottle.name,
                        fwd.label,
                        fwd.target,
                        fwd.port,
                        max_connections=fwd.max_connections,
                    )
                except BottlenetError as e:
                    raise ConfigError(f"{self._path}: {key}: {e.message}") from None

    async def _rollback(self) -> None:
        for bottle in self._config.bottles:
            try:
                await self._registry.destroy_bottle(bottle.name)
            except BottlenetError:
                pass

    def _failed(self, failure: Any) -> None:
        if failure.check(ConfigError, BottlenetError):
            message = str(failure.value)
        else:
            self.log.failure("unexpected error while binding the configured forwards", failure)
            message = "unexpected error while binding the configured forwards"
        d = Deferred.fromCoroutine(self._rollback())
        d.addBoth(lambda _: fatal_stop(self._reactor, message))
        self.ready.errback(failure)
        self.ready.addErrback(lambda _: None)


class BottlenetService(MultiService):
    """The daemon's root service; keeps handles on the parts tests and later layers need."""

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        table: ForwardTable,
        registry: BottleRegistry,
        smolvm: Smolvm,
        factory: ControlServerFactory,
        state_dir: str,
        smolvm_calls: metrics.CallStats | None = None,
        control_commands: metrics.CommandStats | None = None,
    ) -> None:
        super().__init__()
        self.reactor = reactor
        self.table = table
        self.registry = registry
        self.smolvm = smolvm
        self.control_factory = factory
        #: Every control factory (UNIX and TLS): each answers Hello with the smolvm version.
        self.control_factories = [factory]
        self.state_dir = state_dir
        self.smolvm_calls = smolvm_calls or metrics.CallStats()
        self.control_commands = control_commands or metrics.CommandStats()

    def startService(self) -> None:
        old, new = rlimits.raise_nofile(rlimits.select_reactor_cap(self.reactor))
        self.log.info("open files limit {old} -> {new}", old=old, new=new)
        self.log.info(
            "relay engine {engine}, reactor {reactor}",
            engine=self.table.engine,
            reactor=type(self.reactor).__qualname__,
        )
        super().startService()
        for factory in self.control_factories:
            factory.smolvm_source = self.smolvm.describe()
        if self.smolvm.binary is not None:
            Deferred.fromCoroutine(self._probe_smolvm())

    async def _probe_smolvm(self) -> None:
        """Learn the smolvm version once, for Hello and to refuse an unsupported one early."""
        try:
            version = await self.smolvm.version()
        except VmctlError as e:
            self.log.warn("smolvm is unusable: {code}: {why}", code=e.code, why=str(e))
            return
        for factory in self.control_factories:
            factory.smolvm_version = str(version)
            factory.smolvm_available = version.supported
            factory.smolvm_source = self.smolvm.describe()
        self.log.info("using {smolvm}", smolvm=self.smolvm.describe())


def build_service(options: Options, reactor: Any) -> BottlenetService:
    """Check everything that can be checked up front, then build the service tree."""
    try:
        pool = AliasPool.parse(options["alias-pool"])
    except BottlenetError as e:
        raise _fail(f"--alias-pool: {e.message}") from None
    try:
        connect_timeout = float(options["connect-timeout"])
        if not 0 < connect_timeout <= 600:
            raise ValueError
    except ValueError:
        raise _fail("--connect-timeout: must be a number of seconds in (0, 600]") from None
    state_dir = options["state-dir"] or default_state_dir(os.environ)
    try:
        ensure_private_dir(state_dir, too_open="fix")
    except PrivateDirError as e:
        raise _fail(f"--state-dir: {e.message}") from None
    config = DaemonConfig(())
    config_path = options["config"]
    if config_path is not None:
        try:
            config = load_config(config_path, pool, state_dir)
        except ConfigError as e:
            raise _fail(str(e)) from None
    metrics_spec = None
    if options["metrics"] is not None:
        try:
            metrics_spec = metrics.parse_metrics_endpoint(options["metrics"], pool)
        except BottlenetError as e:
            raise _fail(f"--metrics: {e.message}") from None
    tls = _tls_options(options)
    gate = _gate_settings(options, tls, metrics_spec)
    max_bottles = options["max-bottles"]
    if not str(max_bottles).isdigit() or not 1 <= int(max_bottles) <= 65536:
        raise _fail("--max-bottles: must be an integer 1-65536")
    store = StateStore(state_dir)
    try:
        state = store.load()
        if not os.path.exists(store.path):
            store.save(state)  # the instance id (our owner label) must outlive a crash
    except StateError as e:
        raise _fail(e.message) from None
    except OSError as e:
        raise _fail(f"{store.path}: {e.strerror}") from None

    on_fatal = fatal_stopper(reactor)

    # Recorded whether or not --metrics is given (cheap), so the root service always has them.
    smolvm_calls, control_commands = _recorders()
    vmctl_service, smolvm = make_smolvm(
        reactor,
        options["smolvm"],
        options["smolvm-data-dir"],
        on_call=smolvm_calls.record,
        default_data_dir=os.path.join(state_dir, "smolvm"),
    )
    aliases = AliasRegistry(pool)
    try:
        table = ForwardTable(
            reactor,
            aliases,
            state_dir=state_dir,
            connect_timeout=connect_timeout,
            engine=options["relay-engine"],
        )
    except ValueError as e:
        raise _fail(f"--relay-engine: {e}") from None
    table.log_clean_relay_ends = logs_relay_ends(options.parent)
    vm_options = VMOptions(
        instance_id=state.instance_id,
        gate=gate,
        skip_probe=options["unsafe-skip-isolation-probe"],
    )
    if vm_options.skip_probe:
        BottlenetService.log.warn(
            "--unsafe-skip-isolation-probe: agent VMs start WITHOUT the isolation launch gate"
        )
    vms = VMLifecycle(reactor, smolvm, table, aliases, state_dir=state_dir, options=vm_options)
    registry = BottleRegistry(
        reactor,
        table,
        aliases,
        state_dir=state_dir,
        max_bottles=int(max_bottles),
        store=store,
        instance_id=state.instance_id,
        vms=vms,
    )
    factory = ControlServerFactory(
        registry,
        server_version=__version__,
        smolvm_version=None,
        allowed_uids=default_allowed_uids(options["allow-uid"]),
        unix_target_root=state_dir,
        clock=reactor,
        on_command=control_commands.record,
        event_hub=EventHub(registry.events.subscribe),
    )
    root = BottlenetService(
        reactor, table, registry, smolvm, factory, state_dir, smolvm_calls, control_commands
    )
    # Children start in this order and stop in reverse: the notifier says STOPPING first,
    # the control socket closes before the forwards, and smolvm calls drain last.
    vmctl_service.setServiceParent(root)
    table.setName("forwards")
    table.setServiceParent(root)
    waits: list[Deferred[Any]] = []
    config_ready: Deferred[Any] | None = None
    if config.bottles:
        bottles = ConfigBottles(reactor, registry, config, config_path or "")
        bottles.setServiceParent(root)
        waits.append(bottles.ready)
        config_ready = bottles.ready
    recovery = RecoveryService(Recovery(registry, vms, state, state_dir), after=config_ready)
    recovery.setServiceParent(root)
    waits.append(recovery.ready)
    control = options["control"] or default_control_endpoint(os.environ, state_dir)
    control_service(reactor, control, factory, on_fatal).setServiceParent(root)
    if tls is not None:
        tls_factory = factory.for_tls()
        root.control_factories.append(tls_factory)
        ListeningService(
            "control-tls",
            f"{tls[1]}:{tls[0]}",
            partial(tls_control_endpoint, reactor, *tls),
            tls_factory,
            on_fatal,
        ).setServiceParent(root)
    if metrics_spec is not None:
        site = metrics.metrics_site(
            metrics.SnapshotSource(table.list, registry.list_bottles),
            reactor,
            smolvm_calls,
            control_commands,
        )
        listener = ListeningService(
            "metrics", metrics_spec.describe(), metrics_spec.endpoint(reactor), site, on_fatal
        )
        listener.setServiceParent(root)
        waits.append(listener.when_listening())
    ready = gatherResults(waits, consumeErrors=True) if waits else succeed(None)
    sdnotify.SystemdNotifier(
        ready, status=f"{len(config.bottles)} configured bottles"
    ).setServiceParent(root)
    return root


def logs_relay_ends(runner_options: Any) -> bool:
    """Whether the daemon logs a line (debug) for every cleanly ended relay.

    Only under ``twist --log-level debug``: at any other level the event would be built and
    dropped for every connection (a measurable share of a short connection's cost, see
    docs/performance.md). Failed relays are always logged; counters count every relay.
    """
    if runner_options is None or "fileLogObserverFactory" not in runner_options:
        return False
    return runner_options.get("logLevel") is LogLevel.debug


def _recorders() -> tuple[metrics.CallStats, metrics.CommandStats]:
    """The two metrics recorders, with every label value they may see allow-listed."""
    vmctl_codes = {e.code for e in vmctl_errors.ALL_ERRORS}
    control_codes = {e.code for e in CONTROL_ERRORS}
    calls = metrics.CallStats(
        subcommands=SUBCOMMANDS, results=frozenset({"ok", CANCELLED, INTERNAL, *vmctl_codes})
    )
    commands = metrics.CommandStats(
        commands=frozenset(c.__name__ for c in ALL_COMMANDS),
        results=frozenset({"OK", *control_codes}),
    )
    return calls, commands


def _gate_settings(
    options: Options, tls: tuple[int, str, str, str, str] | None, metrics_spec: Any
) -> GateSettings:
    """The gate's stand-in-able targets, plus the daemon's own TCP services to find closed."""
    try:
        outside = Target.parse(f"tcp:{options['gate-outside']}")
        dns_name = check_dns_name(options["gate-dns-name"])
    except BottlenetError as e:
        raise _fail(f"--gate-outside/--gate-dns-name: {e.message}") from None
    ports = []
    if tls is not None:
        ports.append(tls[0])
    if metrics_spec is not None and metrics_spec.kind != "unix" and metrics_spec.port:
        ports.append(metrics_spec.port)
    return GateSettings(outside=str(outside)[4:], dns_name=dns_name, host_ports=tuple(ports))


def control_service(
    reactor: Any,
    description: str,
    factory: IProtocolFactory,
    on_fatal: Callable[[str], None],
    *,
    listen_fds: ListenFDs | None = None,
) -> ListeningService:
    """The control socket's listener: ``--control`` parsed at start, a failure fatal."""
    return ListeningService(
        "control",
        description,
        partial(control_endpoint, reactor, description, listen_fds=listen_fds),
        factory,
        on_fatal,
    )


def _tls_options(options: Options) -> tuple[int, str, str, str, str] | None:
    """All five --control-tls-* options, or none of them."""
    names = ["port", "interface", "key", "cert", "ca"]
    values = {n: options[f"control-tls-{n}"] for n in names}
    given = [n for n in names if values[n] is not None]
    if not given:
        return None
    missing = [f"--control-tls-{n}" for n in names if values[n] is None]
    if missing:
        raise _fail(f"--control-tls-{given[0]} also needs {', '.join(missing)}")
    port = values["port"]
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise _fail("--control-tls-port: must be a port 1-65535")
    for n in ("key", "cert", "ca"):
        if not os.path.isfile(values[n]):
            raise _fail(f"--control-tls-{n}: {values[n]} is not a readable file")
    return int(port), values["interface"], values["key"], values["cert"], values["ca"]


def makeService(options: Options) -> IService:
    """The twistd/twist entry point (the plugin names this module)."""
    from twisted.internet import reactor

    return build_service(options, reactor)
