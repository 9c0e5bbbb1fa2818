"""bottlenet's in-guest bridge as the daemon runs it: started, proven, watched, restarted.

After the launch gate passes and before the workload starts, the bridge script
(``bottlenet.bridge``) is fed on stdin to ``/bin/sh -s`` in an attached ``machine exec``
session; the session *is* the bridge's liveness (the bridge ends when its stdin does, and
vmctl's session wrapper ends its process group when the session's pipes go: smolvm itself
kills only ``crun exec``; the session ends when the command does). The start waits for the
bridge's ``ready`` line, then proves it: each endpoint's listener is diverted to a witness
and a second, short exec sends a witness line through every guest ``127.0.0.1:<port>``; all
must be seen on the host. A bridge that dies later is restarted with back-off and
``on_restarted`` is told; after :data:`MAX_FAILURES` deaths in a row (a run shorter than
:data:`STABLE_SECONDS` counts as one) ``on_failed`` is told the reason and nothing is
restarted any more. Nothing the guest prints is repeated but validated words.

A bridged connection the host never sees (issue 27 item 3): a real VM confirms the guest's
connect to a mounted socket even when its VMM could not connect the host side, and the
client then waits forever. The bridge reports each connection it makes (``BNB conn <port>``);
:data:`CHECK_AFTER` seconds after a report the daemon compares the reports with the
connections the endpoint's listener saw (accepted or refused), and when some never arrived
it logs why (``unseen.py``: the endpoint, and the grant the host can check) and tells the
bridge ``down <port>``: that port's connections with no answer yet end, their clients get
EOF. Direct connections to the socket only add to the host's count, so a missed connection
may go unnoticed, never a healthy one closed.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any

from attrs import define, field, frozen
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.interfaces import IDelayedCall, IProcessTransport
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from bottlenet.bottles.model import Endpoint
from bottlenet.bottles.owncommand import run_own_command
from bottlenet.bottles.probe import divert_to_witness
from bottlenet.bottles.unseen import refused_count, seen_count, vmm_uid, why_unseen
from bottlenet.bottles.vmloss import lost_reason
from bottlenet.bridge.script import (
    ARGV,
    EXIT_BIND,
    EXIT_NO_TOOL,
    NO_TOOL,
    Bridge,
    bridge_args,
    reach_endpoint,
    reach_request,
    render,
    render_reach,
)
from bottlenet.errors import BridgeFailed
from bottlenet.forward.table import ForwardTable
from bottlenet.kit.program import KitRef, kit_session
from bottlenet.probe.plan import new_nonce
from bottlenet.probe.witness import Witness
from vmctl.errors import VmctlError
from vmctl.smolvm import GUEST_ROOT, Smolvm

#: How long a (re)start may take to print ``ready``.
START_TIMEOUT = 30.0
#: The reach check's budget (one short exec).
REACH_TIMEOUT = 30.0
#: Deaths in a row before the bottle is degraded; a run this long resets the count.
MAX_FAILURES = 5
STABLE_SECONDS = 60.0
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0
_BIND = re.compile(rb"^BNB bind ([0-9]{1,5}) ([A-Z0-9]{1,20})$", re.MULTILINE)
_CONN = re.compile(rb"^BNB conn ([0-9]{1,5})$")
#: Seconds after a bridged connection's report by which the host must have seen it.
CHECK_AFTER = 2.0
#: Connections the host may count before their reports arrive: kept as slack between checks.
SLACK = 8


class BridgeState(StrEnum):
    """Where a bottle's bridge is (``bottle status`` shows it)."""

    OFF = "off"  # agent.bridge = "none": the image brings its own
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


def ports_of(endpoints: Sequence[Endpoint]) -> dict[int, tuple[str, str]]:
    """Each bridged guest port's service and host endpoint path."""
    return {e.guest_port: (e.service, e.path) for e in endpoints if e.guest_path is not None}


def bridges_of(endpoints: Sequence[Endpoint]) -> list[Bridge]:
    """One bridge per socket-mode endpoint: its guest port to its mounted socket."""
    out = []
    for e in endpoints:
        if e.guest_path is not None:
            out.append(Bridge.of(e.guest_port, e.guest_path))
    return out


class BridgeSession(ProcessProtocol):
    """One attached exec running the bridge: ``ready`` fires on its ready line (or fails with
    why it ended first), ``ended`` fires when it ends. Keeps at most ``MAX_OUTPUT`` bytes."""

    MAX_OUTPUT = 512
    MAX_LINE = 64
    #: The line that says the program is up.
    READY = re.compile(rb"^BNB ready [0-9]+$", re.MULTILINE)

    def __init__(self, script: bytes) -> None:
        self.script = script
        self.ready: Deferred[None] = Deferred()
        self.ended: Deferred[int | None] = Deferred()
        self._out = bytearray()
        self._line = b""
        self.stopping = False
        #: Told the port of each connection the bridge made (after ``ready``).
        self.on_conn: Callable[[int], None] = lambda port: None

    def connectionMade(self) -> None:
        assert self.transport is not None
        # stdin stays open: it is the bridge's lifeline (it ends when the session does).
        self.transport.write(self.script)

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD == 1 and self.ready.called:
            self._reports(data)
            return
        if childFD != 1 or len(self._out) >= self.MAX_OUTPUT:
            return
        self._out += data[: self.MAX_OUTPUT - len(self._out)]
        if not self.ready.called and self.READY.search(self._out):
            self.ready.callback(None)

    def _reports(self, data: bytes) -> None:
        """``BNB conn <port>`` lines, each at most MAX_LINE bytes (longer ones dropped)."""
        *lines, rest = (self._line + data).split(b"\n")
        self._line = rest if len(rest) <= self.MAX_LINE else b""
        for line in lines:
            m = _CONN.match(line)
            if m:
                self.on_conn(int(m.group(1)))

    def tell_down(self, port: int) -> None:
        """``down <port>``: the bridge ends that port's unanswered connections."""
        transport: IProcessTransport | None = self.transport
        if transport is not None and not self.stopping:
            with contextlib.suppress(Exception):
                transport.write(b"down %d\n" % port)

    def processEnded(self, reason: Failure) -> None:
        code: int | None = None
        if isinstance(reason.value, ProcessDone):
            code = 0
        elif isinstance(reason.value, ProcessTerminated):
            code = reason.value.exitCode
        if not self.ready.called:
            self.ready.errback(BridgeFailed(self.why_not_ready(code)))
        self.ended.callback(code)

    def why_not_ready(self, code: int | None) -> str:
        """The reason a bridge ended before it was ready, from validated output only."""
        out = bytes(self._out)
        if code == EXIT_NO_TOOL and out.startswith(NO_TOOL.encode()):
            return "no python3 in the agent image (the bridge needs python3 3.7+ and /bin/sh)"
        m = _BIND.search(out)
        if code == EXIT_BIND and m:
            port, err = m.group(1).decode(), m.group(2).decode()
            return f"guest port {port} could not be bound ({err})"
        return f"it ended before it was ready (exit {code})"

    def stop(self) -> None:
        self.stopping = True
        transport: IProcessTransport | None = self.transport
        if transport is not None:
            with contextlib.suppress(Exception):
                transport.signalProcess("TERM")


@define
class _PortWatch:
    """One bridged port: the endpoint behind it, and the bridge's reports since ``base`` (the
    listener's count of connections seen when they were last squared)."""

    service: str
    path: str
    base: int
    reported: int = 0
    timer: IDelayedCall | None = None


@define
class BridgeKeeper:
    """One bottle's bridge and its record of restarts, held by the bottle's owner (its
    machine's core); ``stop`` ends it for good."""

    bottle: str
    agent_vm: str
    bridges: list[Bridge]
    #: guest port -> (service, host endpoint path), for the missed-connection check.
    ports: dict[int, tuple[str, str]] = field(factory=dict)
    watches: dict[int, _PortWatch] = field(factory=dict)
    proving: bool = False
    session: BridgeSession | None = None
    state: BridgeState = BridgeState.STARTING
    restarts: int = 0
    failures: int = 0
    started_at: float = 0.0
    detail: str = ""
    timer: IDelayedCall | None = None
    on_restarted: Callable[[str], None] = field(default=lambda detail: None)
    on_failed: Callable[[str], None] = field(default=lambda detail: None)
    #: The guest kit that runs the bridge (None: the image's python3 and /bin/sh).
    kit: KitRef | None = None

    @property
    def stopped(self) -> bool:
        """It was stopped (destroy, degrade, daemon stop): nothing of it runs or restarts."""
        return self.state is BridgeState.STOPPED

    def stop(self) -> None:
        """End the bridge session (its guest command ends with it); nothing restarts it."""
        self.state = BridgeState.STOPPED
        timers = [self.timer, *(w.timer for w in self.watches.values())]
        for timer in timers:
            if timer is not None and timer.active():
                timer.cancel()
        if self.session is not None and not self.session.stopping:
            self.session.stop()

    def status(self) -> BridgeStatus:
        """The bridge as ``bottle status`` shows it."""
        return BridgeStatus(self.state, self.restarts, self.detail)


@frozen
class BridgeStatus:
    state: BridgeState
    restarts: int = 0
    detail: str = ""

    def describe(self, bridges: Sequence[str] = ()) -> str:
        if self.state is BridgeState.OFF:
            return 'off (agent.bridge = "none": the image bridges its own ports)'
        text = self.state.value
        if bridges:
            text += " (" + ", ".join(bridges) + ")"
        if self.restarts:
            text += f", restarted {self.restarts}x"
        if self.detail:
            text += f": {self.detail}"
        return text


class Bridges:
    """The bridge service: start and prove a bottle's bridge (create), keep it alive (after).
    It holds no bottle's keeper: the bottle's owner does (stopped with ``BridgeKeeper.stop``)."""

    log = Logger()
    #: What the keeper's log lines and reasons call the guest program it keeps.
    what = "bridge"

    def __init__(self, reactor: Any, smolvm: Smolvm, table: ForwardTable) -> None:
        self.reactor = reactor
        self.smolvm = smolvm
        self.table = table

    def _keeper(
        self,
        bottle: str,
        agent_vm: str,
        endpoints: Sequence[Endpoint],
        state: BridgeState = BridgeState.STARTING,
    ) -> BridgeKeeper:
        """A new keeper for the bottle's guest program (a subclass keeps another program)."""
        return BridgeKeeper(
            bottle, agent_vm, bridges_of(endpoints), ports_of(endpoints), state=state
        )

    # -- start and prove ----------------------------------------------------------------

    def _session(self, kept: BridgeKeeper) -> tuple[list[str], BridgeSession]:
        """The guest command that runs the kept program, and its session."""
        kit = kept.kit
        argv = list(ARGV) if kit is None else kit.argv("bridge", *bridge_args(kept.bridges))
        # With the kit nothing is fed; one empty line is (the bridge ignores it): Twisted's
        # process writer noticed the session's end only once it had written something, so
        # a bridge that died was never restarted (tests/control/test_bridge.py).
        return argv, BridgeSession(render(kept.bridges) if kit is None else b"\n")

    async def _spawn(self, kept: BridgeKeeper) -> BridgeSession:
        """One attached session running the kept program, ``ready`` (else BridgeFailed)."""
        argv, session = self._session(kept)
        kept.session = session
        cannot = f"the {self.what} cannot start in {kept.agent_vm}"
        try:
            await self.smolvm.spawn_exec(
                kept.agent_vm, argv, session, user=GUEST_ROOT, session=kit_session(kept.kit)
            )
        except VmctlError as e:
            raise BridgeFailed(f"{cannot}: {e.message}") from None
        timer = self.reactor.callLater(START_TIMEOUT, session.stop)
        try:
            await session.ready
        except BridgeFailed as e:
            raise BridgeFailed(f"{cannot}: {e.message}") from None
        finally:
            if timer.active():
                timer.cancel()
        kept.started_at = self.reactor.seconds()
        self._watch(kept, session)
        return session

    # -- connections the host never saw ---------------------------------------------------

    def _watch(self, kept: BridgeKeeper, session: BridgeSession) -> None:
        for timer in [w.timer for w in kept.watches.values() if w.timer is not None]:
            if timer.active():
                timer.cancel()
        kept.watches = {
            port: _PortWatch(service, path, seen_count(self.table, kept.bottle, service))
            for port, (service, path) in kept.ports.items()
        }
        session.on_conn = lambda port: self._reported(kept, session, port)

    def _reported(self, kept: BridgeKeeper, session: BridgeSession, port: int) -> None:
        w = kept.watches.get(port)
        if w is None or kept.proving or kept.session is not session:
            return
        w.reported += 1
        if w.timer is None:
            w.timer = self.reactor.callLater(CHECK_AFTER, self._square, kept, session, port, w)

    def _square(self, kept: BridgeKeeper, session: BridgeSession, port: int, w: _PortWatch) -> None:
        """The host must have seen every connection reported; if not, say why and end the
        port's unanswered connections."""
        w.timer = None
        if kept.session is not session or session.stopping or kept.proving:
            return
        now = seen_count(self.table, kept.bottle, w.service)
        missing = w.reported - (now - w.base)
        if missing <= 0:
            w.base, w.reported = max(w.base + w.reported, now - SLACK), 0
            return
        w.base, w.reported = now, 0
        why = why_unseen(w.path, vmm_uid(self.table, kept.bottle), refused=False)
        self.log.warn(
            "bottle {bottle}: {n} bridged connection(s) to {service} (guest port {port}) never "
            "reached the host: {why}; the bridge ends the unanswered ones (their clients get EOF)",
            bottle=kept.bottle,
            n=missing,
            service=w.service,
            port=port,
            why=why,
        )
        session.tell_down(port)

    async def start(
        self,
        bottle: str,
        agent_vm: str,
        endpoints: Sequence[Endpoint],
        kit: KitRef | None = None,
    ) -> BridgeKeeper:
        """Start the bottle's bridge and wait until it listens (BridgeFailed: why not, the
        bridge stopped)."""
        kept = self._keeper(bottle, agent_vm, endpoints)
        kept.kit = kit
        try:
            session = await self._spawn(kept)
        except BaseException:
            kept.stop()
            raise
        kept.state = BridgeState.RUNNING
        session.ended.addCallback(lambda code: self._ended(kept, session, code))
        return kept

    async def prove(
        self,
        bottle: str,
        agent_vm: str,
        endpoints: Sequence[Endpoint],
        kept: BridgeKeeper | None = None,
        kit: KitRef | None = None,
    ) -> None:
        """Each guest ``127.0.0.1:<port>`` reaches bottlenet's listener for its service,
        witnessed on the host (BridgeFailed names the ports that did not); ``kept``, the
        bridge being proven, does not count the check's connections as its own."""
        nonce = new_nonce()
        witness = Witness(nonce)
        mine = [e for e in endpoints if e.guest_path is not None]
        diverted: list[str] = []
        if kept is not None:
            kept.proving = True  # the reach check's connections go to the witness
        refused = {e.service: refused_count(self.table, bottle, e.service) for e in mine}
        try:
            for e in mine:
                divert_to_witness(
                    self.reactor, self.table, bottle, e.service, witness,
                    reach_endpoint(e.guest_port),
                )  # fmt: skip
                diverted.append(e.service)
            ports = [e.guest_port for e in mine]
            argv, stdin = (
                (list(ARGV), render_reach(nonce, ports))
                if kit is None
                else (kit.argv("reach"), reach_request(nonce, ports))
            )
            try:
                await run_own_command(self.smolvm, agent_vm, argv, stdin, REACH_TIMEOUT, kit)
            except VmctlError as e:
                raise BridgeFailed(
                    f"the bridge check cannot run in {agent_vm}: {e.message}"
                ) from None
        finally:
            witness.close()
            for label in diverted:
                with contextlib.suppress(Exception):
                    self.table.divert(bottle, label, None)
            if kept is not None:
                kept.proving = False
                if kept.session is not None:
                    self._watch(kept, kept.session)
        missing = [e for e in mine if reach_endpoint(e.guest_port) not in witness.seen]
        if missing:
            uid = vmm_uid(self.table, bottle)
            names = "; ".join(
                f"127.0.0.1:{e.guest_port} ({e.service}): "
                + why_unseen(
                    e.path,
                    uid,
                    refused=refused_count(self.table, bottle, e.service) > refused[e.service],
                )
                for e in missing
            )
            raise BridgeFailed(
                f"the bridge in {agent_vm} does not reach the host's endpoint for {names}"
            )

    # -- keep ---------------------------------------------------------------------------

    def keep(
        self,
        kept: BridgeKeeper | None,
        bottle: str,
        agent_vm: str,
        endpoints: Sequence[Endpoint],
        *,
        on_restarted: Callable[[str], None],
        on_failed: Callable[[str], None],
        kit: KitRef | None = None,
    ) -> BridgeKeeper:
        """Watch the bottle's bridge (``kept``, as its create started it); one that is not
        running (None: after a daemon restart) is started again, unproven (the workload
        already runs). The keeper is returned for the bottle's owner to hold."""
        if kept is None or kept.stopped:
            kept = self._keeper(bottle, agent_vm, endpoints, BridgeState.RESTARTING)
            kept.kit = kit
            kept.on_restarted, kept.on_failed = on_restarted, on_failed
            self._restart(kept)
            return kept
        kept.on_restarted, kept.on_failed = on_restarted, on_failed
        return kept

    def _ended(self, kept: BridgeKeeper, session: BridgeSession, code: int | None) -> None:
        if session.stopping or kept.stopped:
            return
        ran = self.reactor.seconds() - kept.started_at
        kept.failures = 1 if ran >= STABLE_SECONDS else kept.failures + 1
        Deferred.fromCoroutine(self._after_end(kept, code))

    async def _after_end(self, kept: BridgeKeeper, code: int | None) -> None:
        """A bridge whose VM is gone is not restarted: the bottle is degraded with why."""
        gone = await lost_reason(self.smolvm, kept.agent_vm)
        if kept.stopped:
            return
        if gone is not None:
            kept.state = BridgeState.FAILED
            kept.detail = gone
            self.log.warn("bottle {bottle}: {detail}", bottle=kept.bottle, detail=gone)
            kept.on_failed(gone)
            return
        self._failed_once(kept, f"the {self.what} ended (exit {code})")

    def _failed_once(self, kept: BridgeKeeper, why: str) -> None:
        kept.detail = why
        if kept.failures >= MAX_FAILURES:
            kept.state = BridgeState.FAILED
            kept.detail = f"{why}; gave up after {kept.failures} failures in a row"
            self.log.warn("bottle {bottle}: {detail}", bottle=kept.bottle, detail=kept.detail)
            kept.on_failed(f"{self.what} failed: {kept.detail}")
            return
        kept.state = BridgeState.RESTARTING
        delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** max(0, kept.failures - 1))
        self.log.warn(
            "bottle {bottle}: {why}; restarting it in {delay}s",
            bottle=kept.bottle,
            why=why,
            delay=delay,
        )
        kept.timer = self.reactor.callLater(delay, self._restart, kept)

    def _restart(self, kept: BridgeKeeper) -> None:
        kept.timer = None
        if kept.stopped:
            return

        async def go() -> None:
            try:
                session = await self._spawn(kept)
            except BridgeFailed as e:
                if not kept.stopped:
                    kept.failures += 1
                    self._failed_once(kept, e.message)
                return
            if kept.stopped:
                session.stop()
                return
            kept.state = BridgeState.RUNNING
            kept.restarts += 1
            kept.detail = ""
            session.ended.addCallback(lambda code: self._ended(kept, session, code))
            self.log.info("bottle {bottle}: {what} restarted", bottle=kept.bottle, what=self.what)
            kept.on_restarted(f"{self.what} restarted in {kept.agent_vm} ({kept.restarts}x)")

        Deferred.fromCoroutine(go())
