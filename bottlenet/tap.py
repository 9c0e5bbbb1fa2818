"""``twistd bottlenet`` / ``twist bottlenet``: the service tree.

:func:`build_service` takes the checked settings (:func:`bottlenet.settings.settings_from`),
then touches the disk: it locks the state directory, loads (or first saves) the state file and
clears a crashed daemon's metrics socket. :func:`compose` only constructs the parts and parents
them, in the order docs/architecture.md explains. A problem before composition ends the process
with one line on stderr (``bottlenet: error: ...``) and exit status 1, before anything is bound.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred, DeferredList, gatherResults, maybeDeferred, succeed
from twisted.internet.interfaces import IProtocolFactory
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.systemd import ListenFDs

from bottlenet import __version__
from bottlenet.bottles.egresswatch import EgressWatch
from bottlenet.bottles.events import EventBus
from bottlenet.bottles.host import VMHost, VMOptions, vm_host
from bottlenet.bottles.recovery import Recovery, RecoveryService, aliases_outside
from bottlenet.bottles.registry import BottleRegistry
from bottlenet.bottles.services import ConfigBottles
from bottlenet.bottles.store import State, StateError, StateStore
from bottlenet.bottles.vmmaccess import closed_parents
from bottlenet.bottles.volumes import VolumeRules
from bottlenet.control.commands import ALL_COMMANDS, CONTROL_ERRORS
from bottlenet.control.context import ControlContext, SmolvmFacts, TLSAdmission, UnixAdmission
from bottlenet.control.endpoints import control_endpoint, tls_control_endpoint
from bottlenet.control.events import EventHub
from bottlenet.control.server import ControlServerFactory
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.table import ForwardTable
from bottlenet.kit.build import KitCache
from bottlenet.kit.keeper import KitKeeper
from bottlenet.node.info import Node, node_parts
from bottlenet.ops import metrics, rlimits, sdnotify
from bottlenet.ops.fatal import FatalStopper, fatal_stopper
from bottlenet.ops.listening import ListeningService
from bottlenet.ops.metricsservice import metrics_listener
from bottlenet.paths import (
    PrivateDirError,
    StateDirBusy,
    StateDirLock,
    ensure_private_dir,
    unix_path_state,
)
from bottlenet.settings import DaemonSettings, Options, StartupError, settings_from
from vmctl import errors as vmctl_errors
from vmctl.errors import VmctlError
from vmctl.kvm import probe_kvm
from vmctl.service import build_smolvm
from vmctl.smolvm import CANCELLED, INTERNAL, SUBCOMMANDS, Smolvm, VmUids, tested_names
from vmctl.uidranges import UidRangeError
from vmctl.uids import UidRegistryError

__all__ = [
    "BottlenetService",
    "DaemonSettings",
    "Options",
    "StartupError",
    "build_service",
    "compose",
    "control_service",
    "makeService",
    "settings_from",
]


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
        *,
        vm_uids: VmUids,
    ) -> None:
        super().__init__()
        self.reactor = reactor
        self.table = table
        self.registry = registry
        self.smolvm = smolvm
        self.control_factory = factory
        #: Every control factory (UNIX and TLS), one context behind them all.
        self.control_factories = [factory]
        #: smolvm's privilege model as the daemon's uid implies it (derived once, in _core).
        self.vm_uids = vm_uids
        self.state_dir = state_dir
        self.smolvm_calls = smolvm_calls or metrics.CallStats()
        self.control_commands = control_commands or metrics.CommandStats()
        #: The state directory's lock, held from build until the service has stopped.
        self.state_lock: StateDirLock | None = None
        #: The node contract (NodeInfo, Drain); compose sets it.
        self.node: Node | None = None
        #: The ``on_fatal`` every child is given; compose sets it.
        self.fatal: FatalStopper | None = None

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
        Service.startService(self)
        for child in self:  # as MultiService does, but none after a fatal stop began
            if self._stopping():
                return
            child.startService()
        if self._stopping():
            return  # no start-up advice for a daemon that is about to exit
        vm_uids = self.vm_uids if self.smolvm.binary is not None else None
        facts = self.smolvm_facts
        facts.probing(self.smolvm.describe(), self.vm_uids_now)
        if self.node is not None:
            self.node.kvm = probe_kvm()
            if vm_uids is not None:
                self.node.smolvm_found = True
                self.node.smolvm_problem = "its version is not known yet"
        if vm_uids is None:
            facts.settle()
            return
        self.log.info("smolvm runs VMs with {model}", model=str(vm_uids))
        self._say_what_smolvm_opens(vm_uids)
        self.probe_smolvm().addBoth(lambda _: facts.settle())

    def _stopping(self) -> bool:
        return self.fatal is not None and self.fatal.stopping

    @property
    def smolvm_facts(self) -> SmolvmFacts:
        """What Hello says of smolvm, one object for every control listener."""
        return self.control_factory.context.smolvm

    def vm_uids_left(self) -> int | None:
        """Per-VM uids the node can still give out (None: not counted; metrics)."""
        supply = self.node.vm_uids if self.node is not None else None
        return None if supply is None else supply.left

    def vm_uids_now(self) -> tuple[str | None, str | None]:
        """smolvm's privilege model as the daemon's uid implies it (Hello's ``vm_uids``, which
        launchers compare), and its basis: what the last VM start showed, the VMM's uid
        against the daemon's (issue 30: the row said ``per-VM uids`` for a fake that dropped
        no uid), else that nothing was seen yet."""
        if self.smolvm.binary is None:
            return None, None
        euid = os.geteuid()
        expected = self.vm_uids
        seen = self.smolvm.vmm_seen
        if seen is None:
            who = "root" if euid == 0 else f"uid {euid}"
            return str(expected), f"expected: the daemon runs as {who}; no VM start seen yet"
        basis = f"seen: {seen.machine}'s VM process ran as uid {seen.uid}"
        model = seen.model(euid)
        if model is not expected:
            basis += f": {model} in fact"
        return str(expected), basis

    def _say_what_smolvm_opens(self, vm_uids: VmUids) -> None:
        """As root, smolvm's first VM start adds ``o+x`` to every parent of its data dir,
        outside the state dir too (issue 30: a surprise found only deep in the docs)."""
        data_dir = self.smolvm.data_dir_root
        if vm_uids is not VmUids.PER_VM or data_dir is None:
            return
        try:
            closed = closed_parents(data_dir)
        except OSError:
            return  # a parent that cannot be read: smolvm's start will say more
        if closed:
            self.log.warn(
                "smolvm runs VMs with per-VM uids: its first VM start adds o+x to {paths} "
                "(docs/smolvm.md, Privilege model)",
                paths=", ".join(closed),
            )

    def probe_smolvm(self) -> Deferred[None]:
        """Learn the smolvm version once; a failure other than smolvm's own is logged."""
        d: Deferred[None] = Deferred.fromCoroutine(self._probe_smolvm())
        d.addErrback(self._probe_failed)
        return d

    def _probe_failed(self, failure: Failure) -> None:
        self.log.failure("the smolvm version probe failed", failure)

    def refusals(self) -> list[tuple[str, str, int]]:
        """Connections refused so far: by the forwards' budgets and each control listener's cap."""
        rows = [("forward", r, n) for r, n in self.table.budget.refused.items()]
        rows += [(f.admission.kind, "cap", f.refused) for f in self.control_factories]
        return rows

    async def _probe_smolvm(self) -> None:
        """Learn the smolvm version once, for Hello and to refuse an unsupported one early."""
        try:
            version = await self.smolvm.version()
        except VmctlError as e:
            self.log.warn("smolvm is unusable: {code}: {why}", code=e.code, why=str(e))
            if self.node is not None:
                self.node.smolvm_problem = f"unusable ({e.code})"
            return
        if self.node is not None:
            self.node.smolvm_version = str(version)
            self.node.smolvm_tested = version.tested
            self.node.smolvm_problem = None if version.supported else "version not supported"
        self.smolvm_facts.learned(
            str(version),
            version.supported,
            self.smolvm.describe(),
            version.tested,
            tested_names(),
        )
        self.log.info("using {smolvm}", smolvm=self.smolvm.describe())

    def stopService(self) -> Deferred[None]:
        d: Deferred[None] = Deferred.fromCoroutine(self._stop())
        return d

    async def _stop(self) -> None:
        try:
            Service.stopService(self)
            if self.node is not None:
                self.node.pools.stop()  # no fill starts while the daemon stops
            # In reverse, as MultiService does, but only what started (a fatal stop can
            # end the start half-way).
            started = [child for child in self if child.running]
            await DeferredList([maybeDeferred(c.stopService) for c in reversed(started)])
        finally:
            if self.state_lock is not None:
                self.state_lock.release()


def build_service(options: Options, reactor: Any) -> BottlenetService:
    """Check every setting, touch the disk (lock, state file, stale socket), then compose."""
    settings = settings_from(options)
    lock = _lock_state_dir(settings.state_dir)
    try:
        store, state = _load_state(settings)
        if settings.metrics is not None and settings.metrics.kind == "unix":
            # A socket nothing answers on is a crashed daemon's (kill -9): replace it, as the
            # control socket's is; a live one, a symlink or a file makes the listen fail.
            if unix_path_state(settings.metrics.path)[0] == "stale":
                os.unlink(settings.metrics.path)
        root = compose(settings, store, state, reactor)
        _check_vm_uids(root)
    except BaseException:
        lock.release()
        raise
    root.state_lock = lock
    return root


def _check_vm_uids(root: BottlenetService) -> None:
    """As root: the per-VM uids this daemon's smolvm data dir owns are still its alone on
    the host (``vmctl.uidranges``); one line naming the conflict otherwise."""
    pool = root.smolvm.uid_pool
    if pool is None or root.smolvm.binary is None or root.vm_uids is not VmUids.PER_VM:
        return
    try:
        supply = pool.check()
    except (UidRangeError, UidRegistryError) as e:
        raise StartupError(f"--smolvm-data-dir {pool.data_dir}: {e}") from None
    except OSError as e:
        raise StartupError(f"--smolvm-data-dir {pool.data_dir}: {e.strerror or e}") from None
    root.log.info("per-VM uids: {supply}", supply=supply.describe())
    if root.node is not None:
        root.node.vm_uids = supply


def _lock_state_dir(state_dir: str) -> StateDirLock:
    """The state directory, private and locked: one daemon per directory, locked before
    anything in it is read or changed."""
    try:
        ensure_private_dir(state_dir, traversable=True)
    except PrivateDirError as e:
        raise StartupError(
            f"--state-dir: {e.message}; it must be a 0700 directory of this user's (0701 too: "
            "smolvm adds o+x when it starts a VM as root; a new path is created 0700)"
        ) from None
    lock = StateDirLock(state_dir)
    try:
        lock.acquire()
    except StateDirBusy as e:
        raise StartupError(f"--state-dir: {e.message}") from None
    except OSError as e:
        raise StartupError(f"--state-dir: cannot lock {lock.path}: {e.strerror or e}") from None
    return lock


def _load_state(settings: DaemonSettings) -> tuple[StateStore, State]:
    """The state file, saved at once when absent; refused when its bottles left the pool."""
    store = StateStore(settings.state_dir)
    try:
        state = store.load()
        if not os.path.exists(store.path):
            store.save(state)  # the instance id (our owner label) must outlive a crash
    except StateError as e:
        raise StartupError(e.message) from None
    except OSError as e:
        raise StartupError(f"{store.path}: {e.strerror}") from None
    outside = aliases_outside(state, settings.pool)
    if outside:
        raise StartupError(
            f"--alias-pool {settings.pool.network}: persisted bottle(s) {', '.join(outside[:5])} "
            "have aliases outside it; start with the pool they were made in (nothing is torn down)"
        )
    return store, state


def mounted_kits(state: State) -> frozenset[str]:
    """The digests of the guest kits the state's VM bottles mount (the start's prune of the
    kit cache keeps them: their VMs may still run on them)."""
    digests = set()
    for record in state.bottles.values():
        kit = record.get("kit")
        if isinstance(kit, dict) and isinstance(kit.get("digest"), str):
            digests.add(kit["digest"])
    return frozenset(digests)


def compose(
    settings: DaemonSettings, store: StateStore, state: State, reactor: Any
) -> BottlenetService:
    """Construct the daemon's parts and parent them; no check, no I/O.

    Children start in this order and stop in reverse (docs/architecture.md, the service
    tree): the notifier says STOPPING first, the control socket closes before the forwards,
    and smolvm calls drain last.
    """
    on_fatal = fatal_stopper(reactor)
    root, vmctl_service, host = _core(settings, store, state, reactor)
    root.fatal = on_fatal
    table, registry = root.table, root.registry
    vmctl_service.setServiceParent(root)
    if host.kit is not None:
        host.kit.setServiceParent(root)  # builds the guest kit off the reactor thread
    table.setName("forwards")
    table.setServiceParent(root)
    waits: list[Deferred[Any]] = []
    config_ready: Deferred[Any] | None = None
    if settings.config.bottles:
        bottles = ConfigBottles(registry, settings.config, settings.config_path, on_fatal)
        bottles.setServiceParent(root)
        waits.append(config_ready := bottles.ready)
    recovery = RecoveryService(
        Recovery(registry, host, state, settings.state_dir), after=config_ready, on_fatal=on_fatal
    )
    recovery.setServiceParent(root)
    waits.append(recovery.ready)
    node = root.node
    if node is not None:  # the warm pools fill once the kept members are counted
        recovery.ready.addCallback(lambda _: node.pools.start())
    # No VM bottle without a smolvm: then it never asks anything.
    EgressWatch(reactor, host.smolvm, registry.list_bottles, registry.events.emit).setServiceParent(
        root
    )
    control_service(reactor, settings.control, root.control_factory, on_fatal).setServiceParent(
        root
    )
    if settings.tls is not None:
        context = root.control_factory.context
        tls_factory = ControlServerFactory(
            context, TLSAdmission.of(context), max_connections=settings.control_cap
        )
        root.control_factories.append(tls_factory)
        tls = settings.tls
        ListeningService(
            "control-tls",
            f"{tls.interface}:{tls.port}",
            partial(
                tls_control_endpoint, reactor, tls.port, tls.interface, tls.key, tls.cert, tls.ca
            ),
            tls_factory,
            on_fatal,
        ).setServiceParent(root)
    if settings.metrics is not None:
        listener = metrics_listener(
            reactor,
            settings.metrics,
            settings.metrics_cap,
            metrics.SnapshotSource(
                table.list,
                registry.list_bottles,
                registry.transparent_outcomes,
                count_vm_uids=root.vm_uids_left,
            ),
            (root.smolvm_calls, root.control_commands),
            root.refusals,
            table.own_sockets,
            on_fatal,
        )
        listener.setServiceParent(root)
        waits.append(listener.when_listening())
    ready = gatherResults(waits, consumeErrors=True) if waits else succeed(None)
    status = partial(ready_status, registry, len(settings.config.bottles))
    sdnotify.SystemdNotifier(ready, status=status).setServiceParent(root)
    return root


def _core(
    settings: DaemonSettings, store: StateStore, state: State, reactor: Any
) -> tuple[BottlenetService, IService, VMHost]:
    """The root service with its table, registry, smolvm and control factory (not parented)."""
    # Recorded whether or not --metrics is given (cheap), so the root service always has them.
    smolvm_calls, control_commands = _recorders()
    vmctl_service, smolvm = build_smolvm(
        reactor,
        settings.smolvm,
        on_call=smolvm_calls.record,
        uid_roots=(os.path.join(settings.state_dir, "bottles"),),
    )
    aliases = AliasRegistry(settings.pool)
    budgets = settings.budgets
    table = ForwardTable(
        reactor,
        aliases,
        state_dir=settings.state_dir,
        connect_timeout=settings.connect_timeout,
        engine=settings.relay_engine,
        per_bottle_connections=budgets.per_bottle_connections,
        max_connections=budgets.max_connections,
        idle_timeout=budgets.idle_timeout,
        reserved_fds=budgets.reserved_fds,
    )
    table.log_clean_relay_ends = settings.log_relay_ends
    if settings.skip_probe:
        BottlenetService.log.warn(
            "--unsafe-skip-isolation-probe: agent VMs start WITHOUT the isolation launch gate"
        )
    vm_uids = VmUids.for_euid(os.geteuid())
    vm_options = VMOptions(
        instance_id=state.instance_id,
        gate=settings.gate,
        skip_probe=settings.skip_probe,
        vm_uids=vm_uids,
        sidecar_ready_timeout=settings.sidecar_ready_timeout,
        volumes=VolumeRules(settings.protected_paths, settings.volume_roots),
    )
    kit = KitKeeper(
        reactor,
        None if settings.kit_dir is None else KitCache(settings.kit_dir),
        mounted=lambda: mounted_kits(state),
    )
    host = vm_host(
        reactor, smolvm, table, aliases, state_dir=settings.state_dir, options=vm_options, kit=kit
    )
    registry, node = _registry(settings, store, state, reactor, table, aliases, host)
    if settings.control_path is not None:
        table.own_sockets.add_unix(settings.control_path)
    if settings.tls is not None:
        table.own_sockets.add_tcp(settings.tls.interface, settings.tls.port)
    factory = _control_factory(settings, reactor, registry, node, control_commands)
    factory.context.smolvm.guest_kit = kit.describe
    factory.context.smolvm.guest_kit_argv = kit.guest_argv
    root = BottlenetService(
        reactor,
        table,
        registry,
        smolvm,
        factory,
        settings.state_dir,
        smolvm_calls,
        control_commands,
        vm_uids=vm_uids,
    )
    root.node = node
    host.uid_reports.listeners.append(node.learn_uids)
    return root, vmctl_service, host


def _registry(
    settings: DaemonSettings,
    store: StateStore,
    state: State,
    reactor: Any,
    table: ForwardTable,
    aliases: AliasRegistry,
    host: VMHost,
) -> tuple[BottleRegistry, Node]:
    """The bottles' table, the node's policies it tells (built first: the table takes them)
    and the node over both."""
    events = EventBus()
    parts = node_parts(
        reactor,
        store,
        state,
        events.emit,
        monotonic=time.monotonic,
        lease_grace=settings.lease_grace,
    )
    registry = BottleRegistry(
        reactor,
        table,
        aliases,
        state_dir=settings.state_dir,
        max_bottles=settings.max_bottles,
        store=store,
        instance_id=state.instance_id,
        host=host,
        events=events,
        policies=parts.policies(),
    )
    euid = os.geteuid()
    who = "root" if euid == 0 else f"uid {euid}"
    node = Node(
        registry,
        table.budget,
        parts,
        host=socket.gethostname(),
        labels=settings.labels,
        privilege=f"{who}; smolvm VMs run with {host.options.vm_uids}",
    )
    return registry, node


def _control_factory(
    settings: DaemonSettings,
    reactor: Any,
    registry: BottleRegistry,
    node: Node,
    control_commands: metrics.CommandStats,
) -> ControlServerFactory:
    """The control socket's factory over the registry and the node; its context is the one
    the TLS listener's factory shares (``compose``)."""
    context = ControlContext(
        backend=registry,
        server_version=__version__,
        clock=reactor,
        on_command=control_commands.record,
        event_hub=EventHub(registry.events.subscribe),
        node=node,
        unix_target_root=settings.state_dir,
    )
    admission = UnixAdmission(settings.allowed_uids, settings.scoped_uids)
    return ControlServerFactory(context, admission, max_connections=settings.control_cap)


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


def ready_status(registry: BottleRegistry, configured: int) -> str:
    """``2 bottles (1 configured, 1 restored)``: asked when the daemon is ready, once recovery
    has restored what the state file holds (a count made at start would say 0 restored)."""
    total = len(registry.list_bottles())
    return f"{count_of(total, 'bottle')} ({configured} configured, {total - configured} restored)"


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
