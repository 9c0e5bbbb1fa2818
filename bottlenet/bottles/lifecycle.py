"""Create, verify, re-policy and tear down VM bottles, step by step, each step with its undo.

Create runs, in order: make the bottle's socket directory and its sidecar's (``vmmaccess``
says for whom); create and start the sidecar (its VMM's uid reserved in smolvm's registry
first) with its services exposed as UNIX sockets in its directory (or, opted in, raw published
ports) and verify that its VM process holds them; bind one agent endpoint per service; push
the egress policy; create the agent VM with bottlenet's wait command as its workload (so the
image's own ENTRYPOINT never starts), with the stamped env and no network device; refuse a
packed image that turned the network on; start it; run the launch gate inside it; only then
start the workload (``exec -d``, as the spec's user); record the state. Any failure runs the
undos of the steps done so far, in reverse (every machine is stopped before it is deleted, so
no VMM outlives its record), and surfaces as one typed error (design invariant 6).

The registry (bottle names, one operation at a time, persistence) calls in here; this module
owns no bottle table of its own except the sidecar pid watches.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import stat
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from attrs import evolve, field, frozen
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from bottlenet.bottles import egress, volumeaccess, workload
from bottlenet.bottles.agentenv import stamp_env
from bottlenet.bottles.bridge import Bridges, BridgeState, BridgeStatus
from bottlenet.bottles.isolation import (
    AGENT_WAIT_COMMAND,
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
    machine_name,
)
from bottlenet.bottles.probe import Gate, GateSettings
from bottlenet.bottles.spec import (
    LISTEN_TCP,
    AgentSpec,
    BottleSpec,
    BridgeMode,
    EgressSpec,
    SidecarSpec,
    image_fields,
    is_local_image,
)
from bottlenet.bottles.vmmaccess import VmmAccess
from bottlenet.bottles.watch import PidWatcher, Watch, pid_alive
from bottlenet.bottles.workload import WorkloadState
from bottlenet.errors import (
    BottlenetError,
    InvalidArgument,
    IsolationFailed,
    IsolationUnavailable,
    KvmUnavailable,
    SmolvmFailed,
    SmolvmUnavailable,
    Unavailable,
    safe_repr,
)
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import (
    SIDECAR_DIR,
    ForwardSpec,
    TCPListen,
    TCPTarget,
    UNIXListen,
    UNIXTarget,
    bottle_dir,
    sidecar_dir,
    sidecar_socket_path,
    unix_listen_for,
)
from bottlenet.forward.table import ForwardTable
from bottlenet.probe.judge import ProbeResult, Verdict
from bottlenet.probe.plan import IsolationMode
from vmctl.errors import PortNotOwned, VmctlError
from vmctl.errors import SmolvmFailed as VmSmolvmFailed
from vmctl.ports import (
    Checker,
    Ownership,
    RawPortsResult,
    SocketChecker,
    check_port_owner,
    check_socket_owner,
    start_with_raw_ports,
    start_with_sockets,
)
from vmctl.smolvm import GUEST_ROOT, Features, Machine, Smolvm, SmolvmVersion, VmUids
from vmctl.spec import ExposeSocket, MachineSpec, MountSocket, PortMapping, Volume
from vmctl.uids import UidRegistryError, registry_of, reserve_vm_uid, started_vm_uid

LOCALHOST = ipaddress.IPv4Address("127.0.0.1")
WORKLOAD_TIMEOUT = 60.0
#: A quick guest step (the workload command check).
SETUP_TIMEOUT = 60.0
#: Where sidecar services listen inside the sidecar VM (``listen = "unix"``, the default).
SIDECAR_SOCKET_DIR = "/run/bottlenet"
#: The port of the stand-in "other bottle" address the gate must find closed.
OTHER_BOTTLE_PORT = 443
RAW_PORTS_NOTE = (
    '; sidecar services on raw TCP ports of host 127.0.0.1 (sidecar.listen = "tcp"): '
    "every local user can connect to them"
)


def map_vmctl(e: VmctlError) -> BottlenetError:
    """vmctl's codes onto the control plane's (messages are already sanitised)."""
    if e.code in ("SMOLVM_UNAVAILABLE", "UNSUPPORTED_VERSION"):
        return SmolvmUnavailable(e.message)
    # A budget or argument problem found before smolvm ran is the caller's; the same code
    # reported by smolvm itself (krun -22 at start) is a smolvm failure.
    if e.code in ("INVALID_ARGUMENT", "DEVICE_BUDGET") and not isinstance(e, VmSmolvmFailed):
        return InvalidArgument(e.message)
    if e.code == "UNAVAILABLE":
        return Unavailable(e.message)
    if e.code == "KVM_UNAVAILABLE":
        return KvmUnavailable(e.message)
    # The wire code is SMOLVM_FAILED; vmctl's finer code leads the message unless it is the
    # same word (which once printed "SMOLVM_FAILED: SMOLVM_FAILED: ...").
    if e.code == SmolvmFailed.code:
        return SmolvmFailed(e.message)
    return SmolvmFailed(f"{e.code}: {e.message}")


def sidecar_guest_socket(service: str) -> str:
    """Where the sidecar image must listen for ``service`` (docs/sidecar.md)."""
    return f"{SIDECAR_SOCKET_DIR}/{service}.sock"


def sidecar_machine_spec(
    name: str,
    sidecar: SidecarSpec,
    labels: tuple[tuple[str, str], ...],
    features: Features,
    *,
    sockets: Sequence[ExposeSocket] = (),
    ports: Sequence[PortMapping] = (),
) -> MachineSpec:
    """The sidecar's ``machine create``: outbound network for its egress proxy, with smolvm's
    private-range floor (``--block-private``: no host loopback, LAN or metadata) where the CLI
    has it, and its services as exposed sockets or (opt-in) published ports."""
    fields: dict[str, Any] = {
        **image_fields(sidecar.image),
        "labels": labels,
        "cpus": sidecar.cpus,
        "mem": sidecar.mem,
        "net": True,
        "block_private": features.block_private,
        "expose_sockets": tuple(sockets),
        "ports": tuple(ports),
    }
    return MachineSpec(name, **fields)


def agent_machine_spec(
    name: str,
    agent: AgentSpec,
    labels: tuple[tuple[str, str], ...],
    env: tuple[tuple[str, str], ...],
    endpoints: Sequence[Endpoint],
) -> MachineSpec:
    """The socket-mode agent's ``machine create``: no network device, its endpoints mounted,
    and bottlenet's wait command as the workload (it replaces the image's ENTRYPOINT+CMD)."""
    mounts = tuple(MountSocket(e.path, e.guest_path) for e in endpoints)
    fields: dict[str, Any] = {
        **image_fields(agent.image),
        "labels": labels,
        "cpus": agent.cpus,
        "mem": agent.mem,
        "volumes": tuple(Volume.parse(v) for v in agent.volumes),
        "env": env,
        "mount_sockets": mounts,
        "workload": AGENT_WAIT_COMMAND,
    }
    return MachineSpec(name, net=False, **fields)


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


Undo = tuple[str, Callable[[], Awaitable[None]]]


@frozen
class _Creation:
    """What one create has done so far (a mutable undo list; the value itself is not shared).

    ``sidecar``/``agent`` are the spec's, narrowed once: a VM bottle has both."""

    name: str
    spec: BottleSpec
    sidecar: SidecarSpec
    agent: AgentSpec
    plan: IsolationPlan
    undo: list[Undo] = field(factory=list)


@frozen
class SidecarStarted:
    """Steps 2 + 3: the sidecar machine, its VM process, and per service (in spec order) what
    holds it: its exposed socket's host path, or (the TCP opt-in) its raw port."""

    vm: str
    pid: int
    behind: tuple[str | int, ...]

    @property
    def raw_ports(self) -> bool:
        """The services are on raw TCP ports of host 127.0.0.1 (every local user's)."""
        return any(isinstance(b, int) for b in self.behind)


@frozen
class EndpointsBound:
    """Step 4: one agent endpoint per service, listening."""

    endpoints: tuple[Endpoint, ...]


@frozen
class EgressSet:
    """Step 5: the egress policy pushed into the sidecar (empty: none declared)."""

    policy: tuple[str, ...]


@frozen
class AgentStarted:
    """Step 6: the agent machine, the env stamped into it, and the launch gate's word."""

    vm: str
    env: tuple[tuple[str, str], ...]
    probe: ProbeResult


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
    ) -> None:
        self.reactor = reactor
        self.smolvm = smolvm
        self.table = table
        self.aliases = aliases
        self.state_dir = state_dir
        self.options = options
        self.check_port = check_port
        self.check_socket = check_socket
        self.watcher = PidWatcher(reactor)
        self._watches: dict[str, Watch] = {}
        self.gate = Gate(reactor, smolvm, table, state_dir=state_dir, settings=options.gate)
        self.bridges = Bridges(reactor, smolvm, table)
        self.access = VmmAccess(state_dir, options.vm_uids)
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

    async def reserve_uid(self, machine: str) -> int | None:
        """Under per-VM uids: the uid ``machine start`` will run ``machine``'s VMM as, written
        into smolvm's registry now (honoured at start); None under one uid. Remembers a
        parent of the state dir the VMM could not pass, to say why a start then fails."""
        if not self.access.per_vm:
            return None
        vm_dir = await self.smolvm.data_dir(machine)
        self._closed[machine] = self.access.closed_ancestor(registry_of(vm_dir))
        pool = self.reactor.getThreadPool()
        try:
            uid: int = await deferToThreadPool(self.reactor, pool, reserve_vm_uid, vm_dir)
        except UidRegistryError as e:
            raise SmolvmFailed(f"reserving the VM uid of {machine}: {e}") from None
        return uid

    async def vmm_uid(self, machine: str) -> int | None:
        """The uid a started machine's VMM runs as (its ``.vm-uid``); None: no drop."""
        if not self.access.per_vm:
            return None
        return started_vm_uid(await self.smolvm.data_dir(machine))

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

    async def create(
        self,
        spec: BottleSpec,
        alias: ipaddress.IPv4Address | None,
        commit: Callable[[Bottle], None],
    ) -> Bottle:
        """Run every step; on any failure undo them all and raise one typed error.

        ``alias`` is refused: an alias belongs to forward-only bottles (the agent of a VM
        bottle reaches its endpoints over mounted sockets)."""
        plan = await self.plan(spec)
        if alias is not None:
            raise InvalidArgument(f"--alias only applies to alias mode, this bottle is {plan.mode}")
        c = _Creation(spec.name, spec, *vm_parts(spec), plan)
        self.check_volumes(c.agent)
        try:
            await self.step_allocate(c)
            sidecar = await self.step_sidecar(c)
            bound = await self.step_bind(c, sidecar)
            egress_set = await self.step_egress(c, sidecar)
            agent = await self.step_agent(c, bound, egress_set)
            bottle = self.build(c, sidecar, bound, egress_set, agent)
            await self.step_commit(c, bottle, commit)
        except BaseException as e:
            await self._rollback(c, e)
            if isinstance(e, VmctlError):
                raise map_vmctl(e) from None
            if isinstance(e, OSError):
                raise SmolvmFailed(f"creating bottle {c.name} failed: {e.strerror}") from None
            raise
        vm = bottle.require_vms()
        self.log.info(
            "bottle {bottle} created: mode={mode} sidecar={sidecar} agent={agent}",
            bottle=bottle.name,
            mode=vm.mode,
            sidecar=vm.sidecar_vm,
            agent=vm.agent_vm,
        )
        if vm.probe_skipped:
            self.log.warn(
                "bottle {bottle} was created WITHOUT the isolation probe "
                "(--unsafe-skip-isolation-probe): its isolation is unverified",
                bottle=bottle.name,
            )
        return bottle

    async def _rollback(self, c: _Creation, why: BaseException) -> None:
        code = getattr(why, "code", type(why).__name__)
        self.log.warn(
            "bottle {bottle}: create failed ({code}); rolling back {n} step(s)",
            bottle=c.name,
            code=code,
            n=len(c.undo),
        )
        for what, undo in reversed(c.undo):
            try:
                await undo()
            except Exception as e:
                self.log.warn(
                    "bottle {bottle}: undo of {step} failed: {err}",
                    bottle=c.name,
                    step=what,
                    err=getattr(e, "message", type(e).__name__),
                )

    async def step_allocate(self, c: _Creation) -> None:
        """1. The bottle's own socket directory (its agent endpoints) and the sidecar's inside
        it, 0700 (0701 and per VMM uid under per-VM uids: ``vmmaccess``)."""
        path = bottle_dir(self.state_dir, c.name)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.mkdir(path, 0o700)  # FileExistsError: a leftover; recovery removes those

        async def remove() -> None:
            remove_bottle_dir(path)

        c.undo.append(("directory", remove))
        os.mkdir(sidecar_dir(self.state_dir, c.name), 0o700)
        self.access.open_path(path)

    async def step_sidecar(self, c: _Creation) -> SidecarStarted:
        """2 + 3. The sidecar, its services on exposed UNIX sockets (default) or raw ports
        (opt-in, retried on collisions); either way held by its VM process, verified."""
        name = machine_name(c.name, Role.SIDECAR)
        await self.version()
        features = self.smolvm.features or Features()

        async def remove() -> None:
            await self.remove_machine(name)

        if c.sidecar.listen == LISTEN_TCP:
            raw = await self._start_raw_sidecar(c, name, features)
            c.undo.append(("sidecar", remove))
            return SidecarStarted(name, raw.pid, tuple(raw.ports))
        if not features.expose_socket:
            raise SmolvmUnavailable(
                f"smolvm {self.smolvm.known_version} has no --expose-socket, so sidecar "
                'services cannot be UNIX sockets; upgrade smolvm or set sidecar.listen = "tcp"'
            )
        paths = [sidecar_socket_path(self.state_dir, c.name, s.name) for s in c.sidecar.services]
        sockets = [
            ExposeSocket(sidecar_guest_socket(s.name), p)
            for s, p in zip(c.sidecar.services, paths, strict=True)
        ]
        labels = self.labels(c.name, Role.SIDECAR)
        spec = sidecar_machine_spec(name, c.sidecar, labels, features, sockets=sockets)

        async def hand_over() -> None:
            # Under per-VM uids the VMM prepares its exposed sockets as its own uid.
            uid = await self.reserve_uid(name)
            if uid is not None:
                self.access.hand_sidecar_dir(sidecar_dir(self.state_dir, c.name), uid)

        try:
            started = await start_with_sockets(
                self.smolvm,
                spec,
                check=self.check_socket,
                allow_unverifiable=self.options.allow_unverifiable_ports,
                before_start=hand_over,
            )
        except PortNotOwned:
            closed = self._closed.pop(name, None)
            if closed is None:
                raise
            raise IsolationUnavailable(
                f"the sidecar VM of {c.name} runs as its own uid (smolvm as root) and could not "
                f"reach its socket directory: {safe_repr(closed, 200)} has no o+x (smolvm adds "
                "it only to the parents of its own data dir); chmod o+x it, or keep "
                "--smolvm-data-dir under --state-dir (the default)"
            ) from None
        finally:
            self._closed.pop(name, None)
        c.undo.append(("sidecar", remove))
        return SidecarStarted(name, started.pid, tuple(paths))

    async def _start_raw_sidecar(
        self, c: _Creation, name: str, features: Features
    ) -> RawPortsResult:
        """The sidecar with its services published on raw ports (``sidecar.listen = "tcp"``)."""
        sidecar = c.sidecar
        labels = self.labels(c.name, Role.SIDECAR)

        def make_spec(ports: Sequence[int]) -> MachineSpec:
            mapped = [
                PortMapping(raw, svc.guest_port)
                for raw, svc in zip(ports, sidecar.services, strict=True)
            ]
            return sidecar_machine_spec(name, sidecar, labels, features, ports=mapped)

        return await start_with_raw_ports(
            self.smolvm,
            make_spec,
            len(sidecar.services),
            check=self.check_port,
            allow_unverifiable=self.options.allow_unverifiable_ports,
        )

    async def step_bind(self, c: _Creation, sidecar: SidecarStarted) -> EndpointsBound:
        """4. One agent endpoint per service, relaying to the sidecar's socket (or raw port)."""

        async def unbind() -> None:
            await self.table.remove_bottle(c.name)

        c.undo.append(("endpoints", unbind))
        endpoints = []
        for svc, behind in zip(c.sidecar.services, sidecar.behind, strict=True):
            listen = unix_listen_for(self.state_dir, c.name, svc.name)
            endpoints.append(
                await self.bind_endpoint(c.name, svc.name, svc.guest_port, behind, listen)
            )
        self.table.admit_peers(c.name, self.access.peers(None))
        return EndpointsBound(tuple(endpoints))

    async def bind_endpoint(
        self, bottle: str, service: str, guest_port: int, behind: str | int, listen: UNIXListen
    ) -> Endpoint:
        """One agent endpoint (``listen``) relaying to the sidecar service ``behind``: its
        exposed socket in the bottle's directory, else its raw port 127.0.0.1:RAW."""
        target: TCPTarget | UNIXTarget = (
            UNIXTarget(behind) if isinstance(behind, str) else TCPTarget(LOCALHOST, behind)
        )
        await self.table.add(ForwardSpec(bottle, service, listen, target))
        guest_path = guest_socket_path(service)
        if isinstance(behind, str):
            return SocketEndpoint(service, guest_port, listen.path, guest_path, behind)
        return TCPEndpoint(service, guest_port, listen.path, guest_path, behind)

    async def step_egress(self, c: _Creation, sidecar: SidecarStarted) -> EgressSet:
        """5. The initial egress policy (from the spec), written and reloaded in the sidecar."""
        egress_spec = c.sidecar.egress
        if egress_spec is None:
            return EgressSet(())
        policy = egress_spec.allow_hosts
        await egress.push_policy(self.smolvm, sidecar.vm, egress_spec, policy, previous=None)
        return EgressSet(policy)

    async def step_agent(
        self, c: _Creation, bound: EndpointsBound, egress_set: EgressSet
    ) -> AgentStarted:
        """6. Agent VM: create (bottlenet's wait command), start, gate, then the workload.

        The order is the point: the image's ENTRYPOINT+CMD is replaced by the wait command
        at create, so nothing of the agent's runs before the gate has passed.
        """
        agent = c.agent
        name = machine_name(c.name, Role.AGENT)
        endpoints = bound.endpoints
        env = stamp_env(c.spec, c.plan.mode, endpoints)
        reserved = await self._create_agent(c, name, env, endpoints)
        await self.smolvm.start(name)
        vmm_uid = await self.vmm_uid(name)
        if vmm_uid is not None and vmm_uid != reserved:
            raise IsolationFailed(
                f"the agent VM of {c.name} runs as uid {vmm_uid}, not the uid {reserved} "
                "reserved for it in smolvm's registry; bottle torn down"
            )
        probe = await self.step_gate(c, name, endpoints, egress_set.policy)
        await self.step_bridge(c, name, endpoints)
        if agent.workload:
            await self._start_workload(name, agent, env)
        return AgentStarted(name, env, probe)

    async def _create_agent(
        self,
        c: _Creation,
        name: str,
        env: tuple[tuple[str, str], ...],
        endpoints: Sequence[Endpoint],
    ) -> int | None:
        """6a. ``machine create`` of the agent (its undo registered), its VMM uid reserved and
        granted the endpoints (per-VM uids), and a network-enabling pack refused. Returns the
        reserved uid (None under one uid)."""
        spec = agent_machine_spec(name, c.agent, self.labels(c.name, Role.AGENT), env, endpoints)
        if c.agent.user is not None:
            await self.version()
            features = self.smolvm.features or Features()
            if not features.exec_user:
                raise SmolvmUnavailable(
                    f"smolvm {self.smolvm.known_version} has no exec --user, so agent.user "
                    "cannot be honoured; upgrade smolvm (1.32 has it) or drop agent.user"
                )
        await self.smolvm.create(spec)

        async def remove() -> None:
            await self.remove_machine(name)

        c.undo.append(("agent", remove))
        reserved = await self.reserve_uid(name)
        self._closed.pop(name, None)
        if reserved is not None:
            self.grant_agent(c.name, endpoints, reserved)
            granted = volumeaccess.grant(*_volumes_of(c.agent), reserved)

            async def revoke() -> None:
                volumeaccess.revoke(granted, reserved)

            c.undo.append(("volume access", revoke))
        if spec.from_file is not None:
            # A .smolmachine pack's own `network` flag is ORed in by smolvm at create.
            created = await self.smolvm.status(name)
            if created.network:
                raise IsolationFailed(
                    f"the packed agent image of {c.name} turns on networking (smolvm reports "
                    "network: true for the created machine): socket mode needs an agent VM "
                    "with no network device; rebuild the pack without networking"
                )
        return reserved

    async def _start_workload(
        self, name: str, agent: AgentSpec, env: tuple[tuple[str, str], ...]
    ) -> None:
        """6d. The workload, after the gate: its user known, its command checked (as the
        guest's root), then started detached as its user."""
        user = agent.user or await self._image_user(name, env)
        check = await self.smolvm.exec(
            name,
            workload.prepare_argv(agent.workload, name),
            env=dict(env),
            timeout=SETUP_TIMEOUT,
            user=GUEST_ROOT,
        )
        if check.exit_code == workload.PREPARE_NO_PYTHON:
            raise SmolvmFailed(
                f"starting the workload in {name} failed: its wrapper needs python3 in the "
                f"agent VM (exit {check.exit_code})"
            )
        if check.exit_code == workload.PREPARE_NO_DIR:
            raise SmolvmFailed(
                f"starting the workload in {name} failed: the guest's root cannot create "
                f"{workload.guest_dir(name)} in the agent VM (exit {check.exit_code})"
            )
        if check.exit_code != 0:
            raise SmolvmFailed(
                f"starting the workload in {name} failed: its command is not found"
                f" in the agent VM (exit {check.exit_code})"
            )
        result = await self.smolvm.exec(
            name,
            workload.wrap(agent.workload, name, None if workload.runs_as_root(user) else user),
            env=dict(env),
            detach=True,
            timeout=WORKLOAD_TIMEOUT,
            user=GUEST_ROOT,
        )
        if result.exit_code != 0:
            raise SmolvmFailed(f"starting the workload in {name} failed (exit {result.exit_code})")

    async def _image_user(self, name: str, env: tuple[tuple[str, str], ...]) -> str:
        """The user smolvm runs a command as without ``-u`` (the image's ``USER``), as
        ``uid:gid``: the workload's user when the spec names none."""
        result = await self.smolvm.exec(
            name, list(workload.IMAGE_USER_ARGV), env=dict(env), timeout=SETUP_TIMEOUT
        )
        user = workload.image_user(result.stdout) if result.exit_code == 0 else None
        if user is None:
            raise SmolvmFailed(
                f"starting the workload in {name} failed: the image's user cannot be read "
                f"(`id` as the image's USER: exit {result.exit_code}); set agent.user"
            )
        return user

    def check_volumes(self, agent: AgentSpec) -> None:
        """Under per-VM uids, before any machine: the agent VM's uid can reach each volume
        (``volumeaccess``: InvalidArgument naming the volume and the fix otherwise)."""
        if self.access.per_vm and agent.volumes:
            volumeaccess.check_reachable(*_volumes_of(agent))

    async def _revoke_volumes(self, vm: BottleVMs) -> Callable[[], None]:
        """What revokes the agent VMM's volume grants, its uid read before its machine goes
        (``.vm-uid``); nothing to do under one uid or without a read-write volume."""
        agent = vm.spec.agent
        if not self.access.per_vm or agent is None:
            return lambda: None
        volumes, _ = _volumes_of(agent)
        paths = [v.host for v in volumes if not v.read_only]
        if not paths:
            return lambda: None
        try:
            uid = await self.vmm_uid(vm.agent_vm)
        except VmctlError:
            uid = None
        if uid is None:
            return lambda: None
        return lambda: volumeaccess.revoke(paths, uid)

    def grant_agent(self, bottle: str, endpoints: Sequence[Endpoint], uid: int) -> None:
        """The agent VMM's uid, and only it (and the daemon), may connect to the endpoints."""
        self.access.grant_endpoints((e.path for e in endpoints), uid)
        self.table.admit_peers(bottle, self.access.peers(uid))

    async def step_gate(
        self, c: _Creation, agent_vm: str, endpoints: Sequence[Endpoint], policy: Sequence[str]
    ) -> ProbeResult:
        """6b. The launch gate, between the agent VM's start and its workload."""
        if self.options.skip_probe:
            return ProbeResult.SKIPPED
        verdict = await self.run_probe(
            c.name,
            agent_vm,
            c.plan.mode,
            endpoints,
            volumes=c.agent.volumes,
            witness=True,
            egress=c.sidecar.egress,
            policy=policy,
        )
        if not verdict.passed:
            raise IsolationFailed(
                f"isolation probe failed in {agent_vm}: {verdict.describe()}; bottle torn down"
            )
        return ProbeResult.PASS

    async def step_bridge(self, c: _Creation, agent_vm: str, endpoints: Sequence[Endpoint]) -> None:
        """6c. bottlenet's in-guest bridge, started and proven (each guest 127.0.0.1:<port>
        reaches its endpoint's listener, witnessed here), before the workload."""
        if not runs_bridge(c.spec, endpoints):
            return

        async def stop() -> None:
            self.bridges.stop(c.name)

        c.undo.append(("bridge", stop))
        await self.bridges.start(c.name, agent_vm, endpoints)
        await self.bridges.prove(c.name, agent_vm, endpoints)

    def bridge_status(self, bottle: Bottle) -> BridgeStatus:
        """The bridge as ``bottle status`` shows it (``off`` when the image brings its own)."""
        vm = bottle.require_vms()
        if not runs_bridge(vm.spec, vm.endpoints):
            return BridgeStatus(BridgeState.OFF)
        return self.bridges.status(bottle.name)

    def build(
        self,
        c: _Creation,
        sidecar: SidecarStarted,
        bound: EndpointsBound,
        egress_set: EgressSet,
        agent: AgentStarted,
    ) -> Bottle:
        return Bottle(
            name=c.name,
            alias=None,
            created_at=self.reactor.seconds(),
            vms=BottleVMs(
                spec=c.spec,
                mode=c.plan.mode,
                mechanism=c.plan.describe() + (RAW_PORTS_NOTE if sidecar.raw_ports else ""),
                sidecar_vm=sidecar.vm,
                agent_vm=agent.vm,
                sidecar_pid=sidecar.pid,
                endpoints=bound.endpoints,
                env=agent.env,
                policy=egress_set.policy,
                probe_skipped=self.options.skip_probe,
                probe=agent.probe,
                workload=WorkloadState.RUNNING if c.agent.workload else None,
            ),
        )

    async def step_commit(
        self, c: _Creation, bottle: Bottle, commit: Callable[[Bottle], None]
    ) -> None:
        """7. Record the bottle (the registry writes the state file)."""
        commit(bottle)

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
        self.unwatch(bottle.name)
        await self.table.remove_bottle(bottle.name)
        revoke = await self._revoke_volumes(vm)
        try:
            for name in (vm.agent_vm, vm.sidecar_vm):
                if listed is not None and not self._labelled_ours(listed.get(name), bottle.name):
                    if name in listed:
                        self.log.warn(
                            "machine {name} of bottle {bottle} lacks our labels: left alone",
                            name=name,
                            bottle=bottle.name,
                        )
                    continue
                await self.remove_machine(name)
        except VmctlError as e:
            raise map_vmctl(e) from None
        revoke()
        self.release(bottle)

    def _labelled_ours(self, machine: Machine | None, bottle: str) -> bool:
        return (
            machine is not None
            and machine.labels.get(LABEL_OWNER) == self.options.instance_id
            and machine.labels.get(LABEL_BOTTLE) == bottle
        )

    def release(self, bottle: Bottle) -> None:
        """The bottle's socket directory (its agent endpoints and its sidecar's sockets)."""
        remove_bottle_dir(bottle_dir(self.state_dir, bottle.name))

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

    async def rebind(self, bottle: Bottle) -> None:
        """Re-bind a persisted bottle's agent endpoints on the same paths, behind the same
        sidecar sockets or raw ports.

        On failure every listener it bound is removed again and the typed error raised.
        """
        vm = bottle.require_vms()
        try:
            for e in vm.endpoints:
                behind = e.sidecar_path if isinstance(e, SocketEndpoint) else e.raw_port
                await self.bind_endpoint(
                    bottle.name, e.service, e.guest_port, behind, UNIXListen(e.path)
                )
            self.table.admit_peers(bottle.name, self.access.peers(None))
            uid = await self.vmm_uid(vm.agent_vm)
            if uid is not None:
                self.grant_agent(bottle.name, vm.endpoints, uid)
        except VmctlError as e:
            await self.table.remove_bottle(bottle.name)
            raise map_vmctl(e) from None
        except OSError as e:
            await self.table.remove_bottle(bottle.name)
            raise SmolvmFailed(f"granting the agent VM its endpoints: {e.strerror}") from None
        except BottlenetError:
            await self.table.remove_bottle(bottle.name)
            raise

    # -- sidecar liveness ---------------------------------------------------------------

    def watch(
        self,
        bottle: Bottle,
        on_exit: Callable[[], None],
        on_bridge_restarted: Callable[[str], None] = lambda detail: None,
        on_bridge_failed: Callable[[str], None] = lambda detail: None,
    ) -> None:
        """Watch the sidecar's VM process and keep the bottle's bridge running."""
        w = self._watches.pop(bottle.name, None)
        if w is not None:
            w.cancel()
        vm = bottle.require_vms()
        self._watches[bottle.name] = self.watcher.watch(vm.sidecar_pid, on_exit)
        if runs_bridge(vm.spec, vm.endpoints):
            self.bridges.keep(
                bottle.name,
                vm.agent_vm,
                vm.endpoints,
                on_restarted=on_bridge_restarted,
                on_failed=on_bridge_failed,
            )

    def unwatch(self, name: str) -> None:
        """Stop watching the bottle and end its bridge session."""
        w = self._watches.pop(name, None)
        if w is not None:
            w.cancel()
        self.bridges.stop(name)

    def watched(self) -> frozenset[str]:
        """The bottles whose sidecar VM is watched now."""
        return frozenset(self._watches)

    def unwatch_all(self) -> None:
        for name in list(self._watches):
            self.unwatch(name)


def _volumes_of(agent: AgentSpec) -> tuple[list[Volume], list[str]]:
    """The agent's volumes and how the spec names each (``agent.volumes[i]``)."""
    volumes = [Volume.parse(v) for v in agent.volumes]
    return volumes, [f"agent.volumes[{i}]" for i in range(len(volumes))]


def runs_bridge(spec: BottleSpec, endpoints: Sequence[Endpoint]) -> bool:
    """bottlenet runs its bridge for the agent's endpoints unless ``agent.bridge = "none"``."""
    return spec.agent is not None and spec.agent.bridge is BridgeMode.BOTTLENET and bool(endpoints)


def remove_bottle_dir(path: str) -> None:
    """Remove a bottle's socket directory: its sidecar's socket directory, its sockets, then
    the directory (idempotent).

    Anything that is not a socket is left in place (and the directory with it). A path that
    is not a real directory (a symlink, a regular file) is never followed nor removed.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        Logger().warn(
            "{path} is not a directory (symlinks are not followed); left in place", path=path
        )
        return
    inner = os.path.join(path, SIDECAR_DIR)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(inner).st_mode):
            remove_bottle_dir(inner)
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return
    for n in names:
        p = os.path.join(path, n)
        try:
            if stat.S_ISSOCK(os.lstat(p).st_mode):
                os.unlink(p)
        except FileNotFoundError:
            pass
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        Logger().warn("bottle directory {path} is not empty; left in place", path=path)
