"""A revocation is durable or stays visibly pending; it never comes back at restart (T5)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from typing import Any

import pytest

from bottlenet.bottles.registry import RESYNC_INTERVAL
from bottlenet.bottles.tenancy import Tenancy
from bottlenet.errors import NotFound, Unavailable
from bottlenet.forward.spec import parse_target
from tests.bottles.memsmolvm import Rig
from tests.bottles.test_drain import node_of

Rigs = Callable[..., Rig]


def _forward_bottle(rigs: Rigs) -> Rig:
    rig = rigs()
    rig.run(rig.registry.create_bottle("fo1", ipaddress.IPv4Address("127.79.0.7")))
    rig.run(rig.registry.add_forward("fo1", "db", parse_target("127.0.0.1:5432")))
    return rig


def _disk_full(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    def enospc(doc: dict[str, Any]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rig.store, "_append", enospc)


def test_t5_forward_rm_not_durable_stays_closed_says_so_and_never_comes_back(
    rigs: Rigs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """T5: `forward rm` on a full disk: the listener stays closed, the bottle's detail says
    the removal is not yet durable, a retry is UNAVAILABLE (not NOT_FOUND), and once the
    disk takes writes again the removal is written: the restarted daemon has no forward."""
    rig = _forward_bottle(rigs)
    _disk_full(rig, monkeypatch)
    with pytest.raises(Unavailable, match="not yet durable"):
        rig.run(rig.registry.remove_forward("fo1", "db"))
    assert rig.table.list("fo1") == []
    detail = rig.registry.get_bottle("fo1").detail
    assert detail is not None and "removal of forward 'db' is not yet durable" in detail
    with pytest.raises(Unavailable, match="not yet durable"):
        rig.run(rig.registry.remove_forward("fo1", "db"))
    monkeypatch.undo()  # space again
    rig.clock.advance(RESYNC_INTERVAL)
    assert rig.registry.get_bottle("fo1").detail is None
    assert rig.state()["fo1"]["forwards"] == []
    rig.close()
    again = rigs(smolvm=rig.smolvm)
    again.recover()
    assert again.table.list("fo1") == []


def test_t5_bottle_rm_not_durable_stays_listed_until_it_is(
    rigs: Rigs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """T5: `bottle rm` on a full disk: listeners closed, the bottle stays listed with why
    (its alias kept), a retry after the disk recovered completes it, and it never returns."""
    rig = _forward_bottle(rigs)
    _disk_full(rig, monkeypatch)
    with pytest.raises(Unavailable, match="destroy is done"):
        rig.run(rig.registry.destroy_bottle("fo1"))
    assert rig.table.list("fo1") == []
    detail = rig.registry.get_bottle("fo1").detail
    assert detail is not None and "destroy is not yet durable" in detail
    with pytest.raises(Unavailable):  # still full: the retry says so
        rig.run(rig.registry.add_forward("fo1", "web", parse_target("127.0.0.1:8080")))
    assert rig.table.list("fo1") == []
    monkeypatch.undo()
    rig.run(rig.registry.destroy_bottle("fo1"))  # the retry completes it (no NOT_FOUND)
    assert not rig.registry.has_bottle("fo1")
    assert "fo1" not in rig.state()
    with pytest.raises(NotFound):
        rig.run(rig.registry.destroy_bottle("fo1"))
    rig.close()
    again = rigs(smolvm=rig.smolvm)
    again.recover()
    assert not again.registry.has_bottle("fo1")


def test_t5_the_retry_keeps_going_while_the_disk_stays_full(
    rigs: Rigs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """T5: a disk that stays full across several retries does not end them (tests-3 D12):
    each failed retry arms the next, and the first one after the disk recovers writes the
    removal, with no other operation on the bottle in between."""
    rig = _forward_bottle(rigs)
    _disk_full(rig, monkeypatch)
    with pytest.raises(Unavailable, match="not yet durable"):
        rig.run(rig.registry.remove_forward("fo1", "db"))
    for _ in range(3):
        rig.clock.advance(RESYNC_INTERVAL)  # still full: this retry fails, the next is armed
        assert rig.registry.get_bottle("fo1").detail is not None
    monkeypatch.undo()  # space again
    rig.clock.advance(RESYNC_INTERVAL)
    assert rig.registry.get_bottle("fo1").detail is None
    assert rig.state()["fo1"]["forwards"] == []


def test_a_second_disk_full_episode_is_retried_by_the_timer_too(
    rigs: Rigs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry timer is armed again for a later failed revocation after its first one
    fired: the second removal is written by the timer alone, with no other operation."""
    rig = _forward_bottle(rigs)
    rig.run(rig.registry.add_forward("fo1", "web", parse_target("127.0.0.1:8080")))
    _disk_full(rig, monkeypatch)
    with pytest.raises(Unavailable, match="not yet durable"):
        rig.run(rig.registry.remove_forward("fo1", "db"))
    monkeypatch.undo()
    rig.clock.advance(RESYNC_INTERVAL)
    assert rig.registry.get_bottle("fo1").detail is None
    _disk_full(rig, monkeypatch)
    with pytest.raises(Unavailable, match="not yet durable"):
        rig.run(rig.registry.remove_forward("fo1", "web"))
    monkeypatch.undo()
    rig.clock.advance(RESYNC_INTERVAL)
    assert rig.registry.get_bottle("fo1").detail is None
    assert rig.state()["fo1"]["forwards"] == []


def test_a_forward_that_cannot_be_recorded_is_not_left_listening(
    rigs: Rigs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AddForward on a full disk is UNAVAILABLE, and its listener is closed again: no such
    forward in the table and a connect to its port is refused."""
    rig = _forward_bottle(rigs)
    with socket.socket() as probe:
        probe.bind(("127.79.0.7", 0))
        port = probe.getsockname()[1]
    _disk_full(rig, monkeypatch)
    with pytest.raises(Unavailable):
        rig.run(rig.registry.add_forward("fo1", "web", parse_target("127.0.0.1:8080"), port))
    assert [f.spec.label for f in rig.table.list("fo1")] == ["db"]
    assert [f.label for f in rig.registry.get_bottle("fo1").forwards] == ["db"]
    with socket.socket() as client, pytest.raises(ConnectionRefusedError):
        client.connect(("127.79.0.7", port))


def test_a_forward_only_create_that_cannot_be_recorded_gives_its_name_and_alias_back(
    rigs: Rigs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward-only create on a full disk is UNAVAILABLE and holds nothing: once the disk
    takes writes, its name and its alias can be created again."""
    rig = rigs()
    alias = ipaddress.IPv4Address("127.79.0.9")

    def enospc(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rig.store, "_append", enospc)
    with pytest.raises(Unavailable):
        rig.run(rig.registry.create_bottle("fo2", alias))
    assert not rig.registry.has_bottle("fo2") and rig.registry.held() == 0
    monkeypatch.undo()
    rig.run(rig.registry.create_bottle("fo3", alias))  # the alias is free again
    rig.run(rig.registry.destroy_bottle("fo3"))
    assert rig.run(rig.registry.create_bottle("fo2", alias)).alias == str(alias)


def test_a_renewal_never_writes_back_a_bottle_whose_destroy_is_not_durable(
    rigs: Rigs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leased bottle's destroy on a full disk, then a renewal once the disk is free: the
    renewal does not write the bottle's record again, and the retry timer still removes it."""
    rig = rigs()
    node = node_of(rig)
    lease = Tenancy.requested("o", 60, None)
    rig.run(rig.registry.create_bottle("fo1", tenancy=lease))
    _disk_full(rig, monkeypatch)
    with pytest.raises(Unavailable, match="destroy is done"):
        rig.run(rig.registry.destroy_bottle("fo1"))
    monkeypatch.undo()
    node.renew_lease("fo1", 120)
    rig.clock.advance(RESYNC_INTERVAL)
    assert not rig.registry.has_bottle("fo1") and "fo1" not in rig.state()


def test_a_forward_removal_retried_after_it_became_durable_succeeds(
    rigs: Rigs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``forward rm`` on a full disk, then again once the disk is free: the retry writes the
    earlier removal and answers OK (not NOT_FOUND)."""
    rig = _forward_bottle(rigs)
    _disk_full(rig, monkeypatch)
    with pytest.raises(Unavailable, match="not yet durable"):
        rig.run(rig.registry.remove_forward("fo1", "db"))
    monkeypatch.undo()
    rig.run(rig.registry.remove_forward("fo1", "db"))
    assert rig.state()["fo1"]["forwards"] == [] and rig.registry.get_bottle("fo1").detail is None
