"""Create a VM bottle, step by step, each step with its undo.

Create first makes the bottle's socket directory and its sidecar's (``vmmaccess`` says for
whom). Then its two sides run at once, so a create waits for one boot, not two (issue 38):

* the sidecar's: create and start the sidecar (its VMM's uid reserved in smolvm's registry
  first) with its services exposed as UNIX sockets in its directory (or, opted in, raw
  published ports), verify that its VM process holds them, wait until each service answers,
  bind one agent endpoint per service, push the egress policy;
* the agent's: create the agent VM with bottlenet's wait command as its workload (so the
  image's own ENTRYPOINT never starts), with the stamped env, no network device and the
  endpoints' host paths mounted (bottlenet binds those itself; smolvm connects one only when
  the guest does, and nothing in the guest does before the gate); refuse a packed image that
  turned the network on; start it.

Once both are done: the agent VMM's uid is granted the endpoints, the launch gate runs inside
the agent, then the bridge and the transparent egress layer; only then the workload (``exec
-d``, as the spec's user); the state is recorded. A failure on one side stops the other at its
next step (a step in flight finishes, so nothing it made goes unrecorded). Any failure runs
the undos of the steps done so far, in reverse, the two sides' at once (every machine is
stopped before it is deleted, so no VMM outlives its record), and surfaces as one typed error
(design invariant 6).

One :class:`Creation` per create holds what that create has done; the host
(:class:`~bottlenet.bottles.host.VMHost`) keeps nothing of it.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from attrs import frozen
from twisted.logger import Logger

from bottlenet.bottles import egress, readiness, volumeaccess, workload
from bottlenet.bottles.agentenv import stamp_env
from bottlenet.bottles.bottledirs import remove_bottle_dir
from bottlenet.bottles.bridge import BridgeKeeper
from bottlenet.bottles.egresslayer import LayerKeeper, proxy_endpoint
from bottlenet.bottles.host import (
    Reserved,
    VMHost,
    runs_bridge,
    vm_parts,
)
from bottlenet.bottles.isolation import (
    AGENT_WAIT_COMMAND,
    IsolationPlan,
    guest_socket_path,
)
from bottlenet.bottles.model import (
    AgentSocket,
    Bottle,
    BottleVMs,
    Endpoint,
    Role,
    machine_name,
)
from bottlenet.bottles.spec import (
    LISTEN_TCP,
    AgentSpec,
    BottleSpec,
    SidecarSpec,
    image_fields,
)
from bottlenet.bottles.vmerrors import map_vmctl
from bottlenet.bottles.volumes import Requester, ResolvedVolumes
from bottlenet.bottles.workload import WorkloadState
from bottlenet.errors import (
    EgressLayerFailed,
    InvalidArgument,
    IsolationFailed,
    IsolationUnavailable,
    SmolvmFailed,
    SmolvmUnavailable,
    safe_repr,
)
from bottlenet.forward.spec import (
    bottle_dir,
    sidecar_dir,
    sidecar_socket_path,
    unix_listen_for,
)
from bottlenet.kit.build import Kit
from bottlenet.kit.program import GUEST_DIR, KitRef
from bottlenet.probe.judge import ProbeResult
from bottlenet.waiters import both, together
from vmctl.errors import PortNotOwned, VmctlError
from vmctl.ports import (
    RawPortsResult,
    start_with_raw_ports,
    start_with_sockets,
)
from vmctl.smolvm import Features
from vmctl.spec import (
    PACKED,
    VOLUME,
    ExposeSocket,
    MachineSpec,
    MountSocket,
    PortMapping,
    Volume,
    devices,
)

#: Where sidecar services listen inside the sidecar VM (``listen = "unix"``, the default).
SIDECAR_SOCKET_DIR = "/run/bottlenet"
RAW_PORTS_NOTE = (
    '; sidecar services on raw TCP ports of host 127.0.0.1 (sidecar.listen = "tcp"): '
    "every local user can connect to them"
)


def sidecar_guest_socket(service: str) -> str:
    """Where the sidecar image must listen for ``service`` (docs/sidecar.md)."""
    return f"{SIDECAR_SOCKET_DIR}/{service}.sock"


def sidecar_machine_spec(
    name: str,
    sidecar: SidecarSpec,
    labels: tuple[tuple[str, str], ...],
    *,
    sockets: Sequence[ExposeSocket] = (),
    ports: Sequence[PortMapping] = (),
    kit: Kit | None = None,
) -> MachineSpec:
    """The sidecar's ``machine create``: outbound network for its egress proxy, always with
    smolvm's private-range floor (``--block-private``: no host loopback, LAN or metadata; from
    1.37 a networked machine reaches host loopback by default without it), so a CLI without
    the flag has the create refused (``vmctl.smolvm.Smolvm.create``), never sent without it;
    its services as exposed sockets or (opt-in) published ports; and bottlenet's guest kit
    read-only at its fixed path (it writes the egress policy)."""
    fields: dict[str, Any] = {
        **image_fields(sidecar.image),
        "labels": labels,
        "cpus": sidecar.cpus,
        "mem": sidecar.mem,
        "net": True,
        "block_private": True,
        "expose_sockets": tuple(sockets),
        "ports": tuple(ports),
        "volumes": kit_volumes(kit),
    }
    return MachineSpec(name, **fields)


def kit_volumes(kit: Kit | None) -> tuple[Volume, ...]:
    """The kit's read-only mount at its fixed guest path (none without a kit)."""
    return () if kit is None else (Volume(kit.root, GUEST_DIR, read_only=True),)


def agent_machine_spec(
    name: str,
    agent: AgentSpec,
    labels: tuple[tuple[str, str], ...],
    env: tuple[tuple[str, str], ...],
    endpoints: Sequence[AgentSocket],
    volumes: Sequence[Volume] = (),
    kit: Kit | None = None,
) -> MachineSpec:
    """The socket-mode agent's ``machine create``: no network device, its endpoints mounted,
    its ``volumes`` as resolved at create (``volumes.py``), bottlenet's guest kit read-only at
    its fixed path, and bottlenet's wait command as the workload (it replaces the image's
    ENTRYPOINT+CMD)."""
    mounts = tuple(MountSocket(e.path, e.guest_path) for e in endpoints)
    fields: dict[str, Any] = {
        **image_fields(agent.image),
        "labels": labels,
        "cpus": agent.cpus,
        "mem": agent.mem,
        "volumes": tuple(volumes) + kit_volumes(kit),
        "env": env,
        "mount_sockets": mounts,
        "workload": AGENT_WAIT_COMMAND if kit is None else tuple(kit.program.argv("idle")),
    }
    return MachineSpec(name, net=False, **fields)


def check_agent_devices(
    bottle: str, agent: AgentSpec, volumes: Sequence[Volume], kit: Kit | None, budget: int
) -> None:
    """The agent VM fits smolvm's device budget (each volume, bottlenet's guest kit and a
    local image take one virtio device): checked before any machine exists, the refusal
    names what it counted (InvalidArgument, as vmctl's own check is on the wire)."""
    spec = agent_machine_spec(f"bn-{bottle}-agent", agent, (), (), (), volumes, kit)
    used = devices(spec)
    if len(used) <= budget:
        return
    mine = [guest for kind, guest in used if kind == VOLUME and guest != GUEST_DIR]
    parts = [f"{len(mine)} volume(s) ({', '.join(mine)})"] if mine else []
    parts += [f"bottlenet's guest kit (read-only at {GUEST_DIR})"] if kit is not None else []
    parts += ["its local image (its packed layers)"] if any(k == PACKED for k, _ in used) else []
    room = budget - (len(used) - len(mine))
    raise InvalidArgument(
        f"agent.volumes: the agent VM would need {len(used)} virtio devices, more than "
        f"smolvm's budget of {budget}: {', '.join(parts)}; give it at most {max(room, 0)} "
        'volume(s) (docs/bottles.md, "Device budget")'
    )


Undo = tuple[str, Callable[[], Awaitable[None]]]


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
class AgentBooted:
    """Step 6a: the agent machine, started, the env stamped into it, and its VMM's uid
    (None under one uid)."""

    vm: str
    env: tuple[tuple[str, str], ...]
    reserved: Reserved | None


@frozen
class AgentStarted:
    """Step 6: the agent machine, the env stamped into it, and the launch gate's word."""

    vm: str
    env: tuple[tuple[str, str], ...]
    probe: ProbeResult


class SideStopped(Exception):
    """A side of the create stopped at its next step because the other side failed (never
    raised out of the create: the other side's failure is)."""


class Creation:
    """One create of a VM bottle: its spec, its plan and what it has done so far (the undo
    list); the host's parts (``host``) do each step's work. The data of the bottle's
    ``creating`` state (``bottles.vmbottle``), a ``with`` block around the create: the
    volumes it resolves stay open until the block ends (its owner commits inside it)."""

    log = Logger()
    #: The isolation plan, chosen as :meth:`run` starts (from smolvm's version).
    plan: IsolationPlan

    def __init__(
        self,
        host: VMHost,
        spec: BottleSpec,
        requester: Requester | None = None,
    ) -> None:
        self.host = host
        #: The parts the steps use most, from the host.
        self.smolvm, self.state_dir, self.options = host.smolvm, host.state_dir, host.options
        self.access, self.table = host.access, host.table
        #: Who asks (its volumes are checked for it); None: the daemon itself.
        self.requester = requester or Requester.daemon()
        #: The agent's volumes, resolved at the create's start, open until it ends.
        self.volumes = ResolvedVolumes()
        self.name = spec.name
        self.spec = spec
        #: The spec's sidecar and agent, narrowed once: a VM bottle has both.
        self.sidecar, self.agent = vm_parts(spec)
        #: The undos of the bottle's own steps (its directory; after the sides, the bridge's
        #: and the layer's), and of each side's (``Role``), done at once on a rollback.
        self.undo: list[Undo] = []
        self.side_undo: dict[Role, list[Undo]] = {Role.SIDECAR: [], Role.AGENT: []}
        #: Where the sides began in ``undo`` (its later entries are undone before theirs).
        self.sides_at: int | None = None
        #: The failure that stops the other side at its next step.
        self.stopping: BaseException | None = None
        #: Per role, the VMM uid reserved for it (per-VM uids): kept in the bottle's record.
        self.reserved: dict[Role, Reserved] = {}
        #: The bridge this create started (handed to what the bottle runs once it is made).
        self.bridge: BridgeKeeper | None = None
        #: The transparent egress layer this create started (the same).
        self.layer: LayerKeeper | None = None
        #: bottlenet's guest kit, checked before it is mounted (None: the image's python3).
        self.kit: Kit | None = None

    @property
    def kit_ref(self) -> KitRef | None:
        return None if self.kit is None else self.kit.ref

    def __enter__(self) -> Creation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.volumes.close()

    async def run(self) -> Bottle:
        """Run every step and build the bottle (7., its record, is its owner's: a failure
        there is :meth:`undone` too); on any failure undo them all and raise one typed
        error."""
        self.plan = await self.host.plan(self.spec)
        # Before any machine: nothing to undo yet.
        self.volumes = await self.host.resolve_volumes(self.agent, self.requester)
        try:
            self.kit = await self.host.checked_kit()
            await self.step_features()
            check_agent_devices(
                self.name, self.agent, self.volumes.volumes, self.kit, self.smolvm.device_budget
            )
            await self.step_allocate()
            self.sides_at = len(self.undo)
            (sidecar, bound, egress_set), booted = await both(
                self.sidecar_side(), self.agent_side(), self.stop_sides
            )
            agent = await self.step_agent(booted, bound, egress_set)
            bottle = self.build(sidecar, bound, egress_set, agent)
        except BaseException as e:
            error = await self.undone(e)
            if error is e:
                raise
            raise error from None
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

    async def undone(self, why: BaseException) -> BaseException:
        """Undo every step done, last first; the one typed error ``why`` is raised as (a
        smolvm failure says what became of the bottle; an isolation failure's own message
        already says "bottle torn down")."""
        undone = await self._rollback(why)
        after = "bottle torn down" if undone else "teardown incomplete: see the daemon's log"
        if isinstance(why, VmctlError):
            mapped = map_vmctl(why, self.name)
            return type(mapped)(f"{mapped.message}; {after}")
        if isinstance(why, EgressLayerFailed):
            return EgressLayerFailed(f"{why.message}; {after}")
        if isinstance(why, OSError):
            return SmolvmFailed(f"creating bottle {self.name} failed: {why.strerror}; {after}")
        return why

    async def _rollback(self, why: BaseException) -> bool:
        """Undo every step done, last first; whether every undo succeeded."""
        code = getattr(why, "code", type(why).__name__)
        self.log.warn(
            "bottle {bottle}: create failed ({code}: {why}); rolling back {n} step(s)",
            bottle=self.name,
            code=code,
            # a typed error's message is sanitised where it is made; anything else by type
            why=getattr(why, "message", type(why).__name__),
            n=len(self.undo) + sum(len(u) for u in self.side_undo.values()),
        )
        at = len(self.undo) if self.sides_at is None else self.sides_at
        undone = await self._undo(self.undo[at:])
        sides = [self._undo(undos) for undos in self.side_undo.values()]
        undone = all(await together(sides)) and undone  # the two sides' at once
        undone = await self._undo(self.undo[:at]) and undone
        reserved = [r.uid for r in self.reserved.values()]
        await self.host.end_uids(self.name, reserved, give_back=True)
        return undone

    async def _undo(self, undos: Sequence[Undo]) -> bool:
        """Run ``undos``, last first; whether every one succeeded (a failure is logged)."""
        undone = True
        for what, undo in reversed(undos):
            try:
                await undo()
            except Exception as e:
                undone = False
                self.log.warn(
                    "bottle {bottle}: undo of {step} failed: {err}",
                    bottle=self.name,
                    step=what,
                    err=getattr(e, "message", type(e).__name__),
                )
        return undone

    def stop_sides(self, why: BaseException) -> None:
        """One side failed: the other stops at its next step."""
        self.stopping = why

    def go_on(self) -> None:
        """Between a side's steps: stop here if the other side failed."""
        if self.stopping is not None:
            raise SideStopped()

    async def sidecar_side(self) -> tuple[SidecarStarted, EndpointsBound, EgressSet]:
        """2-5. The sidecar, its services ready, the agent endpoints bound, the egress policy
        pushed (while the agent side runs)."""
        sidecar = await self.step_sidecar()
        self.go_on()
        await self.step_sidecar_ready(sidecar)
        self.go_on()
        bound = await self.step_bind(sidecar)
        self.go_on()
        egress_set = await self.step_egress(sidecar)
        return sidecar, bound, egress_set

    async def agent_side(self) -> AgentBooted:
        """6a. The agent VM created and started (while the sidecar side runs): its mounted
        sockets are the endpoints' host paths, bound by the sidecar side before the gate."""
        name = machine_name(self.name, Role.AGENT)
        sockets = self.agent_sockets()
        env = stamp_env(self.spec, self.plan.mode, sockets)
        reserved = await self._create_agent(name, env, sockets)
        self.go_on()
        await self.smolvm.start(name)
        self.go_on()
        if reserved is not None:
            await self.host.check_started_uid(self.name, reserved)
        return AgentBooted(name, env, reserved)

    def agent_sockets(self) -> tuple[AgentSocket, ...]:
        """Per service, the agent endpoint's host path (bottlenet's listener, bound in step 4)
        and where the agent VM mounts it: known from the spec alone."""
        return tuple(
            AgentSocket(
                svc.name,
                svc.guest_port,
                unix_listen_for(self.state_dir, self.name, svc.name).path,
                guest_socket_path(svc.name),
            )
            for svc in self.sidecar.services
        )

    async def step_features(self) -> None:
        """0. What this spec needs of the CLI (read once per daemon, ``Smolvm.features``), or
        the create is refused before any machine exists."""
        await self.host.version()
        features = self.smolvm.features or Features()
        version = self.smolvm.known_version
        if not features.block_private:
            raise SmolvmUnavailable(
                f"smolvm {version} has no --block-private, the sidecar's egress floor "
                "(without it a networked machine reaches the host's loopback, LAN and cloud "
                "metadata): the sidecar is not created; use smolvm 1.32 or newer"
            )
        if self.sidecar.listen != LISTEN_TCP and not features.expose_socket:
            raise SmolvmUnavailable(
                f"smolvm {version} has no --expose-socket, so sidecar services cannot be "
                'UNIX sockets; upgrade smolvm or set sidecar.listen = "tcp"'
            )
        if self.agent.user is not None and not features.exec_user:
            raise SmolvmUnavailable(
                f"smolvm {version} has no exec --user, so agent.user cannot be honoured; "
                "upgrade smolvm (1.32 has it) or drop agent.user"
            )

    async def step_allocate(self) -> None:
        """1. The bottle's own socket directory (its agent endpoints) and the sidecar's inside
        it, 0700 (0701 and per VMM uid under per-VM uids: ``vmmaccess``)."""
        path = bottle_dir(self.state_dir, self.name)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            # The registry holds the name, so no bottle owns this: a leftover (a cleanup
            # that was cut short, or what a VMM uid left). It goes, whatever is in it.
            self.log.warn("bottle {bottle}: clearing a leftover directory", bottle=self.name)
            await self.host.blocking(remove_bottle_dir, self.state_dir, self.name)
            os.mkdir(path, 0o700)

        async def remove() -> None:
            await self.host.blocking(remove_bottle_dir, self.state_dir, self.name)

        self.undo.append(("directory", remove))
        os.mkdir(sidecar_dir(self.state_dir, self.name), 0o700)
        self.access.open_path(path)

    async def step_sidecar(self) -> SidecarStarted:
        """2 + 3. The sidecar, its services on exposed UNIX sockets (default) or raw ports
        (opt-in, retried on collisions); either way held by its VM process, verified."""
        name = machine_name(self.name, Role.SIDECAR)
        features = self.smolvm.features or Features()

        async def remove() -> None:
            await self.smolvm.remove(name)

        if self.sidecar.listen == LISTEN_TCP:
            raw = await self._start_raw_sidecar(name, features)
            self.side_undo[Role.SIDECAR].append(("sidecar", remove))
            return SidecarStarted(name, raw.pid, tuple(raw.ports))
        paths = [
            sidecar_socket_path(self.state_dir, self.name, s.name) for s in self.sidecar.services
        ]
        sockets = [
            ExposeSocket(sidecar_guest_socket(s.name), p)
            for s, p in zip(self.sidecar.services, paths, strict=True)
        ]
        labels = self.host.labels(self.name, Role.SIDECAR)
        spec = sidecar_machine_spec(name, self.sidecar, labels, sockets=sockets, kit=self.kit)

        async def hand_over() -> None:
            # Under per-VM uids the VMM prepares its exposed sockets as its own uid.
            reserved = await self.host.reserve_uid(name)
            if reserved is not None:
                self.reserved[Role.SIDECAR] = reserved
                self.access.hand_sidecar_dir(sidecar_dir(self.state_dir, self.name), reserved.uid)

        try:
            started = await start_with_sockets(
                self.smolvm,
                spec,
                check=self.host.check_socket,
                allow_unverifiable=self.options.allow_unverifiable_ports,
                before_start=hand_over,
            )
        except PortNotOwned:
            reserved = self.reserved.get(Role.SIDECAR)
            closed = None if reserved is None else reserved.closed
            if closed is None:
                raise
            raise IsolationUnavailable(
                f"the sidecar VM of {self.name} runs as its own uid (smolvm as root) and could not "
                f"reach its socket directory: {safe_repr(closed, 200)} has no o+x (smolvm adds "
                "it only to the parents of its own data dir); chmod o+x it, or keep "
                "--smolvm-data-dir under --state-dir (the default)"
            ) from None
        self.side_undo[Role.SIDECAR].append(("sidecar", remove))
        return SidecarStarted(name, started.pid, tuple(paths))

    async def _start_raw_sidecar(self, name: str, features: Features) -> RawPortsResult:
        """The sidecar with its services published on raw ports (``sidecar.listen = "tcp"``)."""
        sidecar = self.sidecar
        labels = self.host.labels(self.name, Role.SIDECAR)

        def make_spec(ports: Sequence[int]) -> MachineSpec:
            mapped = [
                PortMapping(raw, svc.guest_port)
                for raw, svc in zip(ports, sidecar.services, strict=True)
            ]
            return sidecar_machine_spec(name, sidecar, labels, ports=mapped, kit=self.kit)

        async def reserve() -> None:
            # Per-VM uids: reserved, so smolvm never picks a uid itself (it would reuse one).
            reserved = await self.host.reserve_uid(name)
            if reserved is not None:
                self.reserved[Role.SIDECAR] = reserved

        return await start_with_raw_ports(
            self.smolvm,
            make_spec,
            len(sidecar.services),
            check=self.host.check_port,
            allow_unverifiable=self.options.allow_unverifiable_ports,
            before_start=reserve,
        )

    async def step_sidecar_ready(self, sidecar: SidecarStarted) -> None:
        """3b. Every service answers before the egress reload, the endpoints and the gate
        use it (``readiness.py``: smolvm binds the sockets before the apps listen)."""
        services = [
            (svc.name, behind)
            for svc, behind in zip(self.sidecar.services, sidecar.behind, strict=True)
        ]
        answers = self.host.service_ready

        async def ready(reactor: Any, target: str | int) -> bool:
            self.go_on()  # each try: the wait ends soon after the agent side failed
            return await answers(reactor, target)

        await readiness.wait_ready(
            self.host.reactor,
            services,
            probe=ready,
            timeout=self.options.sidecar_ready_timeout,
        )

    async def step_bind(self, sidecar: SidecarStarted) -> EndpointsBound:
        """4. One agent endpoint per service, relaying to the sidecar's socket (or raw port)."""

        async def unbind() -> None:
            await self.table.remove_bottle(self.name)

        self.side_undo[Role.SIDECAR].append(("endpoints", unbind))
        endpoints = []
        for svc, behind in zip(self.sidecar.services, sidecar.behind, strict=True):
            listen = unix_listen_for(self.state_dir, self.name, svc.name)
            endpoints.append(
                await self.host.bind_endpoint(self.name, svc.name, svc.guest_port, behind, listen)
            )
        self.table.admit_peers(self.name, self.access.peers(None))
        return EndpointsBound(tuple(endpoints))

    async def step_egress(self, sidecar: SidecarStarted) -> EgressSet:
        """5. The initial egress policy (from the spec), written and reloaded in the sidecar."""
        egress_spec = self.sidecar.egress
        if egress_spec is None:
            return EgressSet(())
        policy = egress_spec.allow_hosts
        await egress.push_policy(
            self.smolvm, sidecar.vm, egress_spec, policy, previous=None, kit=self.kit_ref
        )
        return EgressSet(policy)

    async def step_agent(
        self, booted: AgentBooted, bound: EndpointsBound, egress_set: EgressSet
    ) -> AgentStarted:
        """6b-6e. Once both sides are done: the agent VMM's uid granted the endpoints, the
        gate, the bridge, the egress layer, then the workload.

        The order is the point: the image's ENTRYPOINT+CMD is replaced by the wait command
        at create, so nothing of the agent's runs before the gate has passed.
        """
        agent, name, endpoints = self.agent, booted.vm, bound.endpoints
        if booted.reserved is not None:
            self.host.grant_agent(self.name, endpoints, booted.reserved.uid)
        probe = await self.step_gate(name, endpoints, egress_set.policy)
        await self.step_bridge(name, endpoints)
        await self.step_layer(name, endpoints)
        if agent.workload:
            await workload.start(
                self.smolvm, name, agent.workload, agent.user, booted.env, self.kit_ref
            )
        return AgentStarted(name, booted.env, probe)

    async def _create_agent(
        self,
        name: str,
        env: tuple[tuple[str, str], ...],
        endpoints: Sequence[AgentSocket],
    ) -> Reserved | None:
        """6a. ``machine create`` of the agent (its undo registered), its VMM uid reserved and
        granted its volumes (per-VM uids; the endpoints once they are bound, in 6b), and a
        network-enabling pack refused. Returns the reservation (None under one uid)."""
        spec = agent_machine_spec(
            name,
            self.agent,
            self.host.labels(self.name, Role.AGENT),
            env,
            endpoints,
            self.volumes.volumes,
            self.kit,
        )
        await self.smolvm.create(spec)

        async def remove() -> None:
            await self.smolvm.remove(name)

        self.side_undo[Role.AGENT].append(("agent", remove))
        writable = [r.volume.host for r in self.volumes if not r.volume.read_only]
        reserved = await self.host.reserve_uid(name, writable)
        if reserved is not None:
            self.reserved[Role.AGENT] = reserved
            await self.grant_volumes(reserved.uid)
        if spec.from_file is not None:
            # A .smolmachine pack's own `network` flag is ORed in by smolvm at create.
            created = await self.smolvm.status(name)
            if created.network:
                raise IsolationFailed(
                    f"the packed agent image of {self.name} turns on networking (smolvm reports "
                    "network: true for the created machine): socket mode needs an agent VM "
                    "with no network device; rebuild the pack without networking"
                )
        return reserved

    async def grant_volumes(self, uid: int) -> None:
        """The agent VMM's uid may write the read-write volumes (``volumeaccess``: on the
        directories resolved at the start, each grant recorded first), until teardown or this
        create's rollback."""
        book = self.host.grants
        granted = await self.host.blocking(volumeaccess.grant, self.volumes, uid, book, self.name)

        async def revoke() -> None:
            problems = await self.host.blocking(volumeaccess.revoke, granted, book)
            if problems:
                raise IsolationFailed(f"a volume grant was not taken back: {problems[0]}")

        self.side_undo[Role.AGENT].append(("volume access", revoke))

    async def step_gate(
        self, agent_vm: str, endpoints: Sequence[Endpoint], policy: Sequence[str]
    ) -> ProbeResult:
        """6b. The launch gate, between the agent VM's start and its workload."""
        if self.options.skip_probe:
            return ProbeResult.SKIPPED
        verdict = await self.host.gate.check(
            self.name,
            agent_vm,
            self.plan.mode,
            endpoints,
            volumes=self.volumes.specs(),
            volume_dirs={r.volume.guest: r.fd for r in self.volumes if not r.volume.read_only},
            witness=True,
            egress=self.sidecar.egress,
            policy=policy,
            kit=self.kit_ref,
        )
        if not verdict.passed:
            raise IsolationFailed(
                f"isolation probe failed in {agent_vm}: {verdict.describe()}; bottle torn down"
            )
        return ProbeResult.PASS

    async def step_bridge(self, agent_vm: str, endpoints: Sequence[Endpoint]) -> None:
        """6c. bottlenet's in-guest bridge, started and proven (each guest 127.0.0.1:<port>
        reaches its endpoint's listener, witnessed here), before the workload."""
        if not runs_bridge(self.spec, endpoints):
            return

        async def stop() -> None:
            if self.bridge is not None:
                self.bridge.stop()

        self.bridge = await self.host.bridges.start(self.name, agent_vm, endpoints, self.kit_ref)
        self.undo.append(("bridge", stop))
        await self.host.bridges.prove(self.name, agent_vm, endpoints, self.bridge, self.kit_ref)

    async def step_layer(self, agent_vm: str, endpoints: Sequence[Endpoint]) -> None:
        """6d. The transparent egress layer (``agent.transparent_egress``), installed after the
        gate's isolation checks and proven: canaries reach the proxy service as CONNECT."""
        service = self.agent.transparent_egress
        if service is None:
            return
        proxy = proxy_endpoint(endpoints, service)

        async def stop() -> None:
            if self.layer is not None:
                self.layer.stop()

        self.layer = await self.host.layers.start_layer(self.name, agent_vm, proxy, self.kit_ref)
        self.undo.append(("egress layer", stop))
        if self.options.skip_probe:
            return
        verdict = await self.host.layers.prove(
            self.name, agent_vm, proxy, self.host.gate.settings.outside, self.kit_ref
        )
        if not verdict.passed:
            raise IsolationFailed(
                f"transparent egress check failed in {agent_vm}: {verdict.describe()}; "
                "bottle torn down"
            )
        self.layer.counters.reset()

    def _uid(self, role: Role) -> int | None:
        reserved = self.reserved.get(role)
        return None if reserved is None else reserved.uid

    def build(
        self,
        sidecar: SidecarStarted,
        bound: EndpointsBound,
        egress_set: EgressSet,
        agent: AgentStarted,
    ) -> Bottle:
        return Bottle(
            name=self.name,
            alias=None,
            created_at=self.host.reactor.seconds(),
            vms=BottleVMs(
                spec=self.spec,
                mode=self.plan.mode,
                mechanism=self.plan.describe() + (RAW_PORTS_NOTE if sidecar.raw_ports else ""),
                sidecar_vm=sidecar.vm,
                agent_vm=agent.vm,
                sidecar_pid=sidecar.pid,
                endpoints=bound.endpoints,
                env=agent.env,
                policy=egress_set.policy,
                probe_skipped=self.options.skip_probe,
                probe=agent.probe,
                workload=WorkloadState.RUNNING if self.agent.workload else None,
                agent_uid=self._uid(Role.AGENT),
                sidecar_uid=self._uid(Role.SIDECAR),
                kit=self.kit_ref,
            ),
        )
