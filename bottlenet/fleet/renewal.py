"""Keeping a host's leases while the trainer lives, and only then.

A node's host renews the leases of its bottles through its node's daemon only right after the
trainer's owner actor has answered, so a lease never outlives the last sign of the owner by
more than one lease: a partitioned node, a lost trainer or a dead raylet stop the renewals, and
the node reaps the bottles itself once the lease and the daemon's grace run out. An owner known
dead (Ray says its actor died) makes the host destroy every bottle at once.

This module is the bookkeeping (no Ray, no event loop): the host's rounds are in
:mod:`bottlenet.fleet.host`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import attrs

from bottlenet.control.clienterrors import ControlConnectionError, DaemonUnreachable
from bottlenet.errors import BottlenetError, NotFound

#: How often the owner is asked when no bottle has a lease (only the owner's loss matters then).
UNLEASED_INTERVAL = 10.0
log = logging.getLogger("bottlenet.fleet.renewal")


class OwnerCheck(enum.StrEnum):
    """What asking the owner told: it answered, it is known dead, or no answer came."""

    ALIVE = "alive"
    GONE = "gone"
    UNKNOWN = "unknown"


class Renewal(enum.StrEnum):
    """What one renewal got from the node's daemon."""

    RENEWED = "renewed"
    #: ``NOT_FOUND``: reaped, or not yet restored by a daemon that restarted
    MISSING = "missing"
    #: the daemon down or busy: the next round tries again, within the lease
    FAILED = "failed"


def renew_interval(lease_seconds: float | None) -> float:
    """A third of the lease: two renewals may fail before the lease runs out."""
    return UNLEASED_INTERVAL if lease_seconds is None else max(lease_seconds / 3.0, 0.2)


def round_interval(leases: Iterable[float | None]) -> float:
    """A host's rounds come as often as its shortest lease needs."""
    return min((renew_interval(s) for s in leases), default=UNLEASED_INTERVAL)


@attrs.define
class LeaseRenewer:
    """One bottle's lease as its host keeps it (the daemon's end of the contract is
    ``bottles.lease``): renewed for the whole lease each round the owner answered."""

    lease_seconds: float
    renewed: int = 0
    #: when the daemon first said NOT_FOUND (None while it knows the bottle)
    missing_since: float | None = None

    def settle(self, outcome: Renewal, now: float) -> bool:
        """Take one renewal's outcome; True once the bottle is gone for good: NOT_FOUND for a
        whole lease (a restarted daemon answers it for a VM bottle until it has restored it)."""
        if outcome is Renewal.RENEWED:
            self.renewed += 1
            self.missing_since = None
        elif outcome is Renewal.MISSING:
            if self.missing_since is None:
                self.missing_since = now
            return now - self.missing_since >= self.lease_seconds
        return False


class RenewingClient(Protocol):
    """What renewals need of a control client (:class:`BlockingControlClient` has it)."""

    def renew_lease(self, name: str, seconds: float) -> object: ...


Connect = Callable[[str], AbstractContextManager[RenewingClient]]


def renew_all(connect: Connect, due: Sequence[tuple[str, str, float]]) -> list[Renewal]:
    """Renew each ``(name, control, seconds)`` (one connection per control socket, in order);
    each one's outcome. A daemon that cannot be reached fails the rest of its bottles."""
    outcomes: dict[int, Renewal] = {}
    by_control: dict[str, list[int]] = {}
    for i, (_, control, _) in enumerate(due):
        by_control.setdefault(control, []).append(i)
    for control, indexes in by_control.items():
        try:
            with connect(control) as client:
                for i in indexes:
                    name, _, seconds = due[i]
                    outcomes[i] = _renew_one(client, name, seconds)
        except (ControlConnectionError, DaemonUnreachable) as e:
            log.warning("lease renewals failed, will retry: %s", type(e).__name__)
    return [outcomes.get(i, Renewal.FAILED) for i in range(len(due))]


def _renew_one(client: RenewingClient, name: str, seconds: float) -> Renewal:
    try:
        client.renew_lease(name, seconds)
    except NotFound:
        return Renewal.MISSING
    except (ControlConnectionError, DaemonUnreachable):
        raise
    except BottlenetError as e:
        log.warning("lease renewal of %s failed, will retry: %s", name, e.code)
        return Renewal.FAILED
    return Renewal.RENEWED
