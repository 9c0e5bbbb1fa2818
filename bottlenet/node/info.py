"""This host as one node of a fleet: what a placer asks of it (issue 28's node contract).

A placer spreading bottles over many hosts (Ray, or any best-of-K scheduler) needs each
node's identity, version, labels, whether VM bottles can run here, its capacity and use, its
health and whether it drains (E2B's ``InfoService``, Daytona's runner metrics, smolvm serve's
``/capacity``: docs/fleet.md). :class:`Node` gathers that from the parts that know it (the
registry, the relay budget, the drain gate, smolvm and ``/dev/kvm`` as last seen) into one
:class:`NodeReport`; the control plane turns it into the ``NodeInfo`` answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from attrs import frozen
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from bottlenet.bottles.events import BottleEvent
from bottlenet.bottles.host import UidSupply
from bottlenet.bottles.policy import Policies
from bottlenet.bottles.registry import BottleRegistry
from bottlenet.bottles.store import State, StateStore
from bottlenet.errors import InvalidArgument, KvmUnavailable, ResourceExhausted, safe_repr
from bottlenet.forward.budget import ConnectionBudget
from bottlenet.node.drain import DRAINING_KEY, DrainGate, node_recorder
from bottlenet.node.lease import DEFAULT_GRACE, LeasePolicy
from bottlenet.node.pools import PoolKeeper, PoolReport
from vmctl.kvm import KvmStatus

OK = "ok"
DEGRADED = "degraded"
#: At most this many labels (``--label``), each key and value at most 63 characters.
MAX_LABELS = 64
_LABEL_KEY = re.compile(r"[a-z0-9](?:[a-z0-9._/-]{0,61}[a-z0-9])?")
_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")
#: Callers waiting in ``Drain(wait=True)`` at once (each holds a Deferred until it ends).
MAX_DRAIN_WAITERS = 64


def parse_label(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` (InvalidArgument names the rule): keys lowercase ``[a-z0-9._/-]``,
    values ``[A-Za-z0-9._-]`` (may be empty), each at most 63 characters, as Ray's and
    Kubernetes' label values are."""
    key, sep, value = text.partition("=")
    if not sep:
        raise InvalidArgument(f"label {safe_repr(text)}: must be KEY=VALUE")
    if not _LABEL_KEY.fullmatch(key):
        raise InvalidArgument(
            f"label key {safe_repr(key)}: 1-63 of a-z 0-9 . _ / -, starting and ending "
            "with a letter or digit"
        )
    if not _LABEL_VALUE.fullmatch(value):
        raise InvalidArgument(
            f"label {key}: value {safe_repr(value)}: at most 63 of A-Z a-z 0-9 . _ -, "
            "starting and ending with a letter or digit"
        )
    return key, value


def check_labels(texts: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """Every ``--label``, parsed; a key given twice or too many labels is an error."""
    if len(texts) > MAX_LABELS:
        raise InvalidArgument(f"at most {MAX_LABELS} labels")
    labels: dict[str, str] = {}
    for text in texts:
        key, value = parse_label(text)
        if key in labels:
            raise InvalidArgument(f"label {key}: given twice")
        labels[key] = value
    return tuple(sorted(labels.items()))


@frozen
class Capacity:
    max_bottles: int
    bottles: int
    vm_bottles: int
    connections_used: int
    connections_total: int


@frozen
class NodeReport:
    """One look at the node (``NodeInfo``)."""

    host: str
    labels: tuple[tuple[str, str], ...]
    privilege: str
    smolvm: str | None  # the version in use, None when none is usable
    vm_possible: bool
    vm_why_not: str | None
    kvm: str
    capacity: Capacity
    health: str
    reasons: tuple[str, ...]
    draining: bool
    #: False when ``smolvm`` is outside the tested versions (vmctl.smolvm.TESTED_VERSIONS).
    smolvm_tested: bool | None = None
    #: Per-VM uids this node can still give out (None: not per-VM uids, or not counted yet).
    vm_uids_left: int | None = None
    #: The same in words: blocks, in use, waiting (None as above).
    vm_uids: str | None = None
    #: The warm pools (``node/pools.py``), their members counted apart from ``capacity``'s
    #: bottles (they count against ``max_bottles`` all the same).
    pools: tuple[PoolReport, ...] = ()


class KvmSeen:
    """What the creates told of KVM (``bottles.policy.Tracker``): smolvm finds out only when
    a VM starts. A create that fails with KVM_UNAVAILABLE marks it unusable until a VM bottle
    is made."""

    def __init__(self) -> None:
        self.status = KvmStatus(False, "not looked at yet")

    def vm_started(self) -> None:
        if not self.status.usable:
            self.status = KvmStatus(True)

    def create_failed(self, code: str) -> None:
        if code == KvmUnavailable.code:
            self.status = KvmStatus(False, "a VM create failed with KVM_UNAVAILABLE (daemon log)")


@frozen
class NodeParts:
    """The node's policies: its drain gate, its lease policy, what it learned of KVM, its
    warm pools."""

    gate: DrainGate
    leases: LeasePolicy
    kvm: KvmSeen
    pools: PoolKeeper

    def policies(self) -> Policies:
        """As the bottles' table hears them."""
        return Policies(admission=self.gate, leases=self.leases, tracker=self.kvm, pools=self.pools)


def node_parts(
    clock: IReactorTime,
    store: StateStore,
    state: State,
    publish: Callable[[BottleEvent], None],
    *,
    monotonic: Callable[[], float],
    lease_grace: float = DEFAULT_GRACE,
) -> NodeParts:
    """The node's policies: its drain gate as ``state`` recorded it (its events to
    ``publish``), its lease policy on the ``monotonic`` clock."""
    draining = (state.node or {}).get(DRAINING_KEY) is True
    record = node_recorder(store)
    gate = DrainGate(clock, publish, record, draining=draining)
    return NodeParts(
        gate,
        LeasePolicy(clock, monotonic, lease_grace),
        KvmSeen(),
        PoolKeeper(clock, lambda: gate.draining, record, state.node),
    )


class Node:
    """The node's report and its controls (drain, undrain, renew a lease), over the table
    and the node's policies.

    ``smolvm_found``, ``smolvm_version``, ``smolvm_problem`` and ``kvm`` are set by the
    daemon's root service as it learns them (at start, after its smolvm probe).
    """

    log = Logger()

    def __init__(
        self,
        registry: BottleRegistry,
        budget: ConnectionBudget,
        parts: NodeParts,
        *,
        host: str,
        labels: tuple[tuple[str, str], ...] = (),
        privilege: str,
    ) -> None:
        self._registry = registry
        self._budget = budget
        self.gate, self.leases, self._kvm = parts.gate, parts.leases, parts.kvm
        #: The warm pools, which tell this table what to make.
        self.pools = parts.pools
        self.pools.registry = registry
        self.host = host
        self.labels = labels
        self.privilege = privilege
        self.smolvm_found = False
        self.smolvm_version: str | None = None
        #: False once the probe found a version outside the tested ones.
        self.smolvm_tested: bool | None = None
        self.smolvm_problem: str | None = "no smolvm found"
        #: Per-VM uids left (as root; ``learn_uids``), None until counted.
        self.vm_uids: UidSupply | None = None
        self._drain_waiters = 0

    @property
    def kvm(self) -> KvmStatus:
        return self._kvm.status

    @kvm.setter
    def kvm(self, status: KvmStatus) -> None:
        self._kvm.status = status

    def learn_uids(self, supply: UidSupply) -> None:
        """How many per-VM uids are left; a warning when they run short, and when not."""
        was = self.vm_uids is not None and self.vm_uids.short
        self.vm_uids = supply
        if supply.short and not was:
            self.log.warn(
                "per-VM uids are running out: {supply}; no further block could be claimed; "
                "what a retired uid still holds, e.g. {example} (docs/operations.md, VM uids)",
                supply=supply.describe(),
                example=supply.example or "not looked at yet",
            )
        elif was and not supply.short:
            self.log.info("per-VM uids: {supply}", supply=supply.describe())

    def report(self) -> NodeReport:
        bottles = self._registry.list_bottles()
        why_not = self.smolvm_problem or (None if self.kvm.usable else f"KVM: {self.kvm.why}")
        reasons = self.reasons()
        return NodeReport(
            host=self.host,
            labels=self.labels,
            privilege=self.privilege,
            smolvm=self.smolvm_version if self.smolvm_problem is None else None,
            vm_possible=why_not is None,
            vm_why_not=why_not,
            kvm=self.kvm.describe(),
            capacity=Capacity(
                max_bottles=self._registry.max_bottles,
                bottles=len(bottles),
                vm_bottles=sum(1 for b in bottles if b.has_vms),
                connections_used=self._budget.total_active,
                connections_total=self._budget.total,
            ),
            health=DEGRADED if reasons else OK,
            reasons=reasons,
            draining=self.gate.draining,
            smolvm_tested=self.smolvm_tested if self.smolvm_problem is None else None,
            vm_uids_left=None if self.vm_uids is None else self.vm_uids.left,
            vm_uids=None if self.vm_uids is None else self.vm_uids.describe(),
            pools=tuple(self.pools.reports()),
        )

    def reasons(self) -> tuple[str, ...]:
        """Why the node is degraded (none: ok). Not among them: KVM, and a smolvm never found
        (such a node serves forward-only bottles; ``vm_possible`` says so)."""
        out = []
        if self._registry.recovering:
            out.append("restoring its state after a start: changes wait")
        if self._budget.total_active >= self._budget.total:
            out.append("the relay connection budget is used up")
        if self.smolvm_found and self.smolvm_problem is not None:
            out.append(f"smolvm: {self.smolvm_problem}")
        if self.vm_uids is not None and self.vm_uids.short:
            out.append(f"per-VM uids are running out: {self.vm_uids.left} left")
        return tuple(out)

    @property
    def draining(self) -> bool:
        return self.gate.draining

    def held(self) -> int:
        """The bottles the node holds, creates in flight included (the table's count)."""
        return self._registry.held()

    def drain(self) -> None:
        """Refuse new bottles (durable before it answers); a second drain changes nothing."""
        if self.gate.drain():
            self.log.info("node: draining: new bottles are refused ({n} held)", n=self.held())
            self.pools.drained()

    async def when_serving(self) -> None:
        """Returns once the daemon's recovery is done (``RenewLease`` waits for it)."""
        await self._registry.when_serving()

    def undrain(self) -> None:
        self.gate.undrain()
        self.pools.undrained()

    def ensure_pool(self, doc: dict[str, Any], size: int) -> PoolReport:
        """Keep ``size`` bottles of the spec ``doc`` ready (``node/pools.py``)."""
        return self.pools.ensure(doc, size)

    def pool_reports(self) -> list[PoolReport]:
        return self.pools.reports()

    def remove_pool(self, key: str) -> int:
        return self.pools.remove(key)

    def renew_lease(self, name: str, seconds: float) -> None:
        self._registry.renew_lease(name, seconds)

    async def when_empty(self, timeout: float) -> bool:
        """True once the node holds no bottle; False after ``timeout`` seconds or an undrain
        (at most MAX_DRAIN_WAITERS callers wait at once)."""
        if self.held() == 0:
            return True
        if self._drain_waiters >= MAX_DRAIN_WAITERS:
            raise ResourceExhausted(f"{MAX_DRAIN_WAITERS} callers already wait for the drain")
        self._drain_waiters += 1
        try:
            d: Deferred[bool] = self.gate.wait_empty(timeout)
            return await d
        finally:
            self._drain_waiters -= 1
