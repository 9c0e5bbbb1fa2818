"""Who a bottle is for, and for how long: its owner, its scoped creator and its lease.

A fleet (a Ray host per trainer and node, docs/fleet.md) creates bottles for owners that may
vanish (a crashed trainer, a lost node, a partition): a bottle may carry a **lease**, which
its owner renews while it lives; one whose lease ran out (plus the daemon's grace) is
destroyed by the daemon itself (:mod:`bottlenet.node.lease`). The **creator** is the
scoped control peer that made it (``uid:N/<digest of its capability>``): such a peer sees and
acts on its own bottles only (``control/scope.py``). All three are part of the bottle's state
record (key ``tenancy``, absent when none applies), so a restarted daemon keeps them; a bottle
without one behaves as before.

The lease's expiry is kept as wall time (Unix seconds) only for a restart; while the daemon
runs, its lease timer counts on the monotonic clock, so a wall-clock jump never reaps a live
lease early.
"""

from __future__ import annotations

import math
import re
from typing import Any

from attrs import evolve, frozen

from bottlenet.errors import InvalidArgument, safe_repr
from bottlenet.fields import Fields

#: A lease is 1 second to a week long (a renewal too).
MIN_LEASE = 1.0
MAX_LEASE = 7 * 86400.0
_OWNER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+=-]{0,127}")
#: ``uid:N``, and with a capability ``uid:N/<its digest>`` (``control/scope.py``).
_CREATOR = re.compile(r"uid:(?:0|[1-9][0-9]{0,9})(?:/[0-9a-f]{64})?")


def check_owner(owner: str) -> str:
    """An owner label: 1-128 of ``A-Za-z0-9._:@/+=-``, starting with a letter or digit."""
    if not _OWNER.fullmatch(owner):
        raise InvalidArgument(
            f"owner {safe_repr(owner)}: 1-128 of A-Z a-z 0-9 . _ : @ / + = -, starting with a "
            "letter or digit"
        )
    return owner


def check_lease_seconds(seconds: float) -> float:
    if not (math.isfinite(seconds) and MIN_LEASE <= seconds <= MAX_LEASE):
        raise InvalidArgument(f"lease: {MIN_LEASE:g} to {MAX_LEASE:g} seconds")
    return float(seconds)


@frozen
class Lease:
    """``seconds`` as last granted; ``expires_at`` the wall time it runs out (for a restart)."""

    seconds: float
    expires_at: float


@frozen
class Tenancy:
    """A bottle's owner label, scoped creator and lease (each optional)."""

    owner: str | None = None
    creator: str | None = None
    lease: Lease | None = None

    @classmethod
    def requested(
        cls, owner: str | None, lease_seconds: float | None, creator: str | None
    ) -> Tenancy | None:
        """What a create asks for (validated); None when it asks for none of it."""
        if owner is None and lease_seconds is None and creator is None:
            return None
        lease = None
        if lease_seconds is not None:
            lease = Lease(check_lease_seconds(lease_seconds), 0.0)  # started at commit
        return cls(None if owner is None else check_owner(owner), creator, lease)

    def started(self, now: float) -> Tenancy:
        """The lease counted from ``now`` (wall time: the bottle is being committed)."""
        if self.lease is None:
            return self
        return evolve(self, lease=Lease(self.lease.seconds, now + self.lease.seconds))

    def renewed(self, seconds: float, now: float) -> Tenancy:
        return evolve(self, lease=Lease(seconds, now + seconds))

    def to_state(self) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if self.owner is not None:
            doc["owner"] = self.owner
        if self.creator is not None:
            doc["creator"] = self.creator
        if self.lease is not None:
            doc["lease"] = {"seconds": self.lease.seconds, "expires_at": self.lease.expires_at}
        return doc

    @classmethod
    def from_state(cls, d: object, error: type[Exception]) -> Tenancy:
        f = Fields(d, "tenancy", allowed=("owner", "creator", "lease"), error=error)
        owner = f.value("owner", str, optional=True)
        creator = f.value("creator", str, optional=True)
        if owner is not None and not _OWNER.fullmatch(owner):
            raise f.fail("owner", "not an owner label")
        if creator is not None and not _CREATOR.fullmatch(creator):
            raise f.fail("creator", "not uid:N or uid:N/DIGEST")
        lease = None
        raw = f.value("lease", dict, optional=True)
        if raw is not None:
            lf = Fields(raw, "tenancy.lease", allowed=("seconds", "expires_at"), error=error)
            seconds, expires_at = lf.number("seconds"), lf.number("expires_at")
            if not (MIN_LEASE <= seconds <= MAX_LEASE and math.isfinite(expires_at)):
                raise lf.fail("seconds", "out of range")
            lease = Lease(seconds, expires_at)
        return cls(owner, creator, lease)
