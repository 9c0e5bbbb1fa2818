"""Create, verify, re-policy and tear down VM bottles, step by step, each step with its undo.

Create runs, in order: allocate the alias (or the 0700 socket directory); create and start the
sidecar with raw published ports and verify that its VM process owns them; bind one agent
endpoint per service; push the egress policy; create and start the agent VM (no workload yet)
with the stamped env and the isolation flags of its mode; run the isolation probe inside it;
launch the workload (``exec -d``); record the state. Any failure runs the undos of the steps
done so far, in reverse, and surfaces as one typed error (design invariant 6).

The registry (bottle names, one operation at a time, persistence) calls in here; this module
owns no bottle table of its own except the sidecar pid watches.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from attrs import evolve, field, frozen
from twisted.logger import Logger

from bottlenet.bottles import egress
from bottlenet.bottles.agentenv import stamp_env
from bottlenet.bottles.isolation import (
    MODE_ALIAS,
    MODE_SOCKET,
    IsolationPlan,
    choose_isolation,
    guest_socket_path,
    iptables_argv,
)
from bottlenet.bottles.model import (
    LABEL_BOTTLE,
    LABEL_OWNER,
    LABEL_ROLE,
    ROLE_AGENT,
    ROLE_SIDECAR,
    STATE_DEGRADED,
    Bottle,
    BottleVMs,
    Endpoint,
    machine_name,
)
from bottlenet.bottles.probe import Gate, GateSettings
from bottlenet.bottles.spec import BottleSpec, EgressSpec, image_fields, is_local_image
from bottlenet.bottles.watch import PidWatcher, Watch, pid_alive
from bottlenet.errors import (
    BottlenetError,
    InvalidArgument,
    IsolationFailed,
    SmolvmFailed,
    SmolvmUnavailable,
    Unavailable,
)
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import (
    ForwardSpec,
    TCPListen,
    TCPTarget,
    UNIXListen,
    bottle_dir,
    unix_listen_for,
)
from bottlenet.forward.table import ForwardTable
from bottlenet.probe.judge import Verdict
from vmctl.errors import NotFound as VmNotFound
from vmctl.errors import SmolvmFailed as VmSmolvmFailed
from vmctl.errors import VmctlError
from vmctl.ports import Checker, Ownership, check_port_owner, start_with_raw_ports
from vmctl.smolvm import Machine, Smolvm, SmolvmVersion
from vmctl.spec import MachineSpec, MountSocket, PortMapping, Volume

LOCALHOST = ipaddress.IPv4Address("127.0.0.1")
WORKLOAD_TIMEOUT = 60.0
SETUP_TIMEOUT = 60.0


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
    return SmolvmFailed(f"{e.code}: {e.message}")


@frozen
class VMOptions:
    """Daemon-wide settings for VM bottles."""

    instance_id: str
    iptables_fallback: bool = False
    skip_probe: bool = False
    platform: str = sys.platform
    #: The launch gate's outside address, DNS name and the daemon's own service ports.
    gate: GateSettings = field(factory=GateSettings)
    allow_unverifiable_ports: bool = False


Undo = tuple[str, Callable[[], Awaitable[None]]]


@frozen
class _Creation:
    """What one create has done so far (mutable lists; the value itself is not shared)."""

    name: str
    spec: BottleSpec
    plan: IsolationPlan
    undo: list[Undo] = field(factory=list)
    facts: dict[str, Any] = field(factory=dict)


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
    ) -> None:
        self.reactor = reactor
        self.smolvm = smolvm
        self.table = table
        self.aliases = aliases
        self.state_dir = state_dir
        self.options = options
        self.check_port = check_port
        self.watcher = PidWatcher(reactor)
        #: The alias fallback's guest rules (tests swap it: the fake smolvm execs on the host).
        self.iptables_argv: Callable[[str], list[str]] = iptables_argv
        self._watches: dict[str, Watch] = {}
        self.gate = Gate(reactor, smolvm, table, state_dir=state_dir, settings=options.gate)

    # -- helpers ----------------------------------------------------------------------

    async def version(self) -> SmolvmVersion:
        try:
            return self.smolvm.known_version or await self.smolvm.version()
        except VmctlError as e:
            raise map_vmctl(e) from None

    def labels(self, bottle: str, role: str) -> tuple[tuple[str, str], ...]:
        return (
            (LABEL_OWNER, self.options.instance_id),
            (LABEL_BOTTLE, bottle),
            (LABEL_ROLE, role),
        )

    async def plan(self, spec: BottleSpec) -> IsolationPlan:
        assert spec.agent is not None
        version = await self.version()
        return choose_isolation(
            spec.mode,
            version,
            self.options.platform,
            iptables_fallback=self.options.iptables_fallback,
            local_agent_image=is_local_image(spec.agent.image),
        )

    # -- create -----------------------------------------------------------------------

    async def create(
        self,
        spec: BottleSpec,
        alias: ipaddress.IPv4Address | None,
        commit: Callable[[Bottle], None],
    ) -> Bottle:
        """Run every step; on any failure undo them all and raise one typed error."""
        plan = await self.plan(spec)
        if alias is not None and plan.mode != MODE_ALIAS:
            raise InvalidArgument(f"--alias only applies to alias mode, this bottle is {plan.mode}")
        c = _Creation(spec.name, spec, plan)
        try:
            await self.step_allocate(c, alias)
            await self.step_sidecar(c)
            await self.step_bind(c)
            await self.step_egress(c)
            await self.step_agent(c)
            bottle = self.build(c)
            await self.step_commit(c, bottle, commit)
        except BaseException as e:
            await self._rollback(c, e)
            if isinstance(e, VmctlError):
                raise map_vmctl(e) from None
            if isinstance(e, OSError):
                raise SmolvmFailed(f"creating bottle {c.name} failed: {e.strerror}") from None
            raise
        vm = bottle.machine()
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

    async def step_allocate(self, c: _Creation, alias: ipaddress.IPv4Address | None) -> None:
        """1. The alias (alias mode) or the bottle's own 0700 socket directory."""
        if c.plan.mode == MODE_ALIAS:
            addr = self.aliases.claim(c.name, None if alias is None else str(alias))
            c.facts["alias"] = str(addr)

            async def release() -> None:
                self.aliases.release(c.name)

            c.undo.append(("alias", release))
            return
        path = bottle_dir(self.state_dir, c.name)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.mkdir(path, 0o700)  # FileExistsError: a leftover; recovery removes those

        async def remove() -> None:
            remove_bottle_dir(path)

        c.undo.append(("directory", remove))

    async def step_sidecar(self, c: _Creation) -> None:
        """2 + 3. Sidecar with raw ports (retried on collisions), ownership verified."""
        sidecar = c.spec.sidecar
        assert sidecar is not None
        name = machine_name(c.name, ROLE_SIDECAR)

        def make_spec(ports: Sequence[int]) -> MachineSpec:
            # (a plain dict: mypy's attrs plugin mistypes converter=tuple fields)
            fields: dict[str, Any] = {
                **image_fields(sidecar.image),
                "labels": self.labels(c.name, ROLE_SIDECAR),
                "cpus": sidecar.cpus,
                "mem": sidecar.mem,
                "ports": tuple(
                    PortMapping(raw, svc.guest_port)
                    for raw, svc in zip(ports, sidecar.services, strict=True)
                ),
            }
            return MachineSpec(name, **fields)

        result = await start_with_raw_ports(
            self.smolvm,
            make_spec,
            len(sidecar.services),
            check=self.check_port,
            allow_unverifiable=self.options.allow_unverifiable_ports,
        )

        async def remove() -> None:
            await self.remove_machine(name)

        c.undo.append(("sidecar", remove))
        c.facts["sidecar_vm"] = name
        c.facts["sidecar_pid"] = result.pid
        c.facts["raw_ports"] = result.ports

    async def step_bind(self, c: _Creation) -> None:
        """4. One agent endpoint per service, targeting 127.0.0.1:RAW."""
        sidecar = c.spec.sidecar
        assert sidecar is not None

        async def unbind() -> None:
            await self.table.remove_bottle(c.name)

        c.undo.append(("endpoints", unbind))
        endpoints = []
        for svc, raw in zip(sidecar.services, c.facts["raw_ports"], strict=True):
            listen: TCPListen | UNIXListen
            if c.plan.mode == MODE_ALIAS:
                listen = TCPListen(ipaddress.IPv4Address(c.facts["alias"]), 0)
            else:
                listen = unix_listen_for(self.state_dir, c.name, svc.name)
            endpoints.append(
                await self.bind_endpoint(c.name, svc.name, svc.guest_port, raw, listen)
            )
        c.facts["endpoints"] = tuple(endpoints)

    async def bind_endpoint(
        self, bottle: str, service: str, guest_port: int, raw: int, listen: TCPListen | UNIXListen
    ) -> Endpoint:
        """One agent endpoint (``listen``) relaying to the sidecar's raw port 127.0.0.1:RAW."""
        info = await self.table.add(ForwardSpec(bottle, service, listen, TCPTarget(LOCALHOST, raw)))
        return endpoint_for(service, guest_port, raw, info.bound)

    async def step_egress(self, c: _Creation) -> None:
        """5. The initial egress policy (from the spec), written and reloaded in the sidecar."""
        sidecar = c.spec.sidecar
        assert sidecar is not None
        policy: tuple[str, ...] = ()
        if sidecar.egress is not None:
            policy = sidecar.egress.allow_hosts
            await egress.push_policy(
                self.smolvm, c.facts["sidecar_vm"], sidecar.egress, policy, previous=None
            )
        c.facts["policy"] = policy

    async def step_agent(self, c: _Creation) -> None:
        """6. Agent VM: create (no workload), start, fallback rules, probe, then the workload."""
        agent = c.spec.agent
        assert agent is not None
        name = machine_name(c.name, ROLE_AGENT)
        endpoints: tuple[Endpoint, ...] = c.facts["endpoints"]
        env = stamp_env(c.spec, c.plan.mode, endpoints)
        c.facts["env"] = env
        spec = self.agent_spec(c, name, env)
        await self.smolvm.create(spec)

        async def remove() -> None:
            await self.remove_machine(name)

        c.undo.append(("agent", remove))
        c.facts["agent_vm"] = name
        await self.smolvm.start(name)
        if c.plan.uses_iptables:
            result = await self.smolvm.exec(
                name, self.iptables_argv(c.facts["alias"]), timeout=SETUP_TIMEOUT
            )
            if result.exit_code != 0:
                raise IsolationFailed(
                    f"installing the guest iptables rules in {name} failed "
                    f"(exit {result.exit_code})"
                )
        if self.options.skip_probe:
            c.facts["probe"] = "skipped"
        else:
            verdict = await self.run_probe(
                c.name,
                name,
                c.plan.mode,
                endpoints,
                volumes=agent.volumes,
                witness=True,
                egress=c.spec.sidecar.egress if c.spec.sidecar is not None else None,
                policy=c.facts["policy"],
            )
            if not verdict.passed:
                raise IsolationFailed(
                    f"isolation probe failed in {name}: {verdict.describe()}; bottle torn down"
                )
            c.facts["probe"] = "PASS"
        if agent.workload:
            result = await self.smolvm.exec(
                name, list(agent.workload), env=dict(env), detach=True, timeout=WORKLOAD_TIMEOUT
            )
            if result.exit_code != 0:
                raise SmolvmFailed(
                    f"starting the workload in {name} failed (exit {result.exit_code})"
                )

    def agent_spec(self, c: _Creation, name: str, env: tuple[tuple[str, str], ...]) -> MachineSpec:
        agent = c.spec.agent
        assert agent is not None
        endpoints: tuple[Endpoint, ...] = c.facts["endpoints"]
        common: dict[str, Any] = {
            **image_fields(agent.image),
            "labels": self.labels(c.name, ROLE_AGENT),
            "cpus": agent.cpus,
            "mem": agent.mem,
            "volumes": [Volume.parse(v) for v in agent.volumes],
            "env": env,
        }
        if c.plan.mode == MODE_SOCKET:
            mounts: list[MountSocket] = []
            for e in endpoints:
                assert e.path is not None and e.guest_path is not None
                mounts.append(MountSocket(e.path, e.guest_path))
            common["mount_sockets"] = tuple(mounts)
            return MachineSpec(name, net=False, **common)
        if c.plan.uses_iptables:
            return MachineSpec(name, net=True, net_backend="tsi", **common)
        common["allow_cidrs"] = (f"{c.facts['alias']}/32",)
        return MachineSpec(name, net=True, **common)

    def build(self, c: _Creation) -> Bottle:
        return Bottle(
            name=c.name,
            alias=c.facts.get("alias"),
            created_at=self.reactor.seconds(),
            vms=BottleVMs(
                spec=c.spec,
                mode=c.plan.mode,
                mechanism=c.plan.describe(c.facts.get("alias")),
                sidecar_vm=c.facts["sidecar_vm"],
                agent_vm=c.facts["agent_vm"],
                sidecar_pid=c.facts["sidecar_pid"],
                endpoints=c.facts["endpoints"],
                env=c.facts["env"],
                policy=c.facts["policy"],
                probe_skipped=self.options.skip_probe,
                probe=c.facts["probe"],
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
        port = next((e.port for e in endpoints if e.port is not None), 443)
        for addr in self.aliases.pool.network.hosts():
            if addr != ours:
                return f"{addr}:{port}"
        return f"127.0.0.2:{port}"

    async def run_probe(
        self,
        bottle: str,
        agent_vm: str,
        mode: str,
        endpoints: Sequence[Endpoint],
        *,
        volumes: Sequence[str] = (),
        witness: bool,
        egress: EgressSpec | None = None,
        policy: Sequence[str] = (),
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
        )
        self.log.info(
            "bottle {bottle}: isolation probe {result} ({n} own, {ports} host ports on every"
            " path): {detail}",
            bottle=bottle,
            result="PASS" if verdict.passed else "FAIL",
            n=len(plan.own),
            ports=len(plan.host_ports),
            detail=verdict.describe(),
        )
        return verdict

    async def verify(self, bottle: Bottle) -> Verdict:
        """The gate again while the workload runs: endpoints are not diverted then."""
        vm = bottle.machine()
        try:
            return await self.run_probe(
                bottle.name,
                vm.agent_vm,
                vm.mode,
                vm.endpoints,
                volumes=vm.spec.agent.volumes if vm.spec.agent is not None else (),
                witness=False,
                egress=vm.spec.sidecar.egress if vm.spec.sidecar is not None else None,
                policy=vm.policy,
            )
        except VmctlError as e:
            raise map_vmctl(e) from None

    # -- egress -----------------------------------------------------------------------

    async def set_policy(self, bottle: Bottle, hosts: tuple[str, ...]) -> Bottle:
        vm = bottle.machine()
        sidecar = vm.spec.sidecar
        assert sidecar is not None
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
        """Stop, then ``delete -f``; a machine smolvm does not know is already gone."""
        try:
            await self.smolvm.stop(name)
        except VmNotFound:
            return
        except VmctlError as e:
            self.log.warn("stop of {name} failed: {err}; deleting anyway", name=name, err=e.message)
        try:
            await self.smolvm.delete(name)
        except VmNotFound:
            pass

    async def teardown(
        self, bottle: Bottle, *, listed: Mapping[str, Machine] | None = None
    ) -> None:
        """Listeners and relays, agent VM, sidecar VM, alias or directory; idempotent.

        ``listed`` (recovery): smolvm's listing of our machines. The names come from the
        state file then, so a machine is deleted only if the listing shows it with our owner
        label and this bottle's label; any other is left alone (invariant 9).
        """
        vm = bottle.machine()
        self.unwatch(bottle.name)
        await self.table.remove_bottle(bottle.name)
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
        self.release(bottle)

    def _labelled_ours(self, machine: Machine | None, bottle: str) -> bool:
        return (
            machine is not None
            and machine.labels.get(LABEL_OWNER) == self.options.instance_id
            and machine.labels.get(LABEL_BOTTLE) == bottle
        )

    def release(self, bottle: Bottle) -> None:
        if bottle.machine().mode == MODE_ALIAS:
            self.aliases.release(bottle.name)
        else:
            remove_bottle_dir(bottle_dir(self.state_dir, bottle.name))

    # -- after a restart ----------------------------------------------------------------

    async def list_ours(self) -> list[Machine]:
        """The machines that carry this daemon's owner label (VmctlError when smolvm cannot
        tell: recovery decides what that means)."""
        return await self.smolvm.list(labels={LABEL_OWNER: self.options.instance_id})

    def check_alive(self, bottle: Bottle, machines: Mapping[str, Machine] | None) -> str | None:
        """Why a persisted bottle cannot be kept, or None when its sidecar still runs with
        the recorded pid holding every raw port. ``machines`` is smolvm's listing by name
        (None when smolvm could not list: then the pid alone is checked)."""
        vm = bottle.machine()
        if bottle.state == STATE_DEGRADED:
            return "it was degraded"
        if machines is None:
            alive = pid_alive(vm.sidecar_pid)
        else:
            m = machines.get(vm.sidecar_vm)
            alive = m is not None and m.running and m.pid == vm.sidecar_pid
        if not alive:
            return "its sidecar VM is gone"
        for port in vm.raw_ports:
            check = self.check_port(port, vm.sidecar_pid)
            if not check.owned and not (
                self.options.allow_unverifiable_ports and check.ownership is Ownership.UNVERIFIABLE
            ):
                return f"raw port {port} is no longer held by its sidecar ({check.ownership.value})"
        return None

    async def rebind(self, bottle: Bottle) -> None:
        """Re-bind a persisted bottle's agent endpoints on the same alias, ports and paths.

        On failure every listener it bound is removed again and the typed error raised (the
        alias stays claimed: :meth:`teardown` releases it).
        """
        vm = bottle.machine()
        try:
            if vm.mode == MODE_ALIAS:
                assert bottle.alias is not None
                self.aliases.claim(bottle.name, bottle.alias)
            for e in vm.endpoints:
                listen: TCPListen | UNIXListen
                if e.host is not None:
                    alias = self.aliases.alias_of(bottle.name)
                    assert alias is not None and e.port is not None
                    listen = TCPListen(alias, e.port)
                else:
                    assert e.path is not None
                    listen = UNIXListen(e.path)
                await self.bind_endpoint(bottle.name, e.service, e.guest_port, e.raw_port, listen)
        except BottlenetError:
            await self.table.remove_bottle(bottle.name)
            raise

    # -- sidecar liveness ---------------------------------------------------------------

    def watch(self, bottle: Bottle, on_exit: Callable[[], None]) -> None:
        self.unwatch(bottle.name)
        self._watches[bottle.name] = self.watcher.watch(bottle.machine().sidecar_pid, on_exit)

    def unwatch(self, name: str) -> None:
        w = self._watches.pop(name, None)
        if w is not None:
            w.cancel()

    def unwatch_all(self) -> None:
        for name in list(self._watches):
            self.unwatch(name)


def endpoint_for(
    service: str, guest_port: int, raw: int, bound: TCPListen | UNIXListen
) -> Endpoint:
    if isinstance(bound, TCPListen):
        return Endpoint(service, guest_port, raw, host=str(bound.alias), port=bound.port)
    return Endpoint(
        service, guest_port, raw, path=bound.path, guest_path=guest_socket_path(service)
    )


def remove_bottle_dir(path: str) -> None:
    """Remove a bottle's socket directory: its sockets, then the directory (idempotent).

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
