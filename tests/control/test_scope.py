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
from bottlenet.control.scope import ScopedBackend
from bottlenet.errors import NotFound, PermissionDenied
from bottlenet.forward.spec import parse_target
from tests.control.fakes import FakeBackend

ALICE, BOB = "uid:4243", "uid:4244"


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
    """Creates stamp the creator; another's bottle is NOT_FOUND in every bottle method, sync or
    async; listings hold its own rows only; Leftovers is PERMISSION_DENIED; events by creator."""
    fake = FakeBackend()
    alice, bob = ScopedBackend(fake, ALICE), ScopedBackend(fake, BOB)
    mine = run(alice.create_bottle("a1", tenancy=Tenancy(owner="t1")))
    run(bob.create_bottle("b1"))
    run(fake.create_bottle("plain"))
    assert mine.tenancy == Tenancy(owner="t1", creator=ALICE)  # type: ignore[attr-defined]
    run(alice.add_forward("a1", "web", parse_target("127.0.0.1:9")))
    run(bob.add_forward("b1", "db", parse_target("127.0.0.1:7")))
    for call in (
        lambda: alice.get_bottle("b1"),
        lambda: alice.bridge_status("b1"),
        lambda: alice.list_forwards("b1"),
        lambda: run(alice.destroy_bottle("b1")),
        lambda: run(alice.remove_forward("b1", "db")),
    ):
        with pytest.raises(NotFound, match="bottle b1 does not exist"):
            call()
    assert [b.name for b in alice.list_bottles()] == ["a1"]
    assert [f.spec.bottle for f in alice.list_forwards(None)] == ["a1"]
    assert [f.spec.label for f in alice.list_forwards("a1")] == ["web"]
    with pytest.raises(PermissionDenied, match="Leftovers: a scoped peer may not ask for it"):
        run(alice.leftovers("gone"))
    assert "b1" in fake.bottles and ("destroy_bottle", ("b1",)) not in fake.calls
    event = BottleEvent("ready", "a1", 0.0, creator=ALICE)
    assert alice.sees(event) and not bob.sees(event) and bob.sees(BottleEvent("drained", "", 0))
    assert ipaddress.ip_address(fake.bottles["a1"].alias or "")
