"""A node's host without Ray: its calls and rounds on an event loop, against a fake daemon (a
TEST DOUBLE of the control client) and a fake owner, with an injected clock."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
from ray.exceptions import ActorDiedError, GetTimeoutError

from bottlenet.control.clienterrors import ControlConnectionError
from bottlenet.errors import Draining, InvalidArgument, NotFound
from bottlenet.fleet.errors import BottleLost
from bottlenet.fleet.host import NodeHost, Phase
from bottlenet.fleet.renewal import OwnerCheck
from bottlenet.fleet.request import BottleRequest

T = TypeVar("T")
LEASED = BottleRequest(lease_seconds=6.0, control="unix:/fake")
UNLEASED = BottleRequest(lease_seconds=None, control="unix:/fake")


class FakeDaemon:
    """The node's daemon as the host's control calls reach it: the bottles it holds (name ->
    lease), every call in order, and scripted failures per call kind."""

    def __init__(self) -> None:
        self.bottles: dict[str, float | None] = {}
        #: each create's ``pool`` (None: left out, the daemon's default)
        self.pools: list[str | None] = []
        self.calls: list[tuple[str, str]] = []
        self.fail: dict[str, list[Exception]] = {}
        #: set, a create waits for ``release`` (to destroy while it is in flight)
        self.hold: threading.Event | None = None
        self.entered = threading.Event()
        self.lock = threading.Lock()

    def _call(self, kind: str, name: str) -> None:
        with self.lock:
            self.calls.append((kind, name))
            script = self.fail.get(kind)
            if script:
                raise script.pop(0)

    @contextmanager
    def connect(self, control: str) -> Iterator[FakeDaemon]:
        assert control == "unix:/fake"
        yield self

    def create_bottle(self, name: str, alias: str | None, spec: str | None, **kw: Any) -> None:
        self.entered.set()
        if self.hold is not None:
            self.hold.wait(30)
        self._call("create", name)
        assert kw["owner"] == "ray-job-01"
        self.pools.append(kw.get("pool"))
        self.bottles[name] = kw["lease_seconds"]

    def destroy_bottle(self, name: str, timeout: float | None = None) -> None:
        self._call("destroy", name)
        if self.bottles.pop(name, "none") == "none":
            raise NotFound(f"no bottle {name}")

    def renew_lease(self, name: str, seconds: float) -> None:
        self._call("renew", name)
        if name not in self.bottles:
            raise NotFound(f"no bottle {name}")

    def bottle_status(self, name: str) -> str:
        self._call("status", name)
        return f"record of {name}"


class FakeOwner:
    """The trainer's owner actor: ``ping.remote()`` answers as ``answer`` says."""

    def __init__(self) -> None:
        self.answer = OwnerCheck.ALIVE
        self.ping = self

    def remote(self) -> Awaitable[str]:
        async def ping() -> str:
            if self.answer is OwnerCheck.GONE:
                raise ActorDiedError()
            if self.answer is OwnerCheck.UNKNOWN:
                raise GetTimeoutError("no answer")
            return "alive"

        return ping()


class Rig:
    """A host, its daemon, its owner and its clock."""

    def __init__(self) -> None:
        self.daemon = FakeDaemon()
        self.owner = FakeOwner()
        self.now = 0.0
        self.host = NodeHost(
            self.owner,
            "ray-job-01",
            connect=self.daemon.connect,  # type: ignore[arg-type]
            clock=lambda: self.now,
            node_id="node-1234567890",
        )

    def kinds(self, kind: str) -> list[str]:
        return [name for k, name in self.daemon.calls if k == kind]


def run(test: Callable[[Rig], Awaitable[T]]) -> T:
    rig = Rig()

    async def main() -> T:
        try:
            return await test(rig)
        finally:
            rig.host._calls.shutdown(wait=True)
            rig.host._renewals.shutdown(wait=True)

    return asyncio.run(main())


def test_a_bottle_is_made_served_and_destroyed_once() -> None:
    """Create, status through the host, destroy twice: the daemon sees one create and one
    destroy; the second destroy is False, and a call after it is BottleLost."""

    async def test(rig: Rig) -> None:
        placement = await rig.host.create("b1", LEASED)
        assert (placement.node_id, placement.name, placement.refused) == (
            "node-1234567890",
            "b1",
            False,
        )
        assert await rig.host.status("b1") == "record of b1"
        assert (await rig.host.destroy("b1"), await rig.host.destroy("b1")) == (True, False)
        assert rig.kinds("create") == ["b1"] and rig.kinds("destroy") == ["b1"]
        with pytest.raises(BottleLost, match="b1 is gone"):
            await rig.host.status("b1")

    run(test)


def test_a_refusal_is_a_placement_and_leaves_no_row() -> None:
    """DRAINING comes back as the node's refusal (code and message), and the host holds
    nothing for the name."""

    async def test(rig: Rig) -> None:
        rig.daemon.fail["create"] = [Draining("the node is draining")]
        placement = await rig.host.create("b1", LEASED)
        assert (placement.refusal_code, placement.refusal_message) == (
            "DRAINING",
            "the node is draining",
        )
        assert await rig.host.phases() == {}

    run(test)


def test_a_callers_error_is_raised_and_leaves_no_row() -> None:
    """A create the daemon rejects for the caller's fault (a bad spec) is raised, not
    retried elsewhere, and nothing stays in the table."""

    async def test(rig: Rig) -> None:
        rig.daemon.fail["create"] = [InvalidArgument("bad spec")]
        with pytest.raises(InvalidArgument):
            await rig.host.create("b1", LEASED)
        assert await rig.host.phases() == {}

    run(test)


def test_a_lost_answer_removes_the_bottle_before_refusing() -> None:
    """The create's answer never came (the connection broke): the bottle may exist, so the
    host destroys it, then says UNREACHABLE."""

    async def test(rig: Rig) -> None:
        rig.daemon.fail["create"] = [ControlConnectionError("no answer within 300s")]
        placement = await rig.host.create("b1", LEASED)
        assert placement.refusal_code == "UNREACHABLE"
        assert rig.kinds("destroy") == ["b1"]

    run(test)


def test_a_destroy_during_the_create_waits_and_destroys() -> None:
    """A destroy that comes while the create is in flight (an abandoned batch) waits for the
    create's answer, then destroys the bottle: nothing is left behind."""

    async def test(rig: Rig) -> None:
        rig.daemon.hold = threading.Event()
        creating = asyncio.ensure_future(rig.host.create("b1", LEASED))
        await asyncio.get_running_loop().run_in_executor(None, rig.daemon.entered.wait, 30)
        destroying = asyncio.ensure_future(rig.host.destroy("b1"))
        await asyncio.sleep(0)
        assert not destroying.done()
        rig.daemon.hold.set()
        assert not (await creating).refused
        assert await destroying is True
        assert rig.daemon.calls == [("create", "b1"), ("destroy", "b1")]
        assert rig.daemon.bottles == {}

    run(test)


def test_a_round_renews_each_leased_bottle_after_the_owner_answers() -> None:
    """Owner alive: each leased bottle is renewed (the unleased one never); the rounds come
    every third of the shortest lease."""

    async def test(rig: Rig) -> None:
        assert rig.host.interval() == 10.0  # nothing leased: the owner check alone
        await rig.host.create("a", LEASED)
        await rig.host.create("b", UNLEASED)
        await rig.host.create("c", BottleRequest(lease_seconds=3.0, control="unix:/fake"))
        assert rig.host.interval() == 1.0
        assert await rig.host.round() is True
        assert sorted(rig.kinds("renew")) == ["a", "c"]

    run(test)


def test_no_answer_from_the_owner_renews_nothing() -> None:
    """Owner unknown (a partition, a timeout): the round renews nothing, so the node's lease
    runs out; the round is counted as skipped."""

    async def test(rig: Rig) -> None:
        await rig.host.create("a", LEASED)
        rig.owner.answer = OwnerCheck.UNKNOWN
        assert await rig.host.round() is True
        assert rig.kinds("renew") == [] and rig.host.skipped == 1

    run(test)


def test_the_owner_gone_ends_the_host_and_destroys_every_bottle() -> None:
    """Owner known dead: the round says so, and the host's end destroys each bottle."""

    async def test(rig: Rig) -> None:
        for name in ("a", "b", "c"):
            await rig.host.create(name, LEASED)
        rig.owner.answer = OwnerCheck.GONE
        assert await rig.host.round() is False
        assert rig.kinds("renew") == []
        await rig.host.end()
        assert sorted(rig.kinds("destroy")) == ["a", "b", "c"] and rig.daemon.bottles == {}

    run(test)


def test_a_bottle_missing_for_a_whole_lease_is_lost() -> None:
    """The daemon answers NOT_FOUND (it reaped the bottle): lost only after a whole lease
    of it; then calls are BottleLost and a destroy lets it go without a daemon call."""

    async def test(rig: Rig) -> None:
        await rig.host.create("a", LEASED)
        del rig.daemon.bottles["a"]
        await rig.host.round()
        rig.now = 5.9
        await rig.host.round()
        assert await rig.host.phases() == {"a": Phase.SERVING}
        rig.now = 6.0
        await rig.host.round()
        assert await rig.host.phases() == {"a": Phase.LOST}
        with pytest.raises(BottleLost, match="a is lost"):
            await rig.host.exec("a", ["true"])
        assert await rig.host.destroy("a") is False
        assert await rig.host.phases() == {} and rig.kinds("destroy") == []

    run(test)


def test_a_name_twice_is_a_callers_error() -> None:
    """The same name created twice on one host is refused before the daemon is asked."""

    async def test(rig: Rig) -> None:
        await rig.host.create("a", LEASED)
        with pytest.raises(InvalidArgument):
            await rig.host.create("a", LEASED)
        assert rig.kinds("create") == ["a"]

    run(test)


def test_each_host_presents_a_capability_of_its_own() -> None:
    """The daemon admits the Ray uid scoped and every job runs as it: a host's calls present
    its own capability (security-4 N6), another owner's host another one."""
    one = NodeHost(FakeOwner(), "ray-job-01", node_id="node-1")
    two = NodeHost(FakeOwner(), "ray-job-02", node_id="node-1")
    assert one.capability != two.capability and len(one.capability) >= 22
    client = one._connect("unix:/fake")
    assert client.capability == one.capability


def test_a_request_asks_the_daemon_for_a_warm_bottle() -> None:
    """``BottleRequest.pool`` reaches the daemon's create (``auto``, the default, is left
    out, as an older daemon knows no ``pool``); a value outside auto/off/only is refused."""

    async def test(rig: Rig) -> None:
        await rig.host.create("b1", LEASED)
        await rig.host.create("b2", BottleRequest(control="unix:/fake", pool="only"))
        assert rig.daemon.pools == [None, "only"]

    run(test)
    with pytest.raises(InvalidArgument, match="pool"):
        BottleRequest(pool="warm")
