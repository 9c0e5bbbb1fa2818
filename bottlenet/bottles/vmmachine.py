"""A VM bottle's machine: states that carry their data, transitions that do the work.

The shape of Twisted's ``application/_client_service.py``: a state's data is made on entering
and handed to the transition that leaves it, which stops it. A VM bottle is *asked* (its name
held, its create not started), *creating* (carrying its :class:`~bottlenet.bottles.creation.
Creation`: the undo list, the reserved uids), *ready* (carrying its :class:`Running`: the VMs,
the sidecar's pid watch, the bridge and egress layer keepers, the workload waiter, the
launcher sessions; its workload may have ended, which its value says), *degraded*,
*destroying* (carrying its :class:`Teardown`) and *gone*. The transitions do the work: commit
and announce a create, degrade, record a workload's exit, take a launcher session, start and
fail a teardown, remove the bottle; each tells the event bus (the wire) and the node's
policies (``bottles.policy``) what they must hear. One operation at a time is the table's
rule, not a state here; the owner (:class:`~bottlenet.bottles.bottle.VMBottle`) runs the
create's steps, the verify and the policy push, and reads the phase to drop what a late
callback or a stopping daemon gives a bottle that no longer runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from attrs import evolve, frozen
from automat import TypeMachineBuilder
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IProcessProtocol
from twisted.python.failure import Failure

from bottlenet.bottles import attach, workload
from bottlenet.bottles.attach import ExecRequest
from bottlenet.bottles.bridge import BridgeKeeper, BridgeState, BridgeStatus
from bottlenet.bottles.core import (
    BottleCore,
    commit,
    count_lease,
    emit,
    ended,
    log,
    persist_quietly,
)
from bottlenet.bottles.creation import Creation
from bottlenet.bottles.egresslayer import (
    LayerKeeper,
    layer_status,
    proxy_endpoint,
)
from bottlenet.bottles.events import (
    CREATED,
    DEGRADED,
    DESTROYED,
    READY,
    WORKLOAD_EXITED,
)
from bottlenet.bottles.host import VMHost, runs_bridge
from bottlenet.bottles.model import Bottle, BottleState, BottleVMs
from bottlenet.bottles.sessions import CountedSession, Sessions
from bottlenet.bottles.states import Lifecycle
from bottlenet.bottles.vmloss import lost_reason
from vmctl.smolvm import GUEST_ROOT

if TYPE_CHECKING:
    from bottlenet.bottles.bottle import VMBottle

#: The phases whose bottle runs (a :class:`Running` is its data): ready, or its workload ended,
#: or a warm pool's member waiting to be taken.
LIVE = frozenset({Lifecycle.READY, Lifecycle.EXITED, Lifecycle.POOLED})


def describe_bridge(vm: BottleVMs, bridge: BridgeKeeper | None, layer: LayerKeeper | None) -> str:
    """bottlenet's in-guest bridge (and the transparent egress layer), for ``bottle status``."""
    if not runs_bridge(vm.spec, vm.endpoints):
        status = BridgeStatus(BridgeState.OFF)  # the image bridges its own ports
    else:
        status = BridgeStatus(BridgeState.STOPPED) if bridge is None else bridge.status()
    text = status.describe([str(e.guest_port) for e in vm.endpoints if e.guest_path is not None])
    service = vm.spec.agent.transparent_egress if vm.spec.agent else None
    if service is not None:
        text += "; transparent egress " + layer_status(layer, service).describe()
    return text


class Running:
    """What a ready VM bottle runs beside its VMs: made on entering ``ready`` (its create
    hands over the bridge and layer it started; a restore starts them again), started once
    the machine holds it, stopped by the transition that leaves ``ready`` (or the daemon's
    stop). A stopped one is silent: its watches and waiter are cancelled."""

    def __init__(
        self,
        owner: VMBottle,
        host: VMHost,
        vm: BottleVMs,
        bridge: BridgeKeeper | None = None,
        layer: LayerKeeper | None = None,
    ) -> None:
        self.owner, self.host, self.vm = owner, host, vm
        self.bridge, self.layer = bridge, layer
        #: The launcher sessions (Exec, Logs) it holds now, capped.
        self.sessions = Sessions(owner.name)
        #: The sidecar VM process's pid watch (it never calls back before the next turn).
        self.watch = host.watcher.watch(vm.sidecar_pid, owner.sidecar_exited)
        self.waiter: workload.WorkloadWaiter | None = None
        self.stopped = False

    def start(self) -> None:
        """Keep the bridge and the egress layer running; wait for a running workload."""
        owner, vm = self.owner, self.vm
        restarted = owner.bridge_restarted
        if runs_bridge(vm.spec, vm.endpoints):
            self.bridge = self.host.bridges.keep(
                self.bridge,
                owner.name,
                vm.agent_vm,
                vm.endpoints,
                on_restarted=restarted,
                on_failed=owner.degrade_later,
                kit=vm.kit,
            )
        service = vm.spec.agent.transparent_egress if vm.spec.agent else None
        if service is not None:
            self.layer = self.host.layers.keep_layer(
                self.layer,
                owner.name,
                vm.agent_vm,
                proxy_endpoint(vm.endpoints, service),
                on_restarted=restarted,
                on_failed=owner.degrade_later,
                kit=vm.kit,
            )
        if vm.workload == workload.WorkloadState.RUNNING:
            self._wait()

    def stop(self) -> None:
        """The waiter, the watch and the keepers end (the VMs and the workload run on)."""
        self.stopped = True
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            waiter.cancel()
        self.watch.cancel()
        for keeper in (self.bridge, self.layer):
            if keeper is not None:
                keeper.stop()

    def bridge_status(self) -> str:
        return describe_bridge(self.vm, self.bridge, self.layer)

    def taken(self, name: str, vm: BottleVMs) -> None:
        """A warm pool's member is taken: it runs on as ``name`` with ``vm`` (its workload
        started), waited for from now on."""
        self.vm = vm
        self.sessions.bottle = name
        for keeper in (self.bridge, self.layer):
            if keeper is not None:
                keeper.bottle = name
        if vm.workload == workload.WorkloadState.RUNNING:
            self._wait()

    def _wait(self) -> None:
        """Wait for the bottle's running workload to end (its exit code, or its loss)."""
        owner, vm = self.owner, self.vm

        def lost() -> None:
            if self.waiter is waiter and not waiter.cancelled:
                self.waiter = None
                Deferred.fromCoroutine(self._after_loss())

        waiter = self.waiter = workload.WorkloadWaiter(owner.workload_ended, lost)
        request = ExecRequest(tuple(workload.waiter_argv(vm.agent_vm, vm.kit)), user=GUEST_ROOT)

        def failed(f: Failure) -> None:
            lost()
            log.warn(
                "bottle {bottle}: cannot watch its workload: {err}",
                bottle=owner.name,
                err=getattr(f.value, "message", type(f.value).__name__),
            )

        bottle = owner.require()
        d = Deferred.fromCoroutine(attach.spawn_exec(self.host, bottle, request, waiter))
        d.addErrback(failed)

    async def _after_loss(self) -> None:
        """The waiter ended without a code: said so, and the VM's loss made the bottle's
        (a real VM takes its sessions with it: ``bottles/vmloss.py``)."""
        gone = await lost_reason(self.host.smolvm, self.vm.agent_vm)
        log.warn(
            "bottle {bottle}: its workload waiter ended without an exit code ({why})",
            bottle=self.owner.name,
            why=gone or "the agent VM runs; the workload's end will not be noticed",
        )
        if gone is not None and not self.stopped:
            self.owner.degrade_later(gone)


@frozen
class Teardown:
    """A destroy's teardown of the VMs, and the bottle as it was when it began."""

    host: VMHost
    bottle: Bottle

    def start(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self.host.teardown(self.bottle))


# -- the machine ------------------------------------------------------------------------


class VMMachine(Protocol):
    """The inputs of a VM bottle's machine (each transition is declared below)."""

    def begin(self, creation: Creation) -> None:
        """Its create starts its steps (CREATED)."""

    def committed(self, bottle: Bottle) -> None:
        """The create's last step: the value, recorded (UNAVAILABLE: nothing kept)."""

    def created(self, running: Running) -> None:
        """The create is done: the bottle runs (READY)."""

    def pooled(self, running: Running) -> None:
        """A warm pool's create is done: it runs, booted, gated and bridged, with no
        workload, until a create takes it (nothing on the wire)."""

    def take(self, running: Running, bottle: Bottle) -> None:
        """A create takes the pool's member: it is ``bottle`` now (its name, tenancy and
        workload; recorded by its owner first), ready (CREATED, READY), running on
        (``running``, the member's own)."""

    def create_failed(self, code: str) -> None:
        """A step failed (its undos ran): DESTROYED names the error ``code``."""

    def degrade(self, why: str) -> Deferred[None]:
        """Its sidecar, bridge or agent VM failed: it stops running, turns degraded
        (DEGRADED); the removal of its listeners, then its record, is handed back."""

    def workload_exited(self, code: int) -> None:
        """Its workload ended: recorded with its code (WORKLOAD_EXITED), once."""

    def take_session(self, inner: IProcessProtocol) -> CountedSession:
        """One of its launcher sessions (BUSY past the cap)."""

    def running(self) -> Running:
        """What it runs (read while it is ready: its bridge, its egress layer's counts)."""

    def stop(self) -> None:
        """The daemon stops: nothing of it is watched any more (its VMs run on)."""

    def destroy(self, teardown: Teardown) -> Deferred[None]:
        """A destroy starts: it stops running, its VMs are torn down (handed back)."""

    def teardown_failed(self, detail: str) -> None:
        """The teardown failed: it is degraded (DEGRADED when it was not already)."""

    def removed(self) -> None:
        """Its record is gone: the table forgets it (DESTROYED)."""

    def phase(self) -> Lifecycle:
        """Where it is (the table says BUSY while an operation holds it)."""


_vm = TypeMachineBuilder(VMMachine, BottleCore)


def _creation(machine: VMMachine, core: BottleCore, creation: Creation) -> Creation:
    return creation


def _running(
    machine: VMMachine, core: BottleCore, running: Running, bottle: Bottle | None = None
) -> Running:
    return running  # (a member taken: its own, running on as ``bottle``)


def _teardown(machine: VMMachine, core: BottleCore, teardown: Teardown) -> Teardown:
    return teardown


_asked = _vm.state("asked")
_creating = _vm.state("creating", _creation)
_ready = _vm.state("ready", _running)
_pooled = _vm.state("pooled", _running)
_degraded = _vm.state("degraded")
_destroying = _vm.state("destroying", _teardown)
_gone = _vm.state("gone")


@_asked.upon(VMMachine.begin).to(_creating)
def _begin(machine: VMMachine, core: BottleCore, creation: Creation) -> None:
    emit(core, CREATED, BottleState.CREATING)


@_creating.upon(VMMachine.committed).loop()
def _commit(machine: VMMachine, core: BottleCore, creation: Creation, bottle: Bottle) -> None:
    commit(core, bottle)  # (a failure raises here: the create is still creating)


@_creating.upon(VMMachine.created).to(_ready)
def _created(machine: VMMachine, core: BottleCore, creation: Creation, running: Running) -> None:
    emit(core, READY, core.value.state)
    core.hands.policies.tracker.vm_started()


@_creating.upon(VMMachine.pooled).to(_pooled)
def _filled(machine: VMMachine, core: BottleCore, creation: Creation, running: Running) -> None:
    core.hands.policies.tracker.vm_started()


@_pooled.upon(VMMachine.take).to(_ready)
def _take(
    machine: VMMachine, core: BottleCore, member: Running, running: Running, bottle: Bottle
) -> None:
    core.name, core.value = bottle.name, bottle
    count_lease(core)
    log.info("bottle {bottle} taken from a warm pool ({home})", bottle=core.name, home=bottle.home)
    emit(core, CREATED, BottleState.CREATING)
    emit(core, READY, bottle.state)
    running.taken(bottle.name, bottle.require_vms())


@_creating.upon(VMMachine.create_failed).to(_gone)
def _create_failed(machine: VMMachine, core: BottleCore, creation: Creation, code: str) -> None:
    emit(core, DESTROYED, None, f"create failed: {code}")
    core.hands.policies.tracker.create_failed(code)


@_ready.upon(VMMachine.degrade).to(_degraded)
def _degrade(machine: VMMachine, core: BottleCore, running: Running, why: str) -> Deferred[None]:
    return _stop_degraded(core, running, why)


def _stop_degraded(core: BottleCore, running: Running, why: str) -> Deferred[None]:
    """It stops running, turns degraded (DEGRADED); its listeners' removal, then its record's
    write, handed back."""
    running.stop()
    degraded = core.value = evolve(core.value, state=BottleState.DEGRADED, detail=why)
    log.warn("bottle {bottle} is degraded: {why}", bottle=core.name, why=why)
    emit(core, DEGRADED, BottleState.DEGRADED, why)
    removing = core.hands.table.remove_bottle(core.name)
    return removing.addCallback(lambda _: persist_quietly(core, degraded))


@_pooled.upon(VMMachine.degrade).to(_degraded)
def _degrade_member(
    machine: VMMachine, core: BottleCore, running: Running, why: str
) -> Deferred[None]:
    removing = _stop_degraded(core, running, why)
    pool = core.value.pool
    assert pool is not None
    core.hands.policies.pools.member_degraded(pool, core.name)
    return removing


@_ready.upon(VMMachine.workload_exited).loop()
def _exited(machine: VMMachine, core: BottleCore, running: Running, code: int) -> None:
    running.waiter = None
    vm = core.value.require_vms()
    if vm.workload != workload.WorkloadState.RUNNING:
        return  # a second word from a waiter is not news
    detail = f"workload exited with code {code}"
    vm = evolve(vm, workload=workload.WorkloadState.EXITED, workload_exit_code=code)
    exited = evolve(core.value, state=BottleState.EXITED, detail=detail, vms=vm)
    core.value = exited
    log.info("bottle {bottle}: {detail}", bottle=core.name, detail=detail)
    persist_quietly(core, exited)
    emit(core, WORKLOAD_EXITED, BottleState.EXITED, detail, code)


@_ready.upon(VMMachine.take_session).loop()
def _session(
    machine: VMMachine, core: BottleCore, running: Running, inner: IProcessProtocol
) -> CountedSession:
    return running.sessions.session(inner)


@_ready.upon(VMMachine.running).loop()
@_pooled.upon(VMMachine.running).loop()
def _what_runs(machine: VMMachine, core: BottleCore, running: Running) -> Running:
    return running


@_ready.upon(VMMachine.stop).loop()
@_pooled.upon(VMMachine.stop).loop()
def _stop(machine: VMMachine, core: BottleCore, running: Running) -> None:
    running.stop()


@_ready.upon(VMMachine.destroy).to(_destroying)
@_pooled.upon(VMMachine.destroy).to(_destroying)
def _destroy_running(
    machine: VMMachine, core: BottleCore, running: Running, teardown: Teardown
) -> Deferred[None]:
    running.stop()
    return teardown.start()


@_degraded.upon(VMMachine.destroy).to(_destroying)
def _destroy_degraded(machine: VMMachine, core: BottleCore, teardown: Teardown) -> Deferred[None]:
    return teardown.start()


@_destroying.upon(VMMachine.teardown_failed).to(_degraded)
def _teardown_failed(machine: VMMachine, core: BottleCore, teardown: Teardown, detail: str) -> None:
    degraded = core.value = evolve(core.value, state=BottleState.DEGRADED, detail=detail)
    persist_quietly(core, degraded)
    if teardown.bottle.state is not BottleState.DEGRADED:
        emit(core, DEGRADED, BottleState.DEGRADED, detail)


@_destroying.upon(VMMachine.removed).to(_gone)
def _removed(machine: VMMachine, core: BottleCore, teardown: Teardown) -> None:
    ended(core)


@_ready.upon(VMMachine.phase).loop()
def _kept(machine: VMMachine, core: BottleCore, running: Running) -> Lifecycle:
    return Lifecycle(core.value.state)  # ready, or exited


for _state, _phase in (
    (_asked, Lifecycle.CREATING),
    (_creating, Lifecycle.CREATING),
    (_degraded, Lifecycle.DEGRADED),
    (_destroying, Lifecycle.DESTROYING),
    (_gone, Lifecycle.GONE),
    (_pooled, Lifecycle.POOLED),
):
    _state.upon(VMMachine.phase).loop().returns(_phase)

_vm_machine = _vm.build()


def vm_machine(core: BottleCore, running: Running | None = None) -> VMMachine:
    """A VM bottle's machine: *asked* (its value as asked), or restored as it was kept:
    *ready* (or *pooled*, a warm pool's member), running ``running`` (started once the
    machine holds it), or *degraded*."""
    if core.value.state is BottleState.CREATING:
        return _vm_machine(core)
    if running is None:
        return _vm_machine(core, _degraded)
    kept = _ready if core.value.pool is None else _pooled
    return _vm_machine(core, kept, lambda machine, core: running)
