"""Keeping a bottle's lease while its owner lives, and only then.

The actor renews the lease through its node's daemon only right after the owner (the
trainer's anchor actor) has answered, so the lease never outlives the last sign of the owner by
more than one lease: a partitioned node, a lost trainer or a dead raylet stop the renewals, and
the node reaps the bottle itself once the lease and the daemon's grace run out. An owner that is
known dead (Ray says its actor died) makes the keeper destroy the bottle at once.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

import attrs

from bottlenet.control.clienterrors import ControlConnectionError, DaemonUnreachable
from bottlenet.errors import BottlenetError, NotFound

#: How often the owner is asked when the bottle has no lease (only owner loss matters then).
UNLEASED_INTERVAL = 10.0


class OwnerCheck(enum.StrEnum):
    """What asking the owner told: it answered, it is known dead, or no answer came."""

    ALIVE = "alive"
    GONE = "gone"
    UNKNOWN = "unknown"


class KeeperEnd(enum.StrEnum):
    """Why a keeper stopped."""

    STOPPED = "stopped"
    OWNER_GONE = "owner_gone"
    BOTTLE_GONE = "bottle_gone"


def renew_interval(lease_seconds: float | None) -> float:
    """A third of the lease: two renewals may fail before the lease runs out."""
    return UNLEASED_INTERVAL if lease_seconds is None else max(lease_seconds / 3.0, 0.2)


@attrs.define
class LeaseKeeper:
    """One bottle's keeper: ``check_owner(timeout)``, then ``renew(seconds)`` when alive.

    ``step()`` is one round (tests drive it directly); ``run()`` repeats it every interval on
    a thread of the actor until ``stop`` is set or the owner or the bottle is gone, and
    returns why it ended.
    """

    lease_seconds: float | None
    check_owner: Callable[[float], OwnerCheck]
    renew: Callable[[float], None]
    stop: threading.Event = attrs.field(factory=threading.Event)
    clock: Callable[[], float] = time.monotonic
    renewed: int = 0
    skipped: int = 0
    #: when the daemon first said NOT_FOUND (None while it knows the bottle)
    missing_since: float | None = None
    log = logging.getLogger("bottlenet.fleet.lease")

    @property
    def interval(self) -> float:
        return renew_interval(self.lease_seconds)

    def step(self) -> KeeperEnd | None:
        """One round: None to go on, else why the keeper ends."""
        owner = self.check_owner(self.interval)
        if owner is OwnerCheck.GONE:
            return KeeperEnd.OWNER_GONE
        if owner is OwnerCheck.UNKNOWN or self.lease_seconds is None:
            self.skipped += owner is OwnerCheck.UNKNOWN
            return None
        try:
            self.renew(self.lease_seconds)
        except NotFound:
            # gone for good only once it stays gone for a lease: a restarted daemon answers
            # NOT_FOUND for a VM bottle until it has restored it
            now = self.clock()
            if self.missing_since is None:
                self.missing_since = now
            return KeeperEnd.BOTTLE_GONE if now - self.missing_since >= self.lease_seconds else None
        except (ControlConnectionError, DaemonUnreachable, BottlenetError) as e:
            # the daemon restarting, or busy: the next round tries again within the lease
            self.log.warning("lease renewal failed, will retry: %s", type(e).__name__)
            return None
        self.renewed += 1
        self.missing_since = None
        return None

    def run(self) -> KeeperEnd:
        while not self.stop.wait(self.interval):
            end = self.step()
            if end is not None:
                return end
        return KeeperEnd.STOPPED
