"""The node contract's responders (NodeInfo, Drain, Undrain, RenewLease) and a scoped peer's
view, on a StringTransport with the in-memory backend and node."""

from __future__ import annotations

from typing import Any

import pytest

from bottlenet.control import commands as C
from bottlenet.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable
from bottlenet.node.info import Capacity, NodeReport

from .fakes import OWN_UID, Conn, FakeBackend, make_factory

SCOPED_UID = 4243


class FakeNode:
    """An in-memory NodeControl that records what it was asked."""

    def __init__(self) -> None:
        self.draining = False
        self.bottles = 1
        self.renewed: list[tuple[str, float]] = []
        self.waited: list[float] = []
        self.vm_uids_left: int | None = None

    def report(self) -> NodeReport:
        return NodeReport(
            host="n1",
            labels=(("zone", "a"),),
            privilege="root",
            smolvm=None,
            vm_possible=False,
            vm_why_not="no smolvm found",
            kvm="usable",
            capacity=Capacity(256, self.bottles, 0, 3, 100),
            health="ok",
            reasons=(),
            draining=self.draining,
            vm_uids_left=self.vm_uids_left,
            vm_uids=None if self.vm_uids_left is None else f"{self.vm_uids_left} VM uids left",
        )

    def held(self) -> int:
        return self.bottles

    def drain(self) -> None:
        self.draining = True

    def undrain(self) -> None:
        self.draining = False

    def renew_lease(self, name: str, seconds: float) -> None:
        self.renewed.append((name, seconds))

    async def when_empty(self, timeout: float) -> bool:
        self.waited.append(timeout)
        return True


def conn_for(uid: int = OWN_UID, **kw: Any) -> tuple[Conn, FakeNode]:
    node = FakeNode()
    factory = make_factory(uid=uid, node=node, scoped_uids=frozenset({SCOPED_UID}), **kw)
    return Conn(factory), node


def test_node_info_answers_the_report() -> None:
    """Every field of the report reaches the answer (labels as KEY=VALUE)."""
    c, _node = conn_for()
    r = c.call(C.NodeInfo)
    assert (r["host"], r["labels"], r["draining"], r["protocol"]) == ("n1", ["zone=a"], False, 1)
    assert (r["max_bottles"], r["bottles"], r["connections_used"]) == (256, 1, 3)
    assert (r["vm_possible"], r["vm_why_not"], r["health_reasons"]) == (
        False,
        "no smolvm found",
        [],
    )
    c.close()


def test_node_info_carries_the_vm_uids_left_when_counted() -> None:
    """N8: the additive ``vm_uids_left``/``vm_uids`` fields: absent (None) until counted."""
    c, node = conn_for()
    assert (c.call(C.NodeInfo)["vm_uids_left"], c.call(C.NodeInfo)["vm_uids"]) == (None, None)
    node.vm_uids_left = 123
    r = c.call(C.NodeInfo)
    assert (r["vm_uids_left"], r["vm_uids"]) == (123, "123 VM uids left")
    c.close()


def test_drain_and_undrain() -> None:
    """Drain answers held/empty; with wait it waits (a week at most without a timeout);
    a bad timeout changes nothing."""
    c, node = conn_for()
    assert c.call(C.Drain) == {"draining": True, "held": 1, "empty": False}
    assert c.call(C.Drain, wait=True, timeout=30.0)["empty"] is True
    c.call(C.Drain, wait=True)
    assert node.waited == [30.0, 7 * 86400.0]
    assert c.call(C.Undrain) == {"draining": False}
    for bad in (0.0, -1.0, 7 * 86400.0 + 1):
        with pytest.raises(InvalidArgument):
            c.call(C.Drain, timeout=bad)
    assert not node.draining
    c.close()


def test_no_node_is_unavailable() -> None:
    """A factory without the node contract answers UNAVAILABLE, not a traceback."""
    c = Conn(make_factory())
    with pytest.raises(Unavailable):
        c.call(C.NodeInfo)
    c.close()


def test_scoped_peer_sees_only_its_own_bottles() -> None:
    """A scoped uid's creates are recorded as its own; another's bottle is NOT_FOUND for
    every command; Drain and Undrain are PERMISSION_DENIED; NodeInfo answers."""
    backend = FakeBackend()
    c, node = conn_for(SCOPED_UID, backend=backend)
    full = Conn(make_factory(backend, node=node))
    full.call(C.CreateBottle, name="theirs")
    r = c.call(C.CreateBottle, name="mine", owner="actor-1", lease_seconds=60.0)
    assert r["bottle"].owner == "actor-1"
    creator = backend.bottles["mine"].tenancy
    assert creator is not None and creator.creator == f"uid:{SCOPED_UID}"
    assert [b.name for b in c.call(C.ListBottles)["bottles"]] == ["mine"]
    assert sorted(b.name for b in full.call(C.ListBottles)["bottles"]) == ["mine", "theirs"]
    for command, kw in (
        (C.BottleStatus, {"name": "theirs"}),
        (C.DestroyBottle, {"name": "theirs"}),
        (C.RenewLease, {"name": "theirs", "seconds": 60.0}),
        (C.AddForward, {"bottle": "theirs", "label": "w", "target": "127.0.0.1:9"}),
        (C.ListForwards, {"bottle": "theirs"}),
        (C.Stats, {"bottle": "theirs"}),
    ):
        with pytest.raises(NotFound):
            c.call(command, **kw)
    assert "theirs" in backend.bottles
    c.call(C.RenewLease, name="mine", seconds=30.0)
    assert node.renewed == [("mine", 30.0)]
    for command in (C.Drain, C.Undrain):
        with pytest.raises(PermissionDenied):
            c.call(command)
    assert not node.draining
    assert c.call(C.NodeInfo)["host"] == "n1"
    c.call(C.DestroyBottle, name="mine")
    assert sorted(backend.bottles) == ["theirs"]
    c.close()
    full.close()


def test_scoped_peer_may_not_ask_leftovers() -> None:
    """Leftovers (selftest) reports on any gone name: full control only."""
    c, _node = conn_for(SCOPED_UID)
    with pytest.raises(PermissionDenied):
        c.call(C.Leftovers, name="gone")
    c.close()
