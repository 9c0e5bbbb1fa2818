"""A lease's renewals, settled one by one with a fake clock, and a round's calls against a
scripted client (no Ray, no daemon)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from bottlenet.control.clienterrors import ControlConnectionError, DaemonUnreachable
from bottlenet.errors import Busy, NotFound
from bottlenet.fleet.renewal import (
    LeaseRenewer,
    Renewal,
    renew_all,
    renew_interval,
    round_interval,
)


def test_the_rounds_come_every_third_of_the_shortest_lease() -> None:
    """Two renewals may fail before a lease runs out; no lease: the owner check alone, every
    10 s; never more often than 0.2 s."""
    assert renew_interval(6.0) == 2.0 and renew_interval(None) == 10.0
    assert renew_interval(0.3) == 0.2
    assert round_interval([6.0, None, 3.0]) == 1.0
    assert round_interval([]) == 10.0


def test_renewed_counts_and_forgets_a_missing_spell() -> None:
    """Each renewal counts; a renewal after NOT_FOUND starts the missing count over."""
    lease = LeaseRenewer(6.0)
    assert lease.settle(Renewal.MISSING, 0.0) is False and lease.missing_since == 0.0
    assert lease.settle(Renewal.RENEWED, 5.0) is False
    assert (lease.renewed, lease.missing_since) == (1, None)


def test_not_found_is_gone_only_after_a_whole_lease() -> None:
    """NOT_FOUND while a restarted daemon restores is not the end; for a whole lease it is;
    a failed renewal (daemon down) never ends it."""
    lease = LeaseRenewer(6.0)
    assert lease.settle(Renewal.MISSING, 10.0) is False
    assert lease.settle(Renewal.FAILED, 15.0) is False
    assert lease.settle(Renewal.MISSING, 15.9) is False
    assert lease.settle(Renewal.MISSING, 16.0) is True


class Client:
    """A control client whose renewals answer from a script (None: renewed)."""

    def __init__(self, answers: dict[str, Exception | None]) -> None:
        self.answers = answers
        self.renewed: list[tuple[str, float]] = []

    def renew_lease(self, name: str, seconds: float) -> None:
        self.renewed.append((name, seconds))
        answer = self.answers[name]
        if answer is not None:
            raise answer


def test_a_round_renews_each_bottle_on_one_connection_per_socket() -> None:
    """Each bottle's outcome in order: renewed, NOT_FOUND as missing, BUSY as failed; one
    connection per control socket, each bottle renewed for its own lease."""
    client = Client({"a": None, "b": NotFound("x"), "c": Busy("x"), "d": None})
    opened: list[str] = []

    @contextmanager
    def connect(control: str) -> Iterator[Client]:
        opened.append(control)
        yield client

    due = [("a", "s1", 6.0), ("b", "s1", 6.0), ("c", "s2", 9.0), ("d", "s1", 3.0)]
    outcomes = renew_all(connect, due)
    assert outcomes == [Renewal.RENEWED, Renewal.MISSING, Renewal.FAILED, Renewal.RENEWED]
    assert opened == ["s1", "s2"]
    assert client.renewed == [("a", 6.0), ("b", 6.0), ("d", 3.0), ("c", 9.0)]


def test_an_unreachable_daemon_fails_the_rest_of_its_bottles() -> None:
    """A daemon that cannot be reached (restarting) or a connection that breaks: every
    bottle of that socket not yet renewed is failed (tried again next round)."""
    client = Client({"a": None, "b": ControlConnectionError("broken"), "c": None})

    @contextmanager
    def connect(control: str) -> Iterator[Client]:
        if control == "down":
            raise DaemonUnreachable("down", "no such file")
        yield client

    due = [("a", "up", 6.0), ("b", "up", 6.0), ("c", "up", 6.0), ("d", "down", 6.0)]
    outcomes = renew_all(connect, due)
    assert outcomes == [Renewal.RENEWED, Renewal.FAILED, Renewal.FAILED, Renewal.FAILED]
    assert [name for name, _ in client.renewed] == ["a", "b"]
