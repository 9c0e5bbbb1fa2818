"""Reconcile the state file with reality when the daemon starts.

VMs survive a daemon restart; listeners do not. So on start the daemon: stops the VMMs of
our machines whose record is not running (a start cut short by a crash leaves one that only
``stop`` kills); re-binds the agent endpoints of every live bottle on the same addresses and
ports; tears down bottles whose sidecar is gone (or whose sockets or raw ports are no longer
its VM's, or whose endpoint cannot be re-bound: fail closed); deletes machines that carry our
owner label but that no bottle claims (a create cut short by a crash); removes unclaimed
socket directories. A sidecar smolvm calls ``unreachable`` (its agent missed a 250 ms ping)
whose recorded VMM pid is alive is not dead. It never touches a machine without our owner
label. Whether one kept bottle lives on is :func:`check_alive` and :func:`rebind` here, over
the host's smolvm, forward table and ownership checks.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from typing import Any

from attrs import evolve
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from bottlenet.bottles.bottledirs import BOTTLES, remove_bottle_dir
from bottlenet.bottles.host import VMHost
from bottlenet.bottles.model import (
    LABEL_OWNER,
    Bottle,
    BottleState,
    BottleVMs,
    Role,
    SocketEndpoint,
)
from bottlenet.bottles.registry import BottleRegistry
from bottlenet.bottles.store import State, StateError
from bottlenet.bottles.vmerrors import map_vmctl
from bottlenet.bottles.watch import pid_alive
from bottlenet.errors import (
    BottlenetError,
    InvalidArgument,
    IsolationFailed,
    SmolvmFailed,
    safe_repr,
)
from bottlenet.forward.spec import AliasPool, UNIXListen
from vmctl.errors import VmctlError
from vmctl.ports import Ownership
from vmctl.smolvm import Machine


def check_alive(host: VMHost, bottle: Bottle, machines: Mapping[str, Machine] | None) -> str | None:
    """Why a persisted bottle cannot be kept, or None when its sidecar still runs with
    the recorded pid holding every exposed socket and raw port. ``machines`` is smolvm's
    listing by name (None when smolvm could not list: then the pid alone is checked).
    ``unreachable`` (a live VMM whose agent missed smolvm's 250 ms ping, a busy host)
    with the recorded pid alive is not death."""
    vm = bottle.require_vms()
    if bottle.state == BottleState.DEGRADED:
        return "it was degraded"
    if machines is None:
        alive = pid_alive(vm.sidecar_pid)
    else:
        m = machines.get(vm.sidecar_vm)
        alive = (
            m is not None
            and (m.running or m.unreachable)
            and m.pid == vm.sidecar_pid
            and pid_alive(vm.sidecar_pid)
        )
    if not alive:
        return "its sidecar VM is gone"
    floor = None if machines is None else machines[vm.sidecar_vm].floor_whole
    if floor is False:
        # smolvm 1.37 reports --block-private (and what it re-opens): a sidecar without the
        # whole floor reaches the host's loopback, LAN and metadata.
        return "its sidecar VM runs without the whole --block-private floor"
    for path in vm.sidecar_sockets:
        sock = host.check_socket(path, vm.sidecar_pid)
        if not sock.owned and not (
            host.options.allow_unverifiable_ports and sock.ownership is Ownership.UNVERIFIABLE
        ):
            return f"a sidecar socket is no longer held by its VM ({sock.ownership.value})"
    for port in vm.raw_ports:
        check = host.check_port(port, vm.sidecar_pid)
        if not check.owned and not (
            host.options.allow_unverifiable_ports and check.ownership is Ownership.UNVERIFIABLE
        ):
            return f"raw port {port} is no longer held by its sidecar ({check.ownership.value})"
    return None


async def restored_uids(host: VMHost, bottle: Bottle) -> BottleVMs:
    """Under per-VM uids: the VMM uids the daemon reserved at create, checked against
    smolvm's root-owned registry (a record older than them takes the registry's). Never
    a VMM-writable file: a disagreement fails the bottle (ISOLATION_FAILED)."""
    vm = bottle.require_vms()
    if not host.access.per_vm:
        return vm
    found: dict[Role, int | None] = {}
    for role, machine, kept in (
        (Role.AGENT, vm.agent_vm, vm.agent_uid),
        (Role.SIDECAR, vm.sidecar_vm, vm.sidecar_uid),
    ):
        registered = await host.smolvm.vmm_uid(machine)
        if (kept is not None and registered != kept) or (role, registered) == (
            Role.AGENT,
            None,
        ):
            raise IsolationFailed(
                f"the {role} VM of {bottle.name} was reserved uid {kept} but smolvm's "
                f"registry holds {registered} for it; bottle torn down"
            )
        found[role] = registered
    return evolve(vm, agent_uid=found[Role.AGENT], sidecar_uid=found[Role.SIDECAR])


async def rebind(host: VMHost, bottle: Bottle) -> Bottle:
    """Re-bind a persisted bottle's agent endpoints on the same paths, behind the same
    sidecar sockets or raw ports, granted to the agent VMM uid reserved at create.

    Returns the bottle with its uids (an old record gains them). On failure every
    listener it bound is removed again and the typed error raised.
    """
    vm = bottle.require_vms()
    try:
        vm = await restored_uids(host, bottle)
        for e in vm.endpoints:
            behind = e.sidecar_path if isinstance(e, SocketEndpoint) else e.raw_port
            await host.bind_endpoint(
                bottle.name, e.service, e.guest_port, behind, UNIXListen(e.path), vm.home
            )
        host.table.admit_peers(bottle.name, host.access.peers(None))
        if vm.agent_uid is not None:
            host.grant_agent(bottle.name, vm.endpoints, vm.agent_uid)
    except VmctlError as e:
        await host.table.remove_bottle(bottle.name)
        raise map_vmctl(e) from None
    except OSError as e:
        await host.table.remove_bottle(bottle.name)
        raise SmolvmFailed(f"granting the agent VM its endpoints: {e.strerror}") from None
    except BottlenetError:
        await host.table.remove_bottle(bottle.name)
        raise
    return evolve(bottle, vms=vm)


class Recovery:
    """One reconcile pass: the registry and the host do the work, this decides."""

    log = Logger()

    def __init__(
        self, registry: BottleRegistry, host: VMHost | None, state: State, state_dir: str
    ) -> None:
        self.registry = registry
        self.host = host
        self.state = state
        self.state_dir = state_dir
        #: A persisted record could not be read: no machine is an orphan for sure then.
        self.dropped = False

    async def run(self) -> None:
        self.registry.begin_restore()
        try:
            bottles = self._load()
            await self._forward_only([b for b in bottles if not b.has_vms])
            await self._vm_bottles([b for b in bottles if b.has_vms])
            await self._revoke_left_grants()
            self._remove_unclaimed_dirs()
        finally:
            self.registry.end_restore()
        try:
            self.registry.save()
        except BottlenetError:
            pass
        self.log.info(
            "recovery done: {n} bottle(s) restored",
            n=len([r for r in self.state.bottles if self.registry.has_bottle(r)]),
        )

    def _load(self) -> list[Bottle]:
        """Every well-formed persisted bottle not shadowed by the config (the rest logged)."""
        bottles: list[Bottle] = []
        for name, rec in sorted(self.state.bottles.items()):
            try:
                bottle = Bottle.from_state(name, rec, unix_root=self.state_dir)
            except StateError as e:
                self.log.error("persisted bottle {bottle} dropped: {err}", bottle=name, err=str(e))
                self.dropped = True
                continue
            if self.registry.has_bottle(name):
                self.log.warn("persisted bottle {bottle} is shadowed by the config", bottle=name)
                continue
            bottles.append(bottle)
        # A warm pool's member taken just before a crash has two records (``store.replace``):
        # the taken bottle's wins; the member's record goes with the next save.
        homes = {b.home for b in bottles if b.home != b.name}
        for b in [b for b in bottles if b.pool is not None and b.name in homes]:
            self.log.info("warm bottle {home} was taken: its pool's record dropped", home=b.name)
            bottles.remove(b)
        return bottles

    # -- forward-only -------------------------------------------------------------------

    async def _forward_only(self, bottles: list[Bottle]) -> None:
        for bottle in bottles:
            try:
                await self.registry.restore(bottle)
            except BottlenetError as e:
                self.log.error(
                    "persisted bottle {bottle} dropped: {err}", bottle=bottle.name, err=e.message
                )

    # -- VM bottles ---------------------------------------------------------------------

    async def _list_ours(self, expected: bool) -> list[Machine] | None:
        """Our labelled machines; None when smolvm cannot tell (missing, failing)."""
        if self.host is None:
            return None
        try:
            return await self.host.list_ours()
        except VmctlError as e:
            if not expected and e.code == "SMOLVM_UNAVAILABLE":
                # A forward-only daemon without smolvm: nothing to reconcile, nothing wrong.
                self.log.info("no machines to reconcile: {why}", why=e.message)
            else:
                self.log.error("cannot list smolvm machines: {err}", err=e.message)
            return None

    async def _vm_bottles(self, bottles: list[Bottle]) -> None:
        machines = await self._list_ours(expected=bool(bottles))
        await self._stop_unfinished(machines or [])
        by_name = {m.name: m for m in machines or []}
        claimed: set[str] = set()
        for bottle in bottles:
            if self.host is None:
                self.log.error("bottle {bottle}: no smolvm; kept as degraded", bottle=bottle.name)
                await self.registry.restore(evolve(bottle, state=BottleState.DEGRADED))
                continue
            await self._restore(self.host, bottle, by_name if machines is not None else None)
            # kept, or torn down (its machines removed by the teardown): not orphans either way
            claimed |= set(bottle.require_vms().machines)
        if machines is None or self.host is None:
            return
        if self.dropped:
            # A record that could not be read may be the one that claims these machines:
            # the state is not known good, so nothing is deleted as an orphan this time.
            self.log.warn("orphan sweep skipped: a persisted bottle's record was unreadable")
            return
        for m in machines:
            if m.name in claimed or m.labels.get(LABEL_OWNER) != self.registry.instance_id:
                continue
            self.log.warn(
                "deleting orphan machine {name} (ours, claimed by no bottle)", name=m.name
            )
            try:
                await self.host.smolvm.remove(m.name)
            except VmctlError as e:
                self.log.error("could not delete orphan {name}: {err}", name=m.name, err=e.message)

    async def _revoke_left_grants(self) -> None:
        """Volume grants no kept bottle holds (a create or teardown a crash cut short) are
        taken back (``volumegrants``)."""
        if self.host is None:
            return
        kept = {
            b.vms.agent_uid
            for b in self.registry.list_bottles()
            if b.vms is not None and b.vms.agent_uid is not None
        }
        await self.host.revoke_left_grants(kept)

    async def _stop_unfinished(self, machines: list[Machine]) -> None:
        """``stop`` every machine of ours whose record is neither running nor unreachable:
        it kills a VMM that a start cut short left behind (``delete`` would not)."""
        assert self.host is not None or not machines
        for m in machines:
            if m.running or m.unreachable or self.host is None:
                continue
            try:
                await self.host.smolvm.stop(m.name)
            except VmctlError as e:
                self.log.warn("could not stop {name}: {err}", name=m.name, err=e.message)

    async def _restore(
        self, host: VMHost, bottle: Bottle, machines: dict[str, Machine] | None
    ) -> bool:
        """Re-bind a live bottle's endpoints; tear down one that cannot be restored."""
        why = check_alive(host, bottle, machines)
        if why is None:
            try:
                bottle = await rebind(host, bottle)
            except BottlenetError as e:
                why = f"endpoint not restored: {e.message}"
        if why is None:
            await self.registry.restore(bottle)
            self.log.info("bottle {bottle} restored", bottle=bottle.name)
            return True
        self.log.warn("bottle {bottle} torn down at recovery: {why}", bottle=bottle.name, why=why)
        try:
            # Delete only machines smolvm lists with our labels (none when it cannot list;
            # the next start's orphan sweep finds them by label).
            await host.teardown(bottle, listed=machines if machines is not None else {})
        except (BottlenetError, OSError) as e:
            # One bottle's cleanup never stops the daemon's start.
            self.log.error(
                "bottle {bottle}: teardown failed ({err}); kept as degraded",
                bottle=bottle.name,
                err=e.message if isinstance(e, BottlenetError) else e.strerror,
            )
            await self.registry.restore(evolve(bottle, state=BottleState.DEGRADED))
            return True
        return False

    def _remove_unclaimed_dirs(self) -> None:
        """Leftovers and moved-aside trees go (bounded per start; never stops the start)."""
        try:
            names = os.listdir(os.path.join(self.state_dir, BOTTLES))
        except FileNotFoundError:
            return
        except OSError as e:
            self.log.warn("cannot list the bottle directories: {why}", why=e.strerror)
            return
        for n in names:
            if self.registry.claims_dir(n):
                continue
            if not _is_dir(os.path.join(self.state_dir, BOTTLES, n)):
                self.log.warn(
                    "{name} in the bottle directories is not a directory (symlinks are not "
                    "followed); left in place",
                    name=safe_repr(n, 80),
                )
                continue
            self.log.info("removing unclaimed bottle directory {name}", name=safe_repr(n, 80))
            remove_bottle_dir(self.state_dir, n)


def _is_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def aliases_outside(state: State, pool: AliasPool) -> list[str]:
    """Persisted bottles whose alias is not in ``pool`` (``--alias-pool`` changed).

    Recovery could not re-claim those aliases and would tear the bottles down (VMs deleted,
    forwards dropped): the daemon refuses to start instead and names them.
    """
    outside = []
    for name, rec in sorted(state.bottles.items()):
        alias = rec.get("alias") if isinstance(rec, dict) else None
        if not isinstance(alias, str):
            continue
        try:
            pool.parse_alias(alias)
        except InvalidArgument:
            outside.append(f"{safe_repr(name)} ({safe_repr(alias)})")
    return outside


class RecoveryService(Service):
    """Runs :class:`Recovery` once at start, after the config's bottles are bound."""

    log = Logger()

    def __init__(
        self,
        recovery: Recovery,
        after: Deferred[Any] | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.recovery = recovery
        self.after = after
        self.on_fatal = on_fatal
        self.ready: Deferred[None] = Deferred()

    def startService(self) -> None:
        super().startService()
        self.recovery.registry.begin_restore()
        gate: Deferred[None] = Deferred()

        def after_config(result: object) -> object:
            # Recover only once the config's bottles hold their names and aliases; if the
            # config failed the daemon is exiting, and recovery must not run half-way.
            if not isinstance(result, Failure):
                gate.callback(None)
            return result

        if self.after is None:
            gate.callback(None)
        else:
            self.after.addBoth(after_config)
        gate.addCallback(lambda _: Deferred.fromCoroutine(self.recovery.run()))
        gate.addCallbacks(lambda _: self.ready.callback(None), self._failed)

    def _failed(self, failure: Any) -> None:
        # Fail closed: no READY, and the daemon stops with the state file as it was (the
        # final save is skipped), rather than serving half-recovered state.
        self.recovery.registry.end_restore()
        self.log.failure("recovery failed", failure)
        self.ready.errback(failure)
        if self.on_fatal is not None:
            self.on_fatal("recovery failed; the state file was left as it was")

    def stopService(self) -> None:
        super().stopService()
        self.recovery.registry.stop()
