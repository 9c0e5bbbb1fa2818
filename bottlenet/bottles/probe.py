"""The launch gate as the daemon runs it, around ``bottlenet.probe`` (plan, script, judge).

One run: choose a nonce; plant per-run marker files in the state directory and the daemon
user's home; divert each own endpoint's real listener to a witness (it must see the probe's
nonce, once, during the window; nothing is relayed meanwhile, and no workload runs yet);
send the script on the agent VM's stdin; then restore the relays, remove the markers, look
for the files the guest wrote into read-write volumes, and judge. At ``bottle verify`` time
the agent's workload is running, so the endpoints are not diverted: the guest's word for its
own endpoints is all there is then, and the verdict says so.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import evolve, frozen
from twisted.logger import Logger

from bottlenet.bottles.model import Endpoint, TCPEndpoint
from bottlenet.bottles.owncommand import run_own_command
from bottlenet.bottles.spec import EgressSpec
from bottlenet.bottles.unseen import refused_count, vmm_uid, why_unseen
from bottlenet.errors import InvalidArgument
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import TCPListen
from bottlenet.forward.table import ForwardTable
from bottlenet.kit.program import KitRef
from bottlenet.paths import open_regular
from bottlenet.probe.judge import Verdict, judge
from bottlenet.probe.plan import (
    DEFAULT_DNS_NAME,
    DEFAULT_OUTSIDE,
    WELL_KNOWN_PORTS,
    WELL_KNOWN_UDP_PORTS,
    IsolationMode,
    LayerPlan,
    ProbePlan,
    Target,
    check_guest_path,
    host_id_hash,
    new_nonce,
)
from bottlenet.probe.script import ARGV, kit_request, render
from bottlenet.probe.witness import Witness, WitnessFactory
from vmctl.smolvm import Smolvm
from vmctl.spec import Volume

PROBE_TIMEOUT = 60.0
MARKER_PREFIX = ".bottlenet-gate-marker-"
HOST_ID_FILES = ("/etc/machine-id", "/proc/sys/kernel/hostname")
#: The port of the stand-in "other bottle" address the gate must find closed.
OTHER_BOTTLE_PORT = 443
#: The verdict type under the name the registry and the control plane know.
ProbeVerdict = Verdict


@frozen
class GateSettings:
    """Daemon-wide gate settings. Tests point ``outside``/``dns_name`` at stand-ins."""

    outside: str = DEFAULT_OUTSIDE
    dns_name: str = DEFAULT_DNS_NAME
    #: Ports of the daemon's own host services (TLS control, metrics) and any others.
    host_ports: tuple[int, ...] = ()
    #: UDP ports probed on the same paths besides the well-known ones.
    udp_ports: tuple[int, ...] = ()
    #: Where the home-directory marker goes (None: the daemon user's home).
    home: str | None = None


def own_target(e: Endpoint) -> Target:
    """Where the guest finds an own endpoint: its mounted socket."""
    return Target.parse(f"unix:{e.guest_path}")


def host_ids(nonce: str) -> tuple[str, ...]:
    out = []
    for path in HOST_ID_FILES:
        try:
            with open(path) as fh:
                value = fh.read().strip()
        except OSError:
            continue
        if value:
            out.append(host_id_hash(nonce, value))
    return tuple(out)


def plan_gate(
    endpoints: Sequence[Endpoint],
    *,
    mode: IsolationMode,
    nonce: str,
    other_bottle: str | None,
    settings: GateSettings = GateSettings(),
    absent: Sequence[str] = (),
    volumes: Sequence[Volume] = (),
    witness: bool = True,
    proxy: Endpoint | None = None,
    allow_hosts: Sequence[str] = (),
    bridged: Sequence[int] = (),
    kit: str | None = None,
) -> ProbePlan:
    """Own endpoints; raw ports, the daemon's services and well-known ports on every path to
    the host; another bottle's endpoint; the outside address and DNS; markers; volumes.
    ``bridged``: guest ports bottlenet's bridge serves (open by design once it runs)."""
    # A sidecar on exposed UNIX sockets has no raw port (raw_port 0); only the opt-in has one.
    raw = [e.raw_port for e in endpoints if isinstance(e, TCPEndpoint) and e.raw_port > 0]
    ports = raw + list(settings.host_ports) + list(WELL_KNOWN_PORTS)
    ports = [p for p in ports if p not in bridged]
    deny = [Target.parse(f"tcp:{other_bottle}")] if other_bottle is not None else []
    connect_ok: list[str] = []
    connect_no: list[str] = []
    if proxy is not None:
        literal = [h for h in allow_hosts if not h.startswith("*.")]
        connect_ok = [f"{literal[0]}:443"] if literal else []
        denied = settings.dns_name
        if any(
            denied == h or denied.endswith(h[1:]) for h in allow_hosts if h.startswith("*.")
        ) or (denied in allow_hosts):
            denied = "bottlenet-gate.invalid"
        connect_no = [f"{denied}:443"]
    return ProbePlan(
        mode=mode,
        nonce=nonce,
        own=tuple(own_target(e) for e in endpoints),
        deny=tuple(deny),
        host_ports=tuple(ports),
        udp_ports=settings.udp_ports + WELL_KNOWN_UDP_PORTS,
        outside=settings.outside,
        dns=(settings.dns_name,),
        absent=tuple(absent),
        host_ids=host_ids(nonce),
        ro=tuple(v.guest for v in volumes if v.read_only),
        rw=tuple(v.guest for v in volumes if not v.read_only),
        witness=witness,
        connect_via=None if proxy is None else own_target(proxy),
        connect_ok=tuple(connect_ok),
        connect_no=tuple(connect_no),
        kit=kit,
    )


def probe_command(plan: ProbePlan | LayerPlan, kit: KitRef | None) -> tuple[list[str], bytes]:
    """The guest command and its stdin for one check: the kit's ``probe`` with the plan and
    the kit's digest, or (no kit) the script on the image's ``/bin/sh -s``."""
    if kit is None:
        return list(ARGV), render(plan)
    return kit.argv("probe"), kit_request(plan)


def kit_not_started(code: int, stderr: bytes) -> str:
    """Why bottlenet's kit did not start in a guest (exit 126/127, nothing printed)."""
    machine = os.uname().machine
    why = "exec format error" if b"format error" in stderr.lower() else f"exit {code}"
    return (
        f"bottlenet's guest kit could not start in the guest ({why}): it is built for "
        f"{machine}, this host's architecture, and the guest must be {machine} too"
    )


class Markers:
    """Per-run marker files at host paths the guest must not see (removed on exit)."""

    log = Logger()

    def __init__(self, nonce: str, dirs: Sequence[str]) -> None:
        self.paths: list[str] = []
        for d in dirs:
            path = os.path.join(d, MARKER_PREFIX + nonce)
            try:
                check_guest_path(path)
            except InvalidArgument:
                self.log.warn("no gate marker in {dir}: its path has unusual characters", dir=d)
                continue
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except OSError as e:
                self.log.warn("no gate marker in {dir}: {err}", dir=d, err=e.strerror)
                continue
            os.close(fd)
            self.paths.append(path)

    def remove(self) -> None:
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def collect_rw(
    nonce: str, volumes: Sequence[Volume], dirs: Mapping[str, int] | None = None
) -> set[str]:
    """The rw volumes whose host side holds the guest's file (each file is removed). ``dirs``
    (a create's): per guest path, the descriptor of the directory resolved for it
    (``bottles/volumes.py``), where the file must be: what the VMM served is then proven to
    be that directory, whatever the path names by now."""
    seen = set()
    name = f".bottlenet-gate-{nonce}"
    for v in volumes:
        if v.read_only:
            continue
        dir_fd = None if dirs is None else dirs.get(v.guest)
        path = name if dir_fd is not None else os.path.join(v.host, name)
        try:
            # The guest decides what is at this path: a FIFO must not hang the reactor.
            fd = open_regular(path, dir_fd=dir_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path, dir_fd=dir_fd)
            continue
        try:
            if os.read(fd, 128) == f"{nonce}\n".encode():
                seen.add(v.guest)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path, dir_fd=dir_fd)
    return seen


class Gate:
    """Runs the gate in one agent VM and judges it."""

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        smolvm: Smolvm,
        table: ForwardTable,
        *,
        state_dir: str,
        settings: GateSettings,
        aliases: AliasRegistry | None = None,
    ) -> None:
        self.reactor = reactor
        self.smolvm = smolvm
        self.table = table
        self.state_dir = state_dir
        self.settings = settings
        #: The alias pool, to name an address of another bottle (None: no pool, 127.0.0.2).
        self.aliases = aliases

    def marker_dirs(self) -> list[str]:
        home = self.settings.home or os.path.expanduser("~")
        return [d for d in dict.fromkeys((self.state_dir, home)) if os.path.isdir(d)]

    def other_bottle_target(self, bottle: str) -> str:
        """A live endpoint of another bottle, else an alias of the pool that is not ours."""
        for info in self.table.list():
            if info.spec.bottle != bottle and isinstance(info.bound, TCPListen):
                return info.bound.describe()
        if self.aliases is not None:
            ours = self.aliases.alias_of(bottle)
            for addr in self.aliases.pool.network.hosts():
                if addr != ours:
                    return f"{addr}:{OTHER_BOTTLE_PORT}"
        return f"127.0.0.2:{OTHER_BOTTLE_PORT}"

    async def check(
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
        volume_dirs: Mapping[str, int] | None = None,
        kit: KitRef | None = None,
    ) -> Verdict:
        """The gate for a bottle's spec (``witness``: before any workload, own endpoints
        diverted), against another bottle's address, its verdict logged; ``volume_dirs``: see
        :func:`collect_rw`."""
        plan, verdict = await self.run(
            bottle,
            agent_vm,
            mode,
            endpoints,
            other_bottle=self.other_bottle_target(bottle),
            volumes=[Volume.parse(v) for v in volumes],
            witness=witness,
            proxy=next(
                (e for e in endpoints if egress is not None and e.service == egress.connect_proxy),
                None,
            ),
            allow_hosts=policy,
            bridged=bridged,
            volume_dirs=volume_dirs,
            kit=kit,
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

    async def run(
        self,
        bottle: str,
        agent_vm: str,
        mode: IsolationMode,
        endpoints: Sequence[Endpoint],
        *,
        other_bottle: str | None,
        volumes: Sequence[Volume] = (),
        witness: bool = True,
        proxy: Endpoint | None = None,
        allow_hosts: Sequence[str] = (),
        bridged: Sequence[int] = (),
        volume_dirs: Mapping[str, int] | None = None,
        kit: KitRef | None = None,
    ) -> tuple[ProbePlan, Verdict]:
        """One run (``kit``: the kit the VM has mounted runs it, and must be that kit)."""
        nonce = new_nonce()
        markers = Markers(nonce, self.marker_dirs())
        seen: Witness | None = None
        diverted: list[str] = []
        refused = {e.service: refused_count(self.table, bottle, e.service) for e in endpoints}
        try:
            plan = plan_gate(
                endpoints,
                mode=mode,
                nonce=nonce,
                other_bottle=other_bottle,
                settings=self.settings,
                absent=markers.paths,
                volumes=volumes,
                witness=witness,
                proxy=proxy,
                allow_hosts=allow_hosts,
                bridged=bridged,
                kit=None if kit is None else kit.digest,
            )
            if witness:
                seen = Witness(nonce)
                for e, target in zip(endpoints, plan.own, strict=True):
                    self._divert(bottle, e.service, seen, str(target))
                    diverted.append(e.service)
            argv, stdin = probe_command(plan, kit)
            result = await run_own_command(self.smolvm, agent_vm, argv, stdin, PROBE_TIMEOUT, kit)
        finally:
            if seen is not None:
                seen.close()
            for label in diverted:
                with contextlib.suppress(Exception):
                    self.table.divert(bottle, label, None)
            markers.remove()
        if kit is not None and not result.stdout and result.exit_code in (126, 127):
            return plan, Verdict(False, (kit_not_started(result.exit_code, result.stderr),))
        verdict = judge(
            plan,
            result.stdout,
            exit_code=result.exit_code,
            witnessed=None if seen is None else seen.seen,
            rw_seen=collect_rw(nonce, volumes, volume_dirs),
        )
        if seen is not None and not verdict.passed:
            verdict = self._host_view(bottle, endpoints, plan, seen, refused, verdict)
        return plan, verdict

    def _host_view(
        self,
        bottle: str,
        endpoints: Sequence[Endpoint],
        plan: ProbePlan,
        seen: Witness,
        refused: dict[str, int],
        verdict: Verdict,
    ) -> Verdict:
        """Each own endpoint the host's witness never saw, with the cause the host can see
        (``unseen.py``: a refused VM connect hangs in the guest instead of failing)."""
        uid = vmm_uid(self.table, bottle)
        causes = [
            f"own endpoint {target} ({e.service}): "
            + why_unseen(
                e.path,
                uid,
                refused=refused_count(self.table, bottle, e.service) > refused[e.service],
            )
            for e, target in zip(endpoints, map(str, plan.own), strict=True)
            if target not in seen.seen
        ]
        return evolve(verdict, problems=(*verdict.problems, *causes))

    def _divert(self, bottle: str, label: str, witness: Witness, target: str) -> None:
        divert_to_witness(self.reactor, self.table, bottle, label, witness, target)


def divert_to_witness(
    reactor: Any, table: ForwardTable, bottle: str, label: str, witness: Witness, target: str
) -> None:
    """Hand one endpoint's next connection to ``witness`` (then back to its relay)."""

    def used() -> None:
        with contextlib.suppress(Exception):
            table.divert(bottle, label, None)

    table.divert(bottle, label, WitnessFactory(reactor, witness, target, on_used=used))
