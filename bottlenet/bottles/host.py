"""The host a VM bottle runs on: one frozen :class:`VMHost` of the parts its steps use.

Built once (``tap.py``: :func:`vm_host`) and handed to every step: a create's
(:mod:`bottlenet.bottles.creation`, one ``Creation`` per create), recovery's
(:mod:`bottlenet.bottles.recovery`: ``check_alive``, ``rebind``) and each bottle's owner
(:mod:`bottlenet.bottles.bottle`: its watch, bridge, verify, egress push and teardown). The
host keeps nothing of any one bottle: what a bottle holds is its owner's.
"""

from __future__ import annotations

import ipaddress
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, ClassVar

from attrs import Factory, define, evolve, field, frozen
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from bottlenet.bottles import egress, readiness, volumeaccess, volumes
from bottlenet.bottles.bottledirs import remove_bottle_dir
from bottlenet.bottles.bridge import Bridges
from bottlenet.bottles.egresslayer import Layers
from bottlenet.bottles.isolation import (
    IsolationPlan,
    choose_isolation,
    guest_socket_path,
)
from bottlenet.bottles.model import (
    LABEL_BOTTLE,
    LABEL_OWNER,
    LABEL_ROLE,
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
    SidecarSpec,
    is_local_image,
)
from bottlenet.bottles.vmerrors import map_vmctl
from bottlenet.bottles.vmmaccess import VmmAccess, read_started_uid
from bottlenet.bottles.volumegrants import GrantBook
from bottlenet.bottles.volumes import Requester, ResolvedVolumes, VolumeRules
from bottlenet.bottles.watch import PidWatcher
from bottlenet.errors import (
    InvalidArgument,
    IsolationFailed,
)
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import (
    ForwardSpec,
    HeldSocket,
    TCPTarget,
    UNIXListen,
    UNIXTarget,
)
from bottlenet.forward.table import ForwardTable
from bottlenet.kit.build import Kit
from bottlenet.kit.keeper import KitKeeper
from bottlenet.probe.judge import Verdict
from bottlenet.waiters import together
from vmctl.errors import VmctlError
from vmctl.ports import (
    Checker,
    SocketChecker,
    check_port_owner,
    check_socket_owner,
)
from vmctl.smolvm import Machine, Smolvm, SmolvmVersion, UidReservation, UidSupply, VmUids
from vmctl.spec import Volume

LOCALHOST = ipaddress.IPv4Address("127.0.0.1")


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
    #: The daemon's own paths and ``--volume-root`` (``volumes.py``).
    volumes: VolumeRules = field(factory=VolumeRules)


@define
class UidReports:
    """Who is told how many per-VM uids are left (the node's report, once it is composed)."""

    listeners: list[Callable[[UidSupply], None]] = field(factory=list)

    def tell(self, supply: UidSupply) -> None:
        for listener in self.listeners:
            listener(supply)


@frozen
class Reserved:
    """A machine's VMM uid as reserved in smolvm's registry (per-VM uids), and a parent of
    the state dir that VMM cannot pass (None: none): what says why its start then fails."""

    reservation: UidReservation
    closed: str | None

    @property
    def uid(self) -> int:
        return self.reservation.uid


def vm_parts(spec: BottleSpec) -> tuple[SidecarSpec, AgentSpec]:
    """The sidecar and agent of a VM bottle's spec (a forward-only spec has neither)."""
    if spec.sidecar is None or spec.agent is None:
        raise InvalidArgument(f"bottle {spec.name}: a forward-only spec has no VMs")
    return spec.sidecar, spec.agent


@frozen
class VMHost:
    """The parts a VM bottle's steps use (smolvm, the forward table, the VMM access, the
    launch gate, the bridges and egress layers, the pid watcher, the volume grants, the guest
    kit's keeper, the state dir, the reactor, the options), and the steps that are the
    host's own: uids, endpoints, verify, egress, teardown.
    ``check_port``, ``check_socket`` and ``service_ready`` are the seams tests inject."""

    log: ClassVar[Logger] = Logger()

    reactor: Any
    smolvm: Smolvm
    table: ForwardTable
    state_dir: str
    options: VMOptions
    access: VmmAccess
    gate: Gate
    bridges: Bridges
    layers: Layers
    watcher: PidWatcher
    #: Runs a blocking call (a guest- or VMM-writable file) off the reactor thread.
    blocking: Callable[..., Any]
    check_port: Checker = check_port_owner
    check_socket: SocketChecker = check_socket_owner
    service_ready: readiness.Answers = readiness.answers
    #: Every volume grant made and not yet taken back (``volumegrants``), in the state dir.
    grants: GrantBook = field(
        default=Factory(lambda self: GrantBook(self.state_dir), takes_self=True)
    )
    #: bottlenet's guest kit (None: none, as ``--guest-kit off``: the image's python3).
    kit: KitKeeper | None = None
    #: Told how many per-VM uids are left after each reservation and retirement.
    uid_reports: UidReports = field(factory=UidReports)

    # -- helpers ----------------------------------------------------------------------

    async def checked_kit(self) -> Kit | None:
        """The guest kit to mount in a new bottle's VMs, checked against its digest (None:
        none can be built here; the image's python3 serves)."""
        return None if self.kit is None else await self.kit.checked()

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

    async def reserve_uid(self, machine: str, volumes: Sequence[str] = ()) -> Reserved | None:
        """Under per-VM uids: the uid ``machine start`` will run ``machine``'s VMM as, written
        into smolvm's registry now (honoured at start), with a parent of the state dir that
        VMM could not pass (to say why a start then fails); None under one uid. ``volumes``:
        the host directories the VMM may write (where its uid's files may outlive it)."""
        if not self.access.per_vm:
            return None
        reserved = await self.smolvm.reserve_uid(machine, volumes)
        await self.count_uids()
        return Reserved(reserved, self.access.closed_ancestor(reserved.registry))

    async def count_uids(self) -> None:
        """Tell ``uid_reports`` how many per-VM uids are left (a failure is logged)."""
        if not self.access.per_vm or not self.uid_reports.listeners:
            return
        try:
            supply = await self.smolvm.uid_supply()
        except VmctlError as e:
            self.log.warn("per-VM uids could not be counted: {err}", err=e.message)
            return
        self.uid_reports.tell(supply)

    async def check_started_uid(self, bottle: str, reserved: Reserved) -> None:
        """After ``machine start``: smolvm's ``.vm-uid`` names the uid reserved for the agent
        VMM. That file is the VMM's own, so it is read as hostile input (``open_regular``, off
        the reactor thread); anything but the reserved uid fails the create. No file at all:
        smolvm dropped no privileges (the fake smolvm's one-uid mode)."""
        try:
            started = await self.blocking(read_started_uid, reserved.reservation.started_file)
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
        self,
        bottle: str,
        service: str,
        guest_port: int,
        behind: str | int,
        listen: UNIXListen,
        home: str | None = None,
    ) -> Endpoint:
        """One agent endpoint (``listen``) relaying to the sidecar service ``behind``: its
        exposed socket in the bottle's directory (pinned: the socket file the sidecar's VM was
        just seen to hold, per connect), else its raw port 127.0.0.1:RAW."""
        target: TCPTarget | UNIXTarget = (
            UNIXTarget(behind, held=HeldSocket.at(behind))
            if isinstance(behind, str)
            else TCPTarget(LOCALHOST, behind)
        )
        await self.table.add(ForwardSpec(bottle, service, listen, target, home=home))
        guest_path = guest_socket_path(service)
        if isinstance(behind, str):
            return SocketEndpoint(service, guest_port, listen.path, guest_path, behind)
        return TCPEndpoint(service, guest_port, listen.path, guest_path, behind)

    async def resolve_volumes(self, agent: AgentSpec, requester: Requester) -> ResolvedVolumes:
        """Before any machine: each volume resolved without following links and checked for
        ``requester`` (``volumes``: InvalidArgument naming the volume and the rule), off the
        reactor thread (a user's directory may sit on a slow filesystem)."""
        found, labels = volumes_of(agent)
        if not found:
            return ResolvedVolumes()
        rules = self.options.volumes
        resolved: ResolvedVolumes = await self.blocking(
            partial(
                volumes.resolve,
                found,
                labels,
                requester,
                # its own state dir always, whatever the daemon's settings add
                evolve(rules, protected=(self.state_dir, *rules.protected)),
                reachable=self.access.per_vm,
            )
        )
        return resolved

    async def revoke_volumes(self, bottle: str, vm: BottleVMs) -> None:
        """Take back the agent VMM's volume grants (its reserved uid, from the bottle's
        record): those ``volumegrants`` holds, or for a bottle recorded before it, the
        ``user:<uid>`` entry on each read-write volume. Never raises (``volumeaccess.revoke``
        logs what it could not do; the record stays for the next try)."""
        uid = vm.agent_uid
        agent = vm.spec.agent
        if not self.access.per_vm or agent is None or uid is None:
            return
        legacy = [v.host for v in volumes_of(agent)[0] if not v.read_only]

        def revoke() -> None:
            grants = self.grants.grants(uid)
            if grants:
                volumeaccess.revoke(grants, self.grants)
            else:
                volumeaccess.revoke_by_path(legacy, uid)

        try:
            await self.blocking(revoke)
        except Exception as e:  # the grant records unreadable: teardown goes on
            self.log.error(
                "bottle {bottle}: volume grants not taken back: {err}",
                bottle=bottle,
                err=getattr(e, "strerror", None) or type(e).__name__,
            )

    async def revoke_left_grants(self, keep: set[int]) -> None:
        """Recovery: take back every recorded grant whose uid no kept bottle holds (a create
        or a teardown a crash cut short)."""

        def revoke() -> None:
            left = [g for g in self.grants.grants() if g.uid not in keep]
            for g in left:
                self.log.warn(
                    "bottle {bottle}: taking back the volume grant a crash left for uid {uid}",
                    bottle=g.bottle,
                    uid=g.uid,
                )
            volumeaccess.revoke(left, self.grants)

        try:
            await self.blocking(revoke)
        except Exception as e:
            self.log.error(
                "volume grants left by a crash not taken back: {err}",
                err=getattr(e, "strerror", None) or type(e).__name__,
            )

    def grant_agent(self, bottle: str, endpoints: Sequence[Endpoint], uid: int) -> None:
        """The agent VMM's uid, and only it (and the daemon), may connect to the endpoints."""
        self.access.grant_endpoints((e.path for e in endpoints), uid)
        self.table.admit_peers(bottle, self.access.peers(uid))

    # -- verify -----------------------------------------------------------------------

    async def verify(self, bottle: Bottle) -> Verdict:
        """The gate again while the workload runs: endpoints are not diverted then."""
        vm = bottle.require_vms()
        sidecar, agent = vm_parts(vm.spec)
        try:
            return await self.gate.check(
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
                kit=vm.kit,
            )
        except VmctlError as e:
            raise map_vmctl(e, bottle.name) from None

    # -- egress -----------------------------------------------------------------------

    async def set_policy(self, bottle: Bottle, hosts: tuple[str, ...]) -> Bottle:
        vm = bottle.require_vms()
        sidecar, _ = vm_parts(vm.spec)
        if sidecar.egress is None:
            raise InvalidArgument(f"bottle {bottle.name}: its sidecar declares no egress policy")
        try:
            await egress.push_policy(
                self.smolvm, vm.sidecar_vm, sidecar.egress, hosts, previous=vm.policy, kit=vm.kit
            )
        except VmctlError as e:
            raise map_vmctl(e, bottle.name) from None
        return evolve(bottle, vms=evolve(vm, policy=hosts))

    # -- teardown -----------------------------------------------------------------------

    async def teardown(
        self, bottle: Bottle, *, listed: Mapping[str, Machine] | None = None
    ) -> None:
        """Listeners and relays, both VMs at once (each stopped, then deleted, so no VMM
        outlives its record, within vmctl's stop and delete timeouts: issue 38), volume
        grants, VM uids, alias or directory; idempotent.

        ``listed`` (recovery): smolvm's listing of our machines. The names come from the
        state file then, so a machine is deleted only if the listing shows it with our owner
        label and this bottle's label; any other is left alone (invariant 9).
        """
        vm = bottle.require_vms()
        await self.table.remove_bottle(bottle.name)
        machines = ((vm.agent_vm, vm.agent_uid), (vm.sidecar_vm, vm.sidecar_uid))
        removed: list[int | None] = []

        async def remove(name: str, uid: int | None) -> None:
            await self.smolvm.remove(name)
            removed.append(uid)

        try:
            await together(
                [remove(name, uid) for name, uid in machines if self._ours(listed, name, bottle)]
            )
        except VmctlError as e:
            raise map_vmctl(e) from None
        await self.revoke_volumes(bottle.name, vm)
        await self.end_uids(bottle.name, removed)
        await self.release(bottle)

    async def end_uids(
        self, bottle: str, uids: Sequence[int | None], *, give_back: bool = False
    ) -> None:
        """Per-VM uids: after the VMs are deleted, end whatever their machines left running
        as their uids (what a compromised VMM left behind), then retire the uids: one is
        given out again only once nothing of it is left (``give_back``, a failed create:
        looked at now). A failure is logged, never raised."""
        if not self.access.per_vm:
            return
        for uid in uids:
            if uid is None:
                continue
            try:
                ended = await self.smolvm.end_uid(uid)
                if ended.spared:
                    self.log.error(
                        "bottle {bottle}: VM uid {uid} is also run by pid(s) {pids}, which show "
                        "no sign of this daemon's smolvm data dir: not killed, and the uid is "
                        "not given out again while they run (docs/operations.md, VM uids)",
                        bottle=bottle,
                        uid=uid,
                        pids=", ".join(str(p) for p in ended.spared[:8]),
                    )
                if ended.left:
                    self.log.error(
                        "bottle {bottle}: {n} process(es) of VM uid {uid} outlived SIGKILL",
                        bottle=bottle,
                        n=len(ended.left),
                        uid=uid,
                    )
                await self.smolvm.retire_uid(uid, give_back)
            except VmctlError as e:
                self.log.error("bottle {bottle}: {err}", bottle=bottle, err=e.message)
        await self.count_uids()

    def _ours(self, listed: Mapping[str, Machine] | None, name: str, bottle: Bottle) -> bool:
        """Whether the teardown removes machine ``name``: always, but after a restart
        (``listed``) only one the listing shows with our labels."""
        if listed is None or self._labelled_ours(listed.get(name), bottle.home):
            return True
        if name in listed:
            self.log.warn(
                "machine {name} of bottle {bottle} lacks our labels: left alone",
                name=name,
                bottle=bottle.name,
            )
        return False

    def _labelled_ours(self, machine: Machine | None, bottle: str) -> bool:
        return (
            machine is not None
            and machine.labels.get(LABEL_OWNER) == self.options.instance_id
            and machine.labels.get(LABEL_BOTTLE) == bottle
        )

    async def release(self, bottle: Bottle) -> None:
        """The bottle's socket directory (its agent endpoints and its sidecar's sockets), off
        the reactor thread; never fails (``bottledirs``: what stays is moved aside)."""
        await self.blocking(remove_bottle_dir, self.state_dir, bottle.home)

    # -- after a restart ----------------------------------------------------------------

    async def list_ours(self) -> list[Machine]:
        """The machines that carry this daemon's owner label (VmctlError when smolvm cannot
        tell: recovery decides what that means)."""
        return await self.smolvm.list(labels={LABEL_OWNER: self.options.instance_id})


def volumes_of(agent: AgentSpec) -> tuple[list[Volume], list[str]]:
    """The agent's volumes and how the spec names each (``agent.volumes[i]``)."""
    volumes = [Volume.parse(v) for v in agent.volumes]
    return volumes, [f"agent.volumes[{i}]" for i in range(len(volumes))]


def runs_bridge(spec: BottleSpec, endpoints: Sequence[Endpoint]) -> bool:
    """bottlenet runs its bridge for the agent's endpoints unless ``agent.bridge = "none"``."""
    return spec.agent is not None and spec.agent.bridge is BridgeMode.BOTTLENET and bool(endpoints)


def vm_host(
    reactor: Any,
    smolvm: Smolvm,
    table: ForwardTable,
    aliases: AliasRegistry,
    *,
    state_dir: str,
    options: VMOptions,
    **seams: Any,
) -> VMHost:
    """The host over ``smolvm`` and ``table``: its gate, bridges, watcher and VMM access made
    here, once; ``seams`` (``check_port``, ``check_socket``, ``service_ready``,
    ``blocking``) replace the real ones in tests."""
    seams.setdefault(
        "blocking",
        lambda fn, *args: deferToThreadPool(reactor, reactor.getThreadPool(), fn, *args),
    )
    return VMHost(
        reactor=reactor,
        smolvm=smolvm,
        table=table,
        state_dir=state_dir,
        options=options,
        access=VmmAccess(state_dir, options.vm_uids),
        gate=Gate(
            reactor, smolvm, table, state_dir=state_dir, settings=options.gate, aliases=aliases
        ),
        bridges=Bridges(reactor, smolvm, table),
        layers=Layers(reactor, smolvm, table),
        watcher=PidWatcher(reactor),
        **seams,
    )
