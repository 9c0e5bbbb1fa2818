"""The lease keeper's rounds, driven one by one with a fake clock (no Ray, no daemon)."""

from __future__ import annotations

from collections.abc import Callable

from bottlenet.control.clienterrors import DaemonUnreachable
from bottlenet.errors import NotFound
from bottlenet.fleet.lease import KeeperEnd, LeaseKeeper, OwnerCheck, renew_interval


class Script:
    """What the owner check and the renewal answer, round by round, and what they were asked."""

    def __init__(self, owner: list[OwnerCheck], renew: list[Exception | None]) -> None:
        self.owner = owner
        self.answers = renew
        self.renewals: list[float] = []
        self.timeouts: list[float] = []
        self.now = 0.0

    def check(self, timeout: float) -> OwnerCheck:
        self.timeouts.append(timeout)
        return self.owner.pop(0)

    def renew(self, seconds: float) -> None:
        self.renewals.append(seconds)
        answer = self.answers.pop(0)
        if answer is not None:
            raise answer

    def keeper(self, lease: float | None) -> LeaseKeeper:
        clock: Callable[[], float] = lambda: self.now  # noqa: E731
        return LeaseKeeper(lease, self.check, self.renew, clock=clock)


def test_an_answering_owner_renews_the_whole_lease_every_third() -> None:
    """Alive: each round renews for the full lease, a third of it apart, asking the owner
    with that third as its timeout."""
    s = Script([OwnerCheck.ALIVE] * 2, [None, None])
    k = s.keeper(6.0)
    assert (k.step(), k.step()) == (None, None)
    assert s.renewals == [6.0, 6.0] and s.timeouts == [2.0, 2.0]
    assert renew_interval(6.0) == 2.0 and k.renewed == 2


def test_no_answer_from_the_owner_stops_renewals() -> None:
    """Unknown (a partition, a timeout): no renewal, so the lease runs out on the node."""
    s = Script([OwnerCheck.UNKNOWN] * 3, [])
    k = s.keeper(6.0)
    assert [k.step() for _ in range(3)] == [None, None, None]
    assert s.renewals == [] and k.skipped == 3


def test_an_owner_known_dead_ends_the_keeper() -> None:
    """Gone (Ray says the anchor died): the keeper ends at once, renewing nothing."""
    s = Script([OwnerCheck.GONE], [])
    assert s.keeper(6.0).step() is KeeperEnd.OWNER_GONE
    assert s.renewals == []


def test_not_found_is_gone_only_after_a_whole_lease() -> None:
    """NOT_FOUND while a restarted daemon restores is not the end; found again, the count
    starts over; NOT_FOUND for a whole lease is."""
    s = Script([OwnerCheck.ALIVE] * 4, [NotFound("x"), None, NotFound("x"), NotFound("x")])
    k = s.keeper(6.0)
    assert k.step() is None  # t=0: missing since 0
    s.now = 5.0
    assert k.step() is None and k.missing_since is None  # back
    s.now = 10.0
    assert k.step() is None  # missing since 10
    s.now = 16.0
    assert k.step() is KeeperEnd.BOTTLE_GONE


def test_an_unreachable_daemon_is_retried() -> None:
    """The daemon down (restarting): the round fails quietly; the next one renews."""
    s = Script([OwnerCheck.ALIVE] * 2, [DaemonUnreachable("c.sock", "no such file"), None])
    k = s.keeper(6.0)
    assert (k.step(), k.step()) == (None, None)
    assert k.renewed == 1


def test_without_a_lease_only_the_owner_is_watched() -> None:
    """No lease: nothing is renewed; the owner going away still ends the keeper."""
    s = Script([OwnerCheck.ALIVE, OwnerCheck.GONE], [])
    k = s.keeper(None)
    assert k.step() is None and s.renewals == []
    assert k.step() is KeeperEnd.OWNER_GONE
    assert k.interval == renew_interval(None) == 10.0
