"""The node contract's responders (NodeInfo, Drain, Undrain, RenewLease) and a scoped peer's
view, on a StringTransport with the in-memory backend and node."""

from __future__ import annotations

from typing import Any

import pytest
from attrs import evolve
from twisted.internet.defer import Deferred

from bottlenet.control import codec
from bottlenet.control import commands as C
from bottlenet.control.identity import Identity
from bottlenet.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable
from bottlenet.node.info import Capacity, NodeReport

from .fakes import OWN_UID, Conn, FakeBackend, counters, make_factory

SCOPED_UID = 4243
OTHER_SCOPED = 4245


class FakeNode:
    """An in-memory NodeControl that records what it was asked."""

    def __init__(self) -> None:
        self.draining = False
        self.bottles = 1
        self.renewed: list[tuple[str, float]] = []
        #: While not None, the daemon is restoring its state until this fires.
        self.restoring: Deferred[None] | None = None
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

    async def when_serving(self) -> None:
        """Recovery is done unless a test holds ``restoring`` (then: once it fires)."""
        if self.restoring is not None:
            await self.restoring

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
    """A scoped uid's create answers the capability its later calls present; the bottle is
    its own name space's on the node; another's bottle, or its own without the capability,
    is NOT_FOUND for every command; Drain and Undrain are PERMISSION_DENIED; NodeInfo counts
    its own bottles only."""
    backend = FakeBackend()
    c, node = conn_for(SCOPED_UID, backend=backend)
    full = Conn(make_factory(backend, node=node))
    full.call(C.CreateBottle, name="theirs")
    r = c.call(C.CreateBottle, name="mine", owner="actor-1", lease_seconds=60.0)
    mine, capability = r["bottle"], r["bottle"].capability
    assert (mine.name, mine.owner) == ("mine", "actor-1")
    assert capability is not None and len(capability) >= 22
    [on_node] = [n for n in backend.bottles if n.startswith("mine-")]
    tenancy = backend.bottles[on_node].tenancy
    assert tenancy is not None and tenancy.creator is not None
    assert tenancy.creator.startswith(f"uid:{SCOPED_UID}/") and capability not in tenancy.creator
    key = {"capability": capability}
    assert [b.name for b in c.call(C.ListBottles, **key)["bottles"]] == ["mine"]
    assert c.call(C.ListBottles)["bottles"] == []  # no capability: none of its bottles
    assert sorted(b.name for b in full.call(C.ListBottles)["bottles"]) == [on_node, "theirs"]
    assert all(b.capability is None for b in full.call(C.ListBottles)["bottles"])
    for command, kw in (
        (C.BottleStatus, {"name": "theirs"}),
        (C.DestroyBottle, {"name": "theirs"}),
        (C.RenewLease, {"name": "theirs", "seconds": 60.0}),
        (C.AddForward, {"bottle": "theirs", "label": "w", "target": "127.0.0.1:9"}),
        (C.ListForwards, {"bottle": "theirs"}),
        (C.Stats, {"bottle": "theirs"}),
    ):
        for given in (key, {}):
            with pytest.raises(NotFound):
                c.call(command, **kw, **given)
    with pytest.raises(NotFound):
        c.call(C.BottleStatus, name="mine")  # its own, but no capability given
    assert "theirs" in backend.bottles
    assert c.call(C.RenewLease, name="mine", seconds=30.0, **key)["bottle"].name == "mine"
    assert node.renewed == [(on_node, 30.0)]
    for command in (C.Drain, C.Undrain):
        with pytest.raises(PermissionDenied):
            c.call(command)
    assert not node.draining
    info = c.call(C.NodeInfo, **key)
    assert (info["host"], info["max_bottles"], info["bottles"]) == ("n1", 256, 1)
    assert c.call(C.NodeInfo)["bottles"] == 0
    assert full.call(C.NodeInfo)["bottles"] == node.bottles
    c.call(C.DestroyBottle, name="mine", **key)
    assert sorted(backend.bottles) == ["theirs"]
    c.close()
    full.close()


def test_a_scoped_peer_may_not_choose_an_alias() -> None:
    """An alias is the node's: a scoped create that names one is refused alike whether it is
    free or held (the answer says nothing of other bottles)."""
    backend = FakeBackend()
    c, node = conn_for(SCOPED_UID, backend=backend)
    full = Conn(make_factory(backend, node=node))
    held = full.call(C.CreateBottle, name="theirs")["bottle"].alias
    answers = []
    for alias in (held, "127.77.0.250"):
        with pytest.raises(PermissionDenied) as e:
            c.call(C.CreateBottle, name="probe", alias=alias)
        answers.append(e.value.message)
    assert answers[0] == answers[1] and "alias" in answers[0]
    assert sorted(backend.bottles) == ["theirs"]
    c.close()
    full.close()


def test_scoped_peer_may_not_ask_leftovers() -> None:
    """Leftovers (selftest) reports on any gone name: full control only."""
    c, _node = conn_for(SCOPED_UID)
    with pytest.raises(PermissionDenied):
        c.call(C.Leftovers, name="gone")
    c.close()


def test_a_scoped_peers_names_and_capabilities_are_checked() -> None:
    """Two capabilities of one uid each have their own ``x``; a name too long for a scoped
    name space and a capability too short are INVALID_ARGUMENT; a unix target lives under
    the node's name of the bottle; NodeInfo counts the presenting capability's connections."""
    backend = FakeBackend()
    root = "/run/bn-test-state"
    c, _node = conn_for(SCOPED_UID, backend=backend, unix_target_root=root)
    one, two = {"capability": "a" * 22}, {"capability": "b" * 22}
    for key, owner in ((one, "job-1"), (two, "job-2")):
        assert c.call(C.CreateBottle, name="x", owner=owner, **key)["bottle"].name == "x"
    assert c.call(C.BottleStatus, name="x", **one)["bottle"].owner == "job-1"
    assert c.call(C.BottleStatus, name="x", **two)["bottle"].owner == "job-2"
    assert len(backend.bottles) == 2 and "x" not in backend.bottles
    with pytest.raises(InvalidArgument, match="at most 50 characters"):
        c.call(C.CreateBottle, name="n" * 51, **one)
    with pytest.raises(InvalidArgument, match="capability"):
        c.call(C.CreateBottle, name="y", capability="short")
    [on_node] = [n for n, b in backend.bottles.items() if b.tenancy and b.tenancy.owner == "job-1"]
    with pytest.raises(InvalidArgument, match=f"not under {root}/targets/{on_node}"):
        c.call(C.AddForward, bottle="x", label="sock", target=f"unix:{root}/targets/x/s", **one)
    target = f"unix:{root}/targets/{on_node}/s.sock"
    r = c.call(C.AddForward, bottle="x", label="sock", target=target, **one)
    assert r["forward"].bottle == "x"
    backend.forwards[on_node] = tuple(
        evolve(f, counters=counters(active=3)) for f in backend.forwards[on_node]
    )
    assert c.call(C.NodeInfo, **one)["connections_used"] == 3
    assert c.call(C.NodeInfo, **two)["connections_used"] == 0
    c.close()


def test_a_name_of_a_scoped_name_space_made_by_another_is_not_its_own() -> None:
    """A bottle another peer named ``x-<tag>`` (the tag of a scoped identity's name space)
    is not that identity's ``x``: not listed, NOT_FOUND; and two uids with one capability
    have name spaces of their own."""
    backend = FakeBackend()
    c, node = conn_for(SCOPED_UID, backend=backend)
    other = Conn(
        make_factory(backend, uid=OTHER_SCOPED, node=node, scoped_uids=frozenset({OTHER_SCOPED}))
    )
    full = Conn(make_factory(backend, node=node))
    key = {"capability": "k" * 22}
    tag = Identity(SCOPED_UID, key["capability"]).digest[:12]
    full.call(C.CreateBottle, name=f"x-{tag}")
    assert c.call(C.ListBottles, **key)["bottles"] == []
    with pytest.raises(NotFound):
        c.call(C.BottleStatus, name="x", **key)
    assert other.call(C.CreateBottle, name="y", **key)["bottle"].name == "y"
    assert c.call(C.CreateBottle, name="y", **key)["bottle"].name == "y"
    assert len(backend.bottles) == 3
    for conn in (c, other, full):
        conn.close()


def test_renew_lease_waits_for_the_restore() -> None:
    """While the daemon restores its state a RenewLease is answered after the restore, not
    as a missing bottle."""
    backend = FakeBackend()
    node = FakeNode()
    c = Conn(make_factory(backend, node=node))
    c.call(C.CreateBottle, name="b1", lease_seconds=60.0)
    node.restoring = Deferred()
    c.send(codec.encode_request(C.RenewLease, b"r1", {"name": "b1", "seconds": 90.0}))
    assert c.boxes() == [] and node.renewed == []
    node.restoring.callback(None)
    (box,) = c.boxes()
    assert codec.decode_answer(C.RenewLease, box)["bottle"].name == "b1"
    assert node.renewed == [("b1", 90.0)]
    c.close()
