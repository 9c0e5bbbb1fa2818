"""``twistd bottlenet`` / ``twist bottlenet``: options and the service tree.

Everything that can be checked before the reactor runs (options, the config file, the state
directory) is checked in :func:`makeService`; a problem there ends the process with one line
on stderr and a non-zero exit, before anything is bound.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred, gatherResults, succeed
from twisted.internet.interfaces import IListeningPort, IProtocolFactory
from twisted.logger import Logger, LogLevel
from twisted.python import usage
from twisted.python.systemd import ListenFDs

from bottlenet import __version__
from bottlenet.bottles.config import ConfigError, DaemonConfig, load_config
from bottlenet.bottles.lifecycle import VMLifecycle, VMOptions
from bottlenet.bottles.model import Source
from bottlenet.bottles.probe import GateSettings
from bottlenet.bottles.recovery import Recovery, RecoveryService, aliases_outside
from bottlenet.bottles.registry import DEFAULT_MAX_BOTTLES, BottleRegistry
from bottlenet.bottles.store import StateError, StateStore
from bottlenet.control.commands import ALL_COMMANDS, CONTROL_ERRORS
from bottlenet.control.endpoints import (
    ControlListenError,
    UNIXDescription,
    control_endpoint,
    parse_control_description,
    tls_control_endpoint,
)
from bottlenet.control.events import EventHub
from bottlenet.control.peercred import default_allowed_uids
from bottlenet.control.server import (
    DEFAULT_MAX_CONTROL_CONNECTIONS,
    MAX_CONTROL_CONNECTIONS,
    ControlServerFactory,
)
from bottlenet.errors import BottlenetError
from bottlenet.forward import fastreactor
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.budget import DEFAULT_IDLE_TIMEOUT, DEFAULT_PER_BOTTLE, reserved_fds
from bottlenet.forward.spec import DEFAULT_POOL, AliasPool
from bottlenet.forward.table import ForwardTable
from bottlenet.ops import logs, metrics, rlimits, sdnotify
from bottlenet.ops.fatal import fatal_stop, fatal_stopper
from bottlenet.ops.listening import ListeningService
from bottlenet.paths import (
    MAX_SUN_PATH,
    PrivateDirError,
    StateDirBusy,
    StateDirLock,
    default_control_endpoint,
    default_state_dir,
    ensure_private_dir,
    unix_path_state,
)
from bottlenet.probe.plan import DEFAULT_DNS_NAME, DEFAULT_OUTSIDE, Target, check_dns_name
from vmctl import errors as vmctl_errors
from vmctl.errors import VmctlError
from vmctl.service import StartupRefused, make_smolvm
from vmctl.smolvm import CANCELLED, INTERNAL, SUBCOMMANDS, Smolvm, VmUids


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
            "Control socket endpoint: unix:PATH, an absolute PATH or systemd:domain=UNIX:name=NAME "
            "(default: unix:$XDG_RUNTIME_DIR/bottlenet/control.sock).",
        ],
        [
            "control-max-connections",
            None,
            str(DEFAULT_MAX_CONTROL_CONNECTIONS),
            "Most connections each control listener holds at once (an exec session or a "
            "watcher holds one for as long as it runs).",
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
        [
            "metrics",
            None,
            None,
            "Where Prometheus /metrics is served: unix:PATH, or tcp:PORT:interface=127.x.y.z "
            "(any local user can read a TCP port), or none (default: unix:STATE-DIR/metrics.sock).",
        ],
        [
            "metrics-max-connections",
            None,
            str(metrics.DEFAULT_MAX_METRICS_CONNECTIONS),
            "Most /metrics connections open at once.",
        ],
        ["max-bottles", None, str(DEFAULT_MAX_BOTTLES), "Most bottles the daemon holds at once."],
        [
            "max-bottle-connections",
            None,
            str(DEFAULT_PER_BOTTLE),
            "Most relayed connections one bottle holds at once (all its forwards together).",
        ],
        [
            "max-connections",
            None,
            None,
            "Most relayed connections in the daemon (default: from the open-files limit, "
            "keeping room for the control socket); each bottle keeps a fair share of it.",
        ],
        [
            "idle-timeout",
            None,
            f"{DEFAULT_IDLE_TIMEOUT:g}",
            "Close a relayed connection after this many seconds without a byte either way "
            "(0: never).",
        ],
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
            await self._registry.create_bottle(bottle.name, bottle.alias, source=Source.CONFIG)
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
        #: The state directory's lock, held from build until the service has stopped.
        self.state_lock: StateDirLock | None = None

    def startService(self) -> None:
        if self.state_lock is not None:
            self.state_lock.record_pid()  # twistd may have forked since the lock was taken
        old, new = rlimits.raise_nofile(rlimits.select_reactor_cap(self.reactor))
        if new != old:
            self.log.info("open files limit {old} -> {new}", old=old, new=new)
        else:
            self.log.info("open files limit {new}", new=new)
        self.log.info(
            "relay engine {engine}, reactor {reactor}",
            engine=self.table.engine,
            reactor=type(self.reactor).__qualname__,
        )
        super().startService()
        vm_uids = VmUids.for_euid(os.geteuid()) if self.smolvm.binary is not None else None
        for factory in self.control_factories:
            factory.smolvm_source = self.smolvm.describe()
            factory.vm_uids = vm_uids
        if vm_uids is not None:
            self.log.info("smolvm runs VMs with {model}", model=str(vm_uids))
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

    def stopService(self) -> Deferred[None]:
        d: Deferred[None] = Deferred.fromCoroutine(self._stop())
        return d

    async def _stop(self) -> None:
        try:
            await super().stopService()
        finally:
            if self.state_lock is not None:
                self.state_lock.release()


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
        ensure_private_dir(state_dir, traversable=True)
    except PrivateDirError as e:
        raise _fail(
            f"--state-dir: {e.message}; it must be a 0700 directory of this user's (0701 too: "
            "smolvm adds o+x when it starts a VM as root; a new path is created 0700)"
        ) from None
    # One daemon per state directory: locked before anything in it is read or changed.
    lock = StateDirLock(state_dir)
    try:
        lock.acquire()
    except StateDirBusy as e:
        raise _fail(f"--state-dir: {e.message}") from None
    except OSError as e:
        raise _fail(f"--state-dir: cannot lock {lock.path}: {e.strerror or e}") from None
    try:
        root = _build(options, reactor, pool, connect_timeout, state_dir)
    except BaseException:
        lock.release()
        raise
    root.state_lock = lock
    return root


def _build(
    options: Options, reactor: Any, pool: AliasPool, connect_timeout: float, state_dir: str
) -> BottlenetService:
    config = DaemonConfig(())
    config_path = options["config"]
    if config_path is not None:
        try:
            config = load_config(config_path, pool, state_dir)
        except ConfigError as e:
            raise _fail(str(e)) from None
    metrics_spec = _metrics_option(options, pool, state_dir)
    metrics_cap = options["metrics-max-connections"]
    if not str(metrics_cap).isdigit() or not 1 <= int(metrics_cap) <= 1024:
        raise _fail("--metrics-max-connections: must be an integer 1-1024")
    tls = _tls_options(options, pool)
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
    outside = aliases_outside(state, pool)
    if outside:
        raise _fail(
            f"--alias-pool {pool.network}: persisted bottle(s) {', '.join(outside[:5])} have "
            "aliases outside it; start with the pool they were made in (nothing is torn down)"
        )

    on_fatal = fatal_stopper(reactor)

    # Recorded whether or not --metrics is given (cheap), so the root service always has them.
    smolvm_calls, control_commands = _recorders()
    try:
        vmctl_service, smolvm = make_smolvm(
            reactor,
            options["smolvm"],
            options["smolvm-data-dir"],
            on_call=smolvm_calls.record,
            default_data_dir=os.path.join(state_dir, "smolvm"),
        )
    except StartupRefused as e:
        raise _fail(e.message) from None
    control_cap = _control_cap(options)
    budgets = _budget_options(options, control_cap)
    aliases = AliasRegistry(pool)
    try:
        table = ForwardTable(
            reactor,
            aliases,
            state_dir=state_dir,
            connect_timeout=connect_timeout,
            engine=options["relay-engine"],
            **budgets,
        )
    except ValueError as e:
        raise _fail(f"--relay-engine: {e}") from None
    table.log_clean_relay_ends = logs_relay_ends(options.parent)
    vm_options = VMOptions(
        instance_id=state.instance_id,
        gate=gate,
        skip_probe=options["unsafe-skip-isolation-probe"],
        vm_uids=VmUids.for_euid(os.geteuid()),
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
    control = options["control"] or default_control_endpoint(os.environ, state_dir)
    try:  # a bad --control stops the daemon here, before any listener is bound
        parse_control_description(control)
    except ControlListenError as e:
        raise _fail(str(e)) from None
    registry.protected_dirs = _own_dirs(state_dir, control, options["smolvm-data-dir"])
    control_path = _unix_path(control)
    if control_path is not None:
        table.own_sockets.add_unix(control_path)
    if tls is not None:
        table.own_sockets.add_tcp(tls[1], tls[0])
    factory = ControlServerFactory(
        registry,
        server_version=__version__,
        smolvm_version=None,
        allowed_uids=default_allowed_uids(options["allow-uid"]),
        unix_target_root=state_dir,
        clock=reactor,
        on_command=control_commands.record,
        event_hub=EventHub(registry.events.subscribe),
        max_connections=control_cap,
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
    recovery = RecoveryService(
        Recovery(registry, vms, state, state_dir), after=config_ready, on_fatal=on_fatal
    )
    recovery.setServiceParent(root)
    waits.append(recovery.ready)
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
        capped: list[metrics.CappedFactory] = []

        def refusals() -> list[tuple[str, str, int]]:
            rows = [("forward", r, n) for r, n in table.budget.refused.items()]
            rows += [(f.transport_kind, "cap", f.refused) for f in root.control_factories]
            rows += [("metrics", "cap", c.refused) for c in capped]
            return rows

        site = metrics.metrics_site(
            metrics.SnapshotSource(table.list, registry.list_bottles),
            reactor,
            smolvm_calls,
            control_commands,
            refusals,
        )
        capped.append(metrics.CappedFactory(site, int(metrics_cap), reactor))
        listener = ListeningService(
            "metrics", metrics_spec.describe(), metrics_spec.endpoint(reactor), capped[0], on_fatal
        )
        listener.setServiceParent(root)
        waits.append(listener.when_listening())
        if metrics_spec.kind == "unix":
            table.own_sockets.add_unix(metrics_spec.path)
            # A socket nothing answers on is a crashed daemon's (kill -9): replace it, as the
            # control socket's is; a live one, a symlink or a file makes the listen fail.
            if unix_path_state(metrics_spec.path)[0] == "stale":
                os.unlink(metrics_spec.path)
        else:
            interface = metrics_spec.interface

            def listening(port: IListeningPort) -> None:
                # The bound port (0 resolves now): no forward may target it.
                table.own_sockets.add_tcp(interface, int(getattr(port.getHost(), "port", 0)))

            listener.when_listening().addCallback(listening)
    ready = gatherResults(waits, consumeErrors=True) if waits else succeed(None)
    sdnotify.SystemdNotifier(
        ready, status=count_of(len(config.bottles), "configured bottle")
    ).setServiceParent(root)
    return root


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
            BottlenetService.log.warn(
                "no /metrics: {path} is too long for a UNIX socket; use --metrics", path=path
            )
            return None
        return metrics.MetricsEndpoint("unix", path=path, mode=0o600)
    try:
        return metrics.parse_metrics_endpoint(text, pool)
    except BottlenetError as e:
        raise _fail(f"--metrics: {e.message}") from None


def _budget_options(options: Options, control_cap: int) -> dict[str, Any]:
    """``--max-bottle-connections``, ``--max-connections`` and ``--idle-timeout``, checked;
    the fds they keep out of the relay budget follow ``control_cap`` (per control listener)."""
    per_bottle = options["max-bottle-connections"]
    if not str(per_bottle).isdigit() or not 1 <= int(per_bottle) <= 1 << 20:
        raise _fail("--max-bottle-connections: must be an integer 1-1048576")
    total = options["max-connections"]
    if total is not None and (not str(total).isdigit() or not 1 <= int(total) <= 1 << 20):
        raise _fail("--max-connections: must be an integer 1-1048576")
    try:
        idle = float(options["idle-timeout"])
        if not 0 <= idle <= 7 * 86400 or idle != idle:
            raise ValueError
    except ValueError:
        raise _fail("--idle-timeout: must be a number of seconds 0-604800 (0: off)") from None
    return {
        "per_bottle_connections": int(per_bottle),
        "max_connections": None if total is None else int(total),
        "idle_timeout": idle,
        # the TLS listener has a cap of its own: keep room for both
        "reserved_fds": reserved_fds(control_cap * (2 if options["control-tls-port"] else 1)),
    }


def _control_cap(options: Options) -> int:
    """``--control-max-connections``, checked."""
    cap = options["control-max-connections"]
    if not str(cap).isdigit() or not 1 <= int(cap) <= MAX_CONTROL_CONNECTIONS:
        raise _fail(f"--control-max-connections: must be an integer 1-{MAX_CONTROL_CONNECTIONS}")
    return int(cap)


def _own_dirs(state_dir: str, control: str, smolvm_data: str | None) -> tuple[str, ...]:
    """The daemon's own directories: no agent volume may be, hold or lie inside one."""
    dirs = [os.path.abspath(state_dir)]
    path = _unix_path(control)
    if path is not None:
        dirs.append(os.path.dirname(path))
    if smolvm_data:
        dirs.append(os.path.abspath(smolvm_data))
    return tuple(dict.fromkeys(dirs))


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


def _tls_options(options: Options, pool: AliasPool) -> tuple[int, str, str, str, str] | None:
    """All five --control-tls-* options, or none of them.

    The interface is one IP address, never a wildcard (it would listen on every address,
    the bottles' aliases included) nor an address of the alias pool (an alias-mode guest
    reaches every port of its own alias).
    """
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
    try:
        interface = ipaddress.ip_address(values["interface"])
    except ValueError:
        raise _fail("--control-tls-interface: must be one IP address") from None
    mapped = getattr(interface, "ipv4_mapped", None) or interface
    if interface.is_unspecified:
        raise _fail("--control-tls-interface: a wildcard listens on every address; name one")
    if isinstance(mapped, ipaddress.IPv4Address) and mapped in pool.network:
        raise _fail(f"--control-tls-interface: {interface} is inside the alias pool {pool.network}")
    for n in ("key", "cert", "ca"):
        if not os.path.isfile(values[n]):
            raise _fail(f"--control-tls-{n}: {values[n]} is not a readable file")
    return int(port), values["interface"], values["key"], values["cert"], values["ca"]


def count_of(n: int, noun: str) -> str:
    """``1 configured bottle``, ``2 configured bottles``: a count for a log line."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def restore_sigint() -> None:
    """SIGINT stops the daemon even when it was started with SIGINT ignored.

    A shell's background job (``twist bottlenet &`` in a script) and some supervisors start
    the process with SIGINT ignored; Twisted then installs no SIGINT handler and Ctrl-C or
    ``kill -INT`` would do nothing. Python's own handler put back here, Twisted replaces it
    with its orderly shutdown when the reactor starts.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def makeService(options: Options) -> IService:
    """The twistd/twist entry point (the plugin names this module)."""
    from twisted.internet import reactor

    restore_sigint()
    return build_service(options, reactor)
