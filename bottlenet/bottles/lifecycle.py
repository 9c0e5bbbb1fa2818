"""The services a VM bottle's operations run on: verify, egress, teardown, and after a restart
``check_alive`` / ``rebind``; the bridge keeper and the pid watcher (each ``VMBottle`` holds its
own sidecar watch).

A create's steps are :mod:`bottlenet.bottles.creation` (one ``Creation`` per create); the
registry (bottle names, one operation at a time, persistence) calls in here.
"""

from __future__ import annotations

import ipaddress
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attrs import evolve, field, frozen
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from bottlenet.bottles import egress, readiness, volumeaccess
from bottlenet.bottles.bottledirs import remove_bottle_dir
from bottlenet.bottles.bridge import Bridges, BridgeState, BridgeStatus
from bottlenet.bottles.isolation import (
    IsolationPlan,
    choose_isolation,
    guest_socket_path,
)
from bottlenet.bottles.model import (
    LABEL_BOTTLE,
    LABEL_OWNER,
    LABEL_ROLE,
    STATE_DEGRADED,
    Bottle,
    BottleVMs,
    Endpoint,
    Role,
    SocketEndpoint,
    TCPEndpoint,
)
from bottlenet.bottles.probe import Gate, GateSettings
from bottlenet.bottles.spec import (
    AgentSpec,
    BottleSpec,
    BridgeMode,
    EgressSpec,
    SidecarSpec,
    is_local_image,
)
from bottlenet.bottles.vmerrors import map_vmctl
from bottlenet.bottles.vmmaccess import VmmAccess, read_started_uid
from bottlenet.bottles.watch import PidWatcher, pid_alive
from bottlenet.errors import (
    BottlenetError,
    InvalidArgument,
    IsolationFailed,
    SmolvmFailed,
)
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import (
    ForwardSpec,
    HeldSocket,
    TCPListen,
    TCPTarget,
    UNIXListen,
    UNIXTarget,
)
from bottlenet.forward.table import ForwardTable
from bottlenet.probe.judge import Verdict
from bottlenet.probe.plan import IsolationMode
from vmctl.errors import VmctlError
from vmctl.ports import (
    Checker,
    Ownership,
    SocketChecker,
    check_port_owner,
    check_socket_owner,
)
from vmctl.smolvm import Machine, Smolvm, SmolvmVersion, UidReservation, VmUids
from vmctl.spec import Volume

LOCALHOST = ipaddress.IPv4Address("127.0.0.1")
#: The port of the stand-in "other bottle" address the gate must find closed.
OTHER_BOTTLE_PORT = 443


@frozen
class VMOptions:
    """Daemon-wide settings for VM bottles."""

    instance_id: str
    skip_probe: bool = False
    platform: str = sys.platform
    #: The launch gate's outside address, DNS name and the daemon's own service ports.
    gate: GateSettings = field(factory=GateSettings)
    allow_unverifiable_ports: bool = False
    #: smolvm's privilege model (``per-VM uids`` as root): who the VMMs run as.
    vm_uids: VmUids = VmUids.ONE
    #: Seconds a new sidecar's services get to answer (``readiness.py``).
    sidecar_ready_timeout: float = readiness.TIMEOUT


def vm_parts(spec: BottleSpec) -> tuple[SidecarSpec, AgentSpec]:
    """The sidecar and agent of a VM bottle's spec (a forward-only spec has neither)."""
    if spec.sidecar is None or spec.agent is None:
        raise InvalidArgument(f"bottle {spec.name}: a forward-only spec has no VMs")
    return spec.sidecar, spec.agent


class VMLifecycle:
    """The VM bottle steps. ``check_port`` is injectable for tests of the ownership step."""

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        smolvm: Smolvm,
        table: ForwardTable,
        aliases: AliasRegistry,
        *,
        state_dir: str,
        options: VMOptions,
        check_port: Checker = check_port_owner,
        check_socket: SocketChecker = check_socket_owner,
        service_ready: readiness.Answers = readiness.answers,
    ) -> None:
        self.reactor = reactor
        self.service_ready = service_ready
        self.smolvm = smolvm
        self.table = table
        self.aliases = aliases
        self.state_dir = state_dir
        self.options = options
        self.check_port = check_port
        self.check_socket = check_socket
        self.watcher = PidWatcher(reactor)
        self.gate = Gate(reactor, smolvm, table, state_dir=state_dir, settings=options.gate)
        self.bridges = Bridges(reactor, smolvm, table)
        self.access = VmmAccess(state_dir, options.vm_uids)
        #: Runs a blocking call (a guest- or VMM-writable file) off the reactor thread.
        self.blocking: Callable[..., Any] = lambda fn, *args: deferToThreadPool(
            reactor, reactor.getThreadPool(), fn, *args
        )
        #: Per machine being started: a parent of the state dir its VMM cannot pass, if any.
        self._closed: dict[str, str | None] = {}

    # -- helpers ----------------------------------------------------------------------

    async def version(self) -> SmolvmVersion:
        try:
            return self.smolvm.known_version or await self.smolvm.version()
        except VmctlError as e:
            raise map_vmctl(e) from None

    def labels(self, bottle: str, role: Role) -> tuple[tuple[str, str], ...]:
        return (
            (LABEL_OWNER, self.options.instance_id),
            (LABEL_BOTTLE, bottle),
            (LABEL_ROLE, role),
        )

    async def reserve_uid(self, machine: str) -> UidReservation | None:
        """Under per-VM uids: the uid ``machine start`` will run ``machine``'s VMM as, written
        into smolvm's registry now (honoured at start); None under one uid. Remembers a
        parent of the state dir the VMM could not pass, to say why a start then fails."""
        if not self.access.per_vm:
            return None
        reserved = await self.smolvm.reserve_uid(machine)
        self._closed[machine] = self.access.closed_ancestor(reserved.registry)
        return reserved

    async def check_started_uid(self, bottle: str, reserved: UidReservation) -> None:
        """After ``machine start``: smolvm's ``.vm-uid`` names the uid reserved for the agent
        VMM. That file is the VMM's own, so it is read as hostile input (``open_regular``, off
        the reactor thread); anything but the reserved uid fails the create. No file at all:
        smolvm dropped no privileges (the fake smolvm's one-uid mode)."""
        try:
            started = await self.blocking(read_started_uid, reserved.started_file)
        except FileNotFoundError:
            return
        except OSError as e:
            raise IsolationFailed(
                f"the agent VM of {bottle}: its .vm-uid is not a readable regular file "
                f"({e.strerror}); bottle torn down"
            ) from None
        if started != reserved.uid:
            raise IsolationFailed(
                f"the agent VM of {bottle} runs as uid {started}, not the uid {reserved.uid} "
                "reserved for it in smolvm's registry; bottle torn down"
            )

    async def plan(self, spec: BottleSpec) -> IsolationPlan:
        _, agent = vm_parts(spec)
        version = await self.version()
        return choose_isolation(
            spec.mode,
            version,
            self.options.platform,
            local_agent_image=is_local_image(agent.image),
        )

    # -- create -----------------------------------------------------------------------

    async def bind_endpoint(
        self, bottle: str, service: str, guest_port: int, behind: str | int, listen: UNIXListen
    ) -> Endpoint:
        """One agent endpoint (``listen``) relaying to the sidecar service ``behind``: its
        exposed socket in the bottle's directory (pinned: the socket file the sidecar's VM was
        just seen to hold, per connect), else its raw port 127.0.0.1:RAW."""
        target: TCPTarget | UNIXTarget = (
            UNIXTarget(behind, held=HeldSocket.at(behind))
            if isinstance(behind, str)
            else TCPTarget(LOCALHOST, behind)
        )
        await self.table.add(ForwardSpec(bottle, service, listen, target))
        guest_path = guest_socket_path(service)
        if isinstance(behind, str):
            return SocketEndpoint(service, guest_port, listen.path, guest_path, behind)
        return TCPEndpoint(service, guest_port, listen.path, guest_path, behind)

    def check_volumes(self, agent: AgentSpec) -> None:
        """Under per-VM uids, before any machine: the agent VM's uid can reach each volume
        (``volumeaccess``: InvalidArgument naming the volume and the fix otherwise)."""
        if self.access.per_vm and agent.volumes:
            volumeaccess.check_reachable(*volumes_of(agent))

    async def _revoke_volumes(self, vm: BottleVMs) -> Callable[[], None]:
        """What revokes the agent VMM's volume grants (its reserved uid, from the bottle's
        record); nothing to do under one uid or without a read-write volume."""
        agent = vm.spec.agent
        if not self.access.per_vm or agent is None:
            return lambda: None
        volumes, _ = volumes_of(agent)
        paths = [v.host for v in volumes if not v.read_only]
        if not paths:
            return lambda: None
        uid = vm.agent_uid  # the uid reserved for it, kept on the bottle's record
        if uid is None:
            return lambda: None
        return lambda: volumeaccess.revoke(paths, uid)

    def grant_agent(self, bottle: str, endpoints: Sequence[Endpoint], uid: int) -> None:
        """The agent VMM's uid, and only it (and the daemon), may connect to the endpoints."""
        self.access.grant_endpoints((e.path for e in endpoints), uid)
        self.table.admit_peers(bottle, self.access.peers(uid))

    def describe_bridge(self, bottle: Bottle) -> str | None:
        """The bridge for ``bottle status`` (None: a forward-only bottle has none)."""
        if bottle.vms is None:
            return None
        ports = [str(e.guest_port) for e in bottle.vms.endpoints if e.guest_path is not None]
        return self.bridge_status(bottle).describe(ports)

    def bridge_status(self, bottle: Bottle) -> BridgeStatus:
        """The bridge as ``bottle status`` shows it (``off`` when the image brings its own)."""
        vm = bottle.require_vms()
        if not runs_bridge(vm.spec, vm.endpoints):
            return BridgeStatus(BridgeState.OFF)
        return self.bridges.status(bottle.name)

    # -- probe --------------------------------------------------------------------------

    def other_bottle_target(self, bottle: str, endpoints: Sequence[Endpoint]) -> str:
        """A live endpoint of another bottle, else an alias of the pool that is not ours."""
        for info in self.table.list():
            if info.spec.bottle != bottle and isinstance(info.bound, TCPListen):
                return info.bound.describe()
        ours = self.aliases.alias_of(bottle)
        for addr in self.aliases.pool.network.hosts():
            if addr != ours:
                return f"{addr}:{OTHER_BOTTLE_PORT}"
        return f"127.0.0.2:{OTHER_BOTTLE_PORT}"

    async def run_probe(
        self,
        bottle: str,
        agent_vm: str,
        mode: IsolationMode,
        endpoints: Sequence[Endpoint],
        *,
        volumes: Sequence[str] = (),
        witness: bool,
        egress: EgressSpec | None = None,
        policy: Sequence[str] = (),
        bridged: Sequence[int] = (),
    ) -> Verdict:
        """The launch gate (``witness``: before any workload, own endpoints diverted)."""
        plan, verdict = await self.gate.run(
            bottle,
            agent_vm,
            mode,
            endpoints,
            other_bottle=self.other_bottle_target(bottle, endpoints),
            volumes=[Volume.parse(v) for v in volumes],
            witness=witness,
            proxy=next(
                (e for e in endpoints if egress is not None and e.service == egress.connect_proxy),
                None,
            ),
            allow_hosts=policy,
            bridged=bridged,
        )
        self.log.info(
            "bottle {bottle}: isolation probe {result} ({n} own, {ports} host ports on every"
            " path): {detail}",
            bottle=bottle,
            result=verdict.result,
            n=len(plan.own),
            ports=len(plan.host_ports),
            detail=verdict.describe(),
        )
        return verdict

    async def verify(self, bottle: Bottle) -> Verdict:
        """The gate again while the workload runs: endpoints are not diverted then."""
        vm = bottle.require_vms()
        sidecar, agent = vm_parts(vm.spec)
        try:
            return await self.run_probe(
                bottle.name,
                vm.agent_vm,
                vm.mode,
                vm.endpoints,
                volumes=agent.volumes,
                witness=False,
                egress=sidecar.egress,
                policy=vm.policy,
                # The bridge serves these guest ports on 127.0.0.1 by design.
                bridged=[e.guest_port for e in vm.endpoints]
                if runs_bridge(vm.spec, vm.endpoints)
                else (),
            )
        except VmctlError as e:
            raise map_vmctl(e) from None

    # -- egress -----------------------------------------------------------------------

    async def set_policy(self, bottle: Bottle, hosts: tuple[str, ...]) -> Bottle:
        vm = bottle.require_vms()
        sidecar, _ = vm_parts(vm.spec)
        if sidecar.egress is None:
            raise InvalidArgument(f"bottle {bottle.name}: its sidecar declares no egress policy")
        try:
            await egress.push_policy(
                self.smolvm, vm.sidecar_vm, sidecar.egress, hosts, previous=vm.policy
            )
        except VmctlError as e:
            raise map_vmctl(e) from None
        return evolve(bottle, vms=evolve(vm, policy=hosts))

    # -- teardown -----------------------------------------------------------------------

    async def remove_machine(self, name: str) -> None:
        """Stop, then ``delete -f`` (no VMM outlives its record); gone already is fine."""
        await self.smolvm.remove(name)

    async def teardown(
        self, bottle: Bottle, *, listed: Mapping[str, Machine] | None = None
    ) -> None:
        """Listeners and relays, agent VM, sidecar VM, alias or directory; idempotent.

        ``listed`` (recovery): smolvm's listing of our machines. The names come from the
        state file then, so a machine is deleted only if the listing shows it with our owner
        label and this bottle's label; any other is left alone (invariant 9).
        """
        vm = bottle.require_vms()
        await self.table.remove_bottle(bottle.name)
        revoke = await self._revoke_volumes(vm)
        removed = []
        try:
            for name, uid in ((vm.agent_vm, vm.agent_uid), (vm.sidecar_vm, vm.sidecar_uid)):
                if listed is not None and not self._labelled_ours(listed.get(name), bottle.name):
                    if name in listed:
                        self.log.warn(
                            "machine {name} of bottle {bottle} lacks our labels: left alone",
                            name=name,
                            bottle=bottle.name,
                        )
                    continue
                await self.remove_machine(name)
                removed.append(uid)
        except VmctlError as e:
            raise map_vmctl(e) from None
        revoke()
        await self.end_uids(bottle.name, removed)
        await self.release(bottle)

    async def end_uids(self, bottle: str, uids: Sequence[int | None]) -> None:
        """Per-VM uids: after the VMs are deleted, end whatever still runs as their uids (what
        a compromised VMM left behind); those uids are never handed out again either. A
        failure is logged, never raised."""
        for uid in uids:
            if uid is None or not self.access.per_vm:
                continue
            try:
                left = await self.smolvm.end_uid(uid)
            except VmctlError as e:
                self.log.error("bottle {bottle}: {err}", bottle=bottle, err=e.message)
                continue
            if left:
                self.log.error(
                    "bottle {bottle}: {n} process(es) of VM uid {uid} outlived SIGKILL",
                    bottle=bottle,
                    n=len(left),
                    uid=uid,
                )

    def _labelled_ours(self, machine: Machine | None, bottle: str) -> bool:
        return (
            machine is not None
            and machine.labels.get(LABEL_OWNER) == self.options.instance_id
            and machine.labels.get(LABEL_BOTTLE) == bottle
        )

    async def release(self, bottle: Bottle) -> None:
        """The bottle's socket directory (its agent endpoints and its sidecar's sockets), off
        the reactor thread; never fails (``bottledirs``: what stays is moved aside)."""
        await self.blocking(remove_bottle_dir, self.state_dir, bottle.name)

    # -- after a restart ----------------------------------------------------------------

    async def list_ours(self) -> list[Machine]:
        """The machines that carry this daemon's owner label (VmctlError when smolvm cannot
        tell: recovery decides what that means)."""
        return await self.smolvm.list(labels={LABEL_OWNER: self.options.instance_id})

    def check_alive(self, bottle: Bottle, machines: Mapping[str, Machine] | None) -> str | None:
        """Why a persisted bottle cannot be kept, or None when its sidecar still runs with
        the recorded pid holding every exposed socket and raw port. ``machines`` is smolvm's
        listing by name (None when smolvm could not list: then the pid alone is checked).
        ``unreachable`` (a live VMM whose agent missed smolvm's 250 ms ping, a busy host)
        with the recorded pid alive is not death."""
        vm = bottle.require_vms()
        if bottle.state == STATE_DEGRADED:
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
        for path in vm.sidecar_sockets:
            sock = self.check_socket(path, vm.sidecar_pid)
            if not sock.owned and not (
                self.options.allow_unverifiable_ports and sock.ownership is Ownership.UNVERIFIABLE
            ):
                return f"a sidecar socket is no longer held by its VM ({sock.ownership.value})"
        for port in vm.raw_ports:
            check = self.check_port(port, vm.sidecar_pid)
            if not check.owned and not (
                self.options.allow_unverifiable_ports and check.ownership is Ownership.UNVERIFIABLE
            ):
                return f"raw port {port} is no longer held by its sidecar ({check.ownership.value})"
        return None

    async def restored_uids(self, bottle: Bottle) -> BottleVMs:
        """Under per-VM uids: the VMM uids the daemon reserved at create, checked against
        smolvm's root-owned registry (a record older than them takes the registry's). Never
        a VMM-writable file: a disagreement fails the bottle (ISOLATION_FAILED)."""
        vm = bottle.require_vms()
        if not self.access.per_vm:
            return vm
        found: dict[Role, int | None] = {}
        for role, machine, kept in (
            (Role.AGENT, vm.agent_vm, vm.agent_uid),
            (Role.SIDECAR, vm.sidecar_vm, vm.sidecar_uid),
        ):
            registered = await self.smolvm.vmm_uid(machine)
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

    async def rebind(self, bottle: Bottle) -> Bottle:
        """Re-bind a persisted bottle's agent endpoints on the same paths, behind the same
        sidecar sockets or raw ports, granted to the agent VMM uid reserved at create.

        Returns the bottle with its uids (an old record gains them). On failure every
        listener it bound is removed again and the typed error raised.
        """
        vm = bottle.require_vms()
        try:
            vm = await self.restored_uids(bottle)
            for e in vm.endpoints:
                behind = e.sidecar_path if isinstance(e, SocketEndpoint) else e.raw_port
                await self.bind_endpoint(
                    bottle.name, e.service, e.guest_port, behind, UNIXListen(e.path)
                )
            self.table.admit_peers(bottle.name, self.access.peers(None))
            if vm.agent_uid is not None:
                self.grant_agent(bottle.name, vm.endpoints, vm.agent_uid)
        except VmctlError as e:
            await self.table.remove_bottle(bottle.name)
            raise map_vmctl(e) from None
        except OSError as e:
            await self.table.remove_bottle(bottle.name)
            raise SmolvmFailed(f"granting the agent VM its endpoints: {e.strerror}") from None
        except BottlenetError:
            await self.table.remove_bottle(bottle.name)
            raise
        return evolve(bottle, vms=vm)


def volumes_of(agent: AgentSpec) -> tuple[list[Volume], list[str]]:
    """The agent's volumes and how the spec names each (``agent.volumes[i]``)."""
    volumes = [Volume.parse(v) for v in agent.volumes]
    return volumes, [f"agent.volumes[{i}]" for i in range(len(volumes))]


def runs_bridge(spec: BottleSpec, endpoints: Sequence[Endpoint]) -> bool:
    """bottlenet runs its bridge for the agent's endpoints unless ``agent.bridge = "none"``."""
    return spec.agent is not None and spec.agent.bridge is BridgeMode.BOTTLENET and bool(endpoints)
