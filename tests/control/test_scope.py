"""A scoped peer's view derived from the backend's one method list (``control/scope.py``), in
memory over the fake backend (``tests/control/fakes.py``): each ``ControlBackend`` method
declares how a scoped peer's call is checked, and the view checks each call by it."""

from __future__ import annotations

import asyncio
import ipaddress
import typing

import pytest

from bottlenet.bottles.events import BottleEvent
from bottlenet.bottles.tenancy import Tenancy
from bottlenet.control.backend import ControlBackend, Scope, scoping
from bottlenet.control.identity import Identity
from bottlenet.control.scope import ScopedBackend
from bottlenet.errors import NotFound, PermissionDenied
from bottlenet.forward.spec import parse_target
from tests.control.fakes import FakeBackend

ALICE, BOB = Identity(4243, "a" * 22), Identity(4243, "b" * 22)  # one uid, two jobs


def run(coro: typing.Coroutine[object, object, object]) -> object:
    return asyncio.new_event_loop().run_until_complete(coro)


def backend_methods() -> list[str]:
    """Every method the ``ControlBackend`` protocol declares."""
    return [n for n, v in vars(ControlBackend).items() if callable(v) and not n.startswith("_")]


def test_every_backend_method_declares_how_a_scoped_peer_is_checked() -> None:
    """The one method list: no method of the protocol lacks a scope, and the view refuses a
    name that is not one of them (a new method is never open to scoped peers by default)."""
    methods = backend_methods()
    assert len(methods) >= 14 and all(isinstance(scoping(n).scope, Scope) for n in methods)
    assert scoping("leftovers").scope is Scope.HOST
    view = ScopedBackend(FakeBackend(), ALICE)
    with pytest.raises(AttributeError):
        view.drain  # noqa: B018 (the node's, not the backend's)


def test_the_derived_view_confines_a_scoped_peer_to_its_own_bottles() -> None:
    """Creates go into the peer's name space, stamped with its creator; another's bottle is
    NOT_FOUND in every bottle method, sync or async; listings hold its own rows under its
    names; Leftovers and a chosen alias are PERMISSION_DENIED; events by creator."""
    fake = FakeBackend()
    alice, bob = ScopedBackend(fake, ALICE), ScopedBackend(fake, BOB)
    mine = run(alice.create_bottle("x", tenancy=Tenancy(owner="t1")))
    run(bob.create_bottle("y"))
    run(fake.create_bottle("plain"))
    assert mine.name == "x" and mine.tenancy == Tenancy(owner="t1", creator=ALICE.creator)  # type: ignore[attr-defined]
    node_x = ALICE.node_name("x")
    assert fake.bottles[node_x].tenancy == Tenancy(owner="t1", creator=ALICE.creator)
    run(alice.add_forward("x", "web", parse_target("127.0.0.1:9")))
    run(bob.add_forward("y", "db", parse_target("127.0.0.1:7")))
    for call in (
        lambda: alice.get_bottle("y"),
        lambda: alice.bridge_status("y"),
        lambda: alice.list_forwards("y"),
        lambda: run(alice.destroy_bottle("y")),
        lambda: run(alice.remove_forward("y", "db")),
    ):
        with pytest.raises(NotFound, match="bottle y does not exist"):
            call()
    assert [b.name for b in alice.list_bottles()] == ["x"]
    assert [f.spec.bottle for f in alice.list_forwards(None)] == ["x"]
    assert [f.spec.label for f in alice.list_forwards("x")] == ["web"]
    with pytest.raises(PermissionDenied, match="Leftovers: a scoped peer may not ask for it"):
        run(alice.leftovers("gone"))
    with pytest.raises(PermissionDenied, match="may not choose an alias"):
        run(alice.create_bottle("z", ipaddress.IPv4Address("127.77.0.9")))
    assert (
        BOB.node_name("y") in fake.bottles
        and ("destroy_bottle", (BOB.node_name("y"),)) not in fake.calls
    )
    event = BottleEvent("ready", node_x, 0.0, creator=ALICE.creator)
    seen = alice.sees(event)
    assert seen is not None and seen.bottle == "x" and bob.sees(event) is None
    assert bob.sees(BottleEvent("drained", "", 0)) is not None
