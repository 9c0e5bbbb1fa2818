"""bottlenet's transparent egress layer as the daemon runs it: installed, proven, watched.

A bottle whose spec names ``agent.transparent_egress`` gets, after the launch gate and the
bridge and before the workload, the layer of ``bottlenet.transparent`` in its agent VM, as
root, in an attached exec session (its stdin is its lifeline, as the bridge's): routes and one
nf_tables table by netlink, the listener and the fake-IP resolver. It runs on bottlenet's
guest kit (its ``egress`` subcommand, the kit's loader named directly: no shell, no ``PATH``);
only where no kit could be built is it fed to the image's ``/bin/sh -s`` and ``python3``
(``transparent.script``), as the bridge is. A kernel that lacks a piece
fails the create with the piece named. Once ``ready`` the layer is proven as the second half of
the gate (``bottlenet.probe``'s :class:`LayerPlan`): the proxy service's endpoint is diverted to
a witness, canary dials to reserved addresses and to a name must arrive there as ``CONNECT``,
and UDP and ICMP to the outside must still go nowhere. After that it is kept like the bridge
(``Bridges``' restart with back-off; the bottle degraded with the reason when it gives up).

Each connection the layer makes is reported (``BNE conn TARGET OUTCOME``); the keeper counts
them per outcome and per target, at most :data:`MAX_TARGETS` targets (the rest as ``other``).
Nothing the guest prints is repeated but validated words.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from enum import StrEnum

from attrs import define, field, frozen
from twisted.logger import Logger

from bottlenet.bottles.bridge import BridgeKeeper, Bridges, BridgeSession, BridgeState
from bottlenet.bottles.model import Endpoint
from bottlenet.bottles.owncommand import run_own_command
from bottlenet.bottles.probe import probe_command
from bottlenet.errors import BridgeFailed, EgressLayerFailed
from bottlenet.kit.program import KitRef
from bottlenet.probe.judge import Verdict, judge_layer
from bottlenet.probe.plan import LayerPlan, new_nonce
from bottlenet.probe.witness import ConnectWitness, ConnectWitnessFactory
from bottlenet.transparent.layer import EXIT_FAILED, EXIT_MISSING, LISTEN_PORT
from bottlenet.transparent.nftables import NEEDS
from bottlenet.transparent.script import ARGV, EXIT_NO_TOOL, NO_TOOL, check_proxy_path, render
from vmctl.errors import VmctlError

#: The layer's check (one short exec) may take this long.
CHECK_TIMEOUT = 60.0
#: Distinct targets counted by name; the rest are counted as ``other``.
MAX_TARGETS = 64
OTHER = "other"
_MISSING = re.compile(rb"^BNE missing ([a-z-]{1,20})\r?$", re.MULTILINE)
_FAILED = re.compile(rb"^BNE failed ([a-z]{1,12}) ([A-Z0-9]{1,20})\r?$", re.MULTILINE)
_CONN = re.compile(
    rb"^BNE conn (-|[a-z0-9_.-]{1,253}:[0-9]{1,5}|\[[0-9a-f:.]{2,45}\]:[0-9]{1,5}) "
    rb"(ok|refused|unreachable|loop|unknown)$"
)


class Outcome(StrEnum):
    """What became of one transparent connect (the guest's word, validated)."""

    OK = "ok"  # the proxy answered 2xx: tunnelled
    REFUSED = "refused"  # the proxy said no
    UNREACHABLE = "unreachable"  # the proxy's socket did not answer
    LOOP = "loop"  # a connect made to the listener itself
    UNKNOWN = "unknown"  # a fake address the resolver had forgotten


@frozen
class TransparentCount:
    """One row of ``bottle stats``: a bottle's transparent connects to one target (``other``:
    the targets past the bound), tunnelled, refused by the proxy, or failed."""

    bottle: str
    target: str
    ok: int
    refused: int
    failed: int


@define
class LayerCounters:
    """A bottle's transparent connects: per outcome, and per target (bounded)."""

    outcomes: dict[Outcome, int] = field(factory=lambda: dict.fromkeys(Outcome, 0))
    #: target -> [tunnelled, refused, failed]
    targets: dict[str, list[int]] = field(factory=dict)

    @property
    def total(self) -> int:
        return sum(self.outcomes.values())

    def reset(self) -> None:
        """Forget the gate's canaries: the counts are the agent's own connects."""
        self.outcomes = dict.fromkeys(Outcome, 0)
        self.targets = {}

    def count(self, target: str, outcome: Outcome) -> None:
        self.outcomes[outcome] += 1
        if outcome in (Outcome.LOOP, Outcome.UNKNOWN):
            return
        key = target if target in self.targets or len(self.targets) < MAX_TARGETS else OTHER
        row = self.targets.setdefault(key, [0, 0, 0])
        row[0 if outcome is Outcome.OK else 1 if outcome is Outcome.REFUSED else 2] += 1

    def rows(self, bottle: str) -> list[TransparentCount]:
        return [TransparentCount(bottle, t, *n) for t, n in sorted(self.targets.items())]


class LayerSession(BridgeSession):
    """One attached exec running the layer: ready on ``BNE ready``; each ``BNE conn`` line
    after it counted in ``counters``."""

    READY = re.compile(rb"^BNE ready$", re.MULTILINE)
    MAX_LINE = 300

    def __init__(self, script: bytes, counters: LayerCounters) -> None:
        super().__init__(script)
        self.counters = counters

    def _reports(self, data: bytes) -> None:
        *lines, rest = (self._line + data).split(b"\n")
        self._line = rest if len(rest) <= self.MAX_LINE else b""
        for line in lines:
            m = _CONN.match(line)
            if m:
                self.counters.count(m.group(1).decode(), Outcome(m.group(2).decode()))

    def why_not_ready(self, code: int | None) -> str:
        out = bytes(self._out)
        if code == EXIT_NO_TOOL and out.startswith(NO_TOOL.encode()):
            return "no python3 in the agent image and no guest kit (the layer needs one of them)"
        m = _MISSING.search(out)
        if code == EXIT_MISSING and m and m.group(1).decode() in NEEDS:
            return (
                f"the agent VM's kernel lacks {NEEDS[m.group(1).decode()]}; transparent egress "
                "needs nf_tables with nat and redir built in"
            )
        f = _FAILED.search(out)
        if code == EXIT_FAILED and f:
            return f"its {f.group(1).decode()} step failed ({f.group(2).decode()})"
        return f"it ended before it was ready (exit {code})"


@define
class LayerKeeper(BridgeKeeper):
    """One bottle's layer: the keeper of a bridge (restarts, state) plus its proxy socket
    and its counters."""

    proxy: str = ""
    counters: LayerCounters = field(factory=LayerCounters)


@frozen
class LayerStatus:
    state: BridgeState
    restarts: int
    detail: str
    service: str
    connects: int

    def describe(self) -> str:
        text = f"{self.state.value} (via {self.service}, {self.connects} connects)"
        if self.restarts:
            text += f", restarted {self.restarts}x"
        if self.detail:
            text += f": {self.detail}"
        return text


def proxy_endpoint(endpoints: Sequence[Endpoint], service: str) -> Endpoint:
    """The endpoint of the service ``agent.transparent_egress`` names, with its socket."""
    for e in endpoints:
        if e.service == service and e.guest_path is not None:
            return e
    raise EgressLayerFailed(
        f"transparent egress names {service}, which has no mounted socket in the agent VM"
    )


class Layers(Bridges):
    """The layer service: install and prove a bottle's layer (create), keep it (after)."""

    log = Logger()
    what = "egress layer"

    def _session(self, kept: BridgeKeeper) -> tuple[list[str], BridgeSession]:
        assert isinstance(kept, LayerKeeper)
        argv, stdin = layer_command(kept.proxy, kept.kit)
        return argv, LayerSession(stdin, kept.counters)

    def _keeper(
        self,
        bottle: str,
        agent_vm: str,
        endpoints: Sequence[Endpoint],
        state: BridgeState = BridgeState.STARTING,
    ) -> LayerKeeper:
        """``endpoints``: the proxy service's, whose mounted socket the layer opens. No guest
        port is bridged, so nothing is squared: the layer's own connects are counted."""
        (proxy,) = endpoints
        assert proxy.guest_path is not None
        return LayerKeeper(bottle, agent_vm, [], proxy=proxy.guest_path, state=state)

    async def start_layer(
        self, bottle: str, agent_vm: str, proxy: Endpoint, kit: KitRef | None = None
    ) -> LayerKeeper:
        """Install the layer and wait until it listens (EgressLayerFailed: why not)."""
        try:
            kept = await self.start(bottle, agent_vm, [proxy], kit)
        except BridgeFailed as e:
            raise EgressLayerFailed(e.message) from None
        assert isinstance(kept, LayerKeeper)
        return kept

    async def prove(  # type: ignore[override]
        self,
        bottle: str,
        agent_vm: str,
        proxy: Endpoint,
        outside: str,
        kit: KitRef | None = None,
    ) -> Verdict:
        """The gate's second half: canaries through the layer reach the proxy service's
        endpoint as CONNECT (witnessed here); UDP and ICMP still go nowhere. On the kit the
        check runs the kit's ``probe`` (its digest checked, as the gate's)."""
        plan = LayerPlan(
            nonce=new_nonce(), outside=outside, kit=None if kit is None else kit.digest
        )
        witness = ConnectWitness(plan.connect_target(c) for c in plan.canaries())
        self.table.divert(bottle, proxy.service, ConnectWitnessFactory(self.reactor, witness))
        argv, stdin = probe_command(plan, kit)
        try:
            result = await run_own_command(self.smolvm, agent_vm, argv, stdin, CHECK_TIMEOUT, kit)
        except VmctlError as e:
            raise EgressLayerFailed(
                f"the transparent egress check cannot run in {agent_vm}: {e.message}"
            ) from None
        finally:
            witness.close()
            with contextlib.suppress(Exception):
                self.table.divert(bottle, proxy.service, None)
        verdict = judge_layer(
            plan, result.stdout, exit_code=result.exit_code, connects=witness.seen
        )
        self.log.info(
            "bottle {bottle}: transparent egress check {result}: {detail}",
            bottle=bottle,
            result=verdict.result,
            detail=verdict.describe(),
        )
        return verdict

    def keep_layer(
        self,
        kept: LayerKeeper | None,
        bottle: str,
        agent_vm: str,
        proxy: Endpoint,
        *,
        on_restarted: Callable[[str], None],
        on_failed: Callable[[str], None],
        kit: KitRef | None = None,
    ) -> LayerKeeper:
        """Watch the layer its create started; one not running (after a daemon restart) is
        started again (the rules are replaced whole, the listener bound anew)."""
        keeper = self.keep(
            kept,
            bottle,
            agent_vm,
            [proxy],
            on_restarted=on_restarted,
            on_failed=on_failed,
            kit=kit,
        )
        assert isinstance(keeper, LayerKeeper)
        return keeper


def layer_command(proxy: str, kit: KitRef | None) -> tuple[list[str], bytes]:
    """The layer's guest command and what its session writes first: the kit's ``egress run``
    (one empty line: the session's writer notices the session's end only once it wrote
    something, as the bridge's), or the script on the image's ``/bin/sh -s``."""
    if kit is None:
        return list(ARGV), render(proxy, LISTEN_PORT)
    return kit.argv("egress", *layer_args(proxy)), b"\n"


def layer_args(proxy: str) -> list[str]:
    """The kit's ``egress`` arguments for a layer whose proxy service is mounted at ``proxy``."""
    return ["run", "--proxy", check_proxy_path(proxy), "--port", str(LISTEN_PORT)]


def layer_status(kept: LayerKeeper | None, service: str) -> LayerStatus:
    if kept is None:
        return LayerStatus(BridgeState.STOPPED, 0, "", service, 0)
    return LayerStatus(kept.state, kept.restarts, kept.detail, service, kept.counters.total)
