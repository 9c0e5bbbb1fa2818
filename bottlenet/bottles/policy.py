"""What the node's policies hear from the bottles, and what they hand each bottle.

The node's policies (drain, leases, what a create told of KVM) sit above this wing, in
:mod:`bottlenet.node`; the bottles know them only through these protocols, injected into the
table (``BottleRegistry(policies=...)``), never by subscribing to the event bus (which is the
wire's feed). The table asks the admission before a create and tells it its count as bottles
leave; each owner tells the tracker a VM start or a create's failure, the warm pools a
member degraded or taken, and holds the lease timer the lease policy made for it (transit
relay's ``_record_usage``: an output that tells an injected tracker, which keeps no map of
parties). The defaults admit every create, count
no lease and hear nothing: a table alone (a test) needs no node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from attrs import field, frozen
from twisted.internet.defer import Deferred

from bottlenet.bottles.model import Source


class Admission(Protocol):
    def admit(self, source: Source) -> None:
        """Before a create: raise (DRAINING) to refuse it."""

    def held(self, count: int) -> None:
        """A bottle left the table: it holds ``count`` now (creates in flight counted)."""


class LeaseTimer(Protocol):
    """One bottle's lease, counted by the lease policy."""

    @property
    def armed(self) -> bool:
        """The bottle has a lease being counted."""

    @property
    def reaping(self) -> bool:
        """Its lease and grace ran out: the bottle is being destroyed."""

    def arm(self, remaining: float) -> None:
        """Count ``remaining`` seconds (then the grace) from now, replacing any count."""

    def cancel(self) -> None:
        """The bottle is gone or the daemon stops: no more wakeups."""


class Leases(Protocol):
    grace: float

    def timer(
        self, name: str, expired: Callable[[], None], reap: Callable[[], Deferred[None]]
    ) -> LeaseTimer:
        """A timer for ``name`` that, once armed and run out, calls ``expired`` once, then
        ``reap`` until it succeeds (or finds the bottle gone)."""


class Tracker(Protocol):
    def vm_started(self) -> None:
        """A VM bottle was made: its VMs started."""

    def create_failed(self, code: str) -> None:
        """A VM bottle's create failed with the error ``code``."""


class Pools(Protocol):
    """The node's warm pools (``node/pools.py``): what they hear of their members."""

    def member_degraded(self, pool: str, home: str) -> None:
        """A member of ``pool`` degraded (its sidecar, bridge or agent VM failed): replace it."""

    def taken(self, pool: str) -> None:
        """A create took a member of ``pool`` (or tried to: its member is gone either way)."""

    def room(self) -> None:
        """A bottle left the table: a pool waiting for room may fill."""


class _NoPools:
    def member_degraded(self, pool: str, home: str) -> None:
        pass

    def taken(self, pool: str) -> None:
        pass

    def room(self) -> None:
        pass


class _Open:
    def admit(self, source: Source) -> None:
        pass

    def held(self, count: int) -> None:
        pass


class _Unarmed:
    armed = reaping = False

    def arm(self, remaining: float) -> None:
        pass

    def cancel(self) -> None:
        pass


class _NoLeases:
    grace = 0.0

    def timer(
        self, name: str, expired: Callable[[], None], reap: Callable[[], Deferred[None]]
    ) -> LeaseTimer:
        return _Unarmed()


class _Deaf:
    def vm_started(self) -> None:
        pass

    def create_failed(self, code: str) -> None:
        pass


@frozen
class Policies:
    """The node's policies as one value handed to the table (``tap.py`` builds it)."""

    admission: Admission = field(factory=_Open)
    leases: Leases = field(factory=_NoLeases)
    tracker: Tracker = field(factory=_Deaf)
    pools: Pools = field(factory=_NoPools)
