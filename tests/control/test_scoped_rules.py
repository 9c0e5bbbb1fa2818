"""Scoped control peers' rules (``--allow-uid UID:scoped``, issue 28) against the daemon's real
service tree in process (``tests/bottles/harness.py``, fake smolvm test double): the registry,
the scope, the event hub and a restart on the same state dir are the daemon's own; only the
peer's uid is told to the socket's door instead of read with ``SO_PEERCRED``, so a client in
this process can be another uid. ``test_scoped.py`` keeps the proof with a real second uid and
``bottlenetctl``'s output."""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Callable
from typing import Any

from attrs import evolve
from twisted.internet import reactor
from twisted.internet.defer import Deferred

from bottlenet.control.client import ControlClient, EventStream, connect_control
from bottlenet.control.context import UnixAdmission
from bottlenet.control.peercred import PeerCred, get_peer_credentials
from bottlenet.control.scope import Identity
from bottlenet.errors import AlreadyExists, Draining, NotFound, PermissionDenied
from tests.bottles.harness import DaemonCase

ALICE, BOB = 4243, 4244
SCOPED = ("--allow-uid", f"{ALICE}:scoped", "--allow-uid", f"{BOB}:scoped")
#: Each uid's capability in these tests (``key(uid, n)``: its n-th job's).
_HEX = re.compile(r"-[0-9a-f]{12}$")


def key(uid: int, job: int = 0) -> str:
    return f"job-{job}-of-uid-{uid}-0123456789"


def plain(name: str) -> str:
    """A node's bottle name without a scoped name space's tag."""
    return _HEX.sub("", name)


class ScopedRuleTests(DaemonCase):
    def setUp(self) -> None:
        super().setUp()
        #: The uids the next connections are told to have, in order of arrival.
        self.arriving: list[int] = []

    def credentials(self, sock: socket.socket) -> PeerCred:
        """The next arriving uid, else the kernel's word (the daemon's own uid)."""
        real = get_peer_credentials(sock)
        return PeerCred(uid=self.arriving.pop(0), pid=real.pid) if self.arriving else real

    async def start_scoped(self) -> ControlClient:
        """The daemon with two scoped uids; its UNIX door asks :meth:`credentials`."""
        client = await self.start(*SCOPED, vm_bottles=False)
        await client.ping()  # its own connection is admitted before the door changes
        assert self.root is not None
        for factory in self.root.control_factories:
            assert isinstance(factory.admission, UnixAdmission)
            factory.admission = evolve(factory.admission, peer_credentials=self.credentials)
        return client

    async def as_uid(self, uid: int, job: int = 0) -> ControlClient:
        """A control connection the daemon admits as ``uid``, its calls with the capability
        of that uid's ``job``."""
        self.arriving.append(uid)
        client = await connect_control(reactor, self.control, timeout=30, capability=key(uid, job))
        self.clients.append(client)
        await client.ping()  # admitted: the door has taken its uid
        assert self.arriving == []
        return client

    async def test_a_scoped_uid_is_confined_to_its_own_bottles(self) -> None:
        """It creates and uses its bottles; another's name is NOT_FOUND for everything;
        listings and events show its own only; Drain is PERMISSION_DENIED; the creator
        survives a restart."""
        client = await self.start_scoped()
        alice, bob = await self.as_uid(ALICE), await self.as_uid(BOB)
        a1 = await alice.create_bottle("a1", owner="alice-actor")
        self.assertEqual(a1.owner, "alice-actor")
        await bob.create_bottle("b1")
        await client.create_bottle("r1")  # the daemon's own uid: full control

        self.assertEqual([b.name for b in await alice.all_bottles()], ["a1"])
        refused: tuple[Callable[[], Deferred[Any]], ...] = (
            lambda: alice.bottle_status("b1"),
            lambda: alice.destroy_bottle("b1"),
            lambda: alice.destroy_bottle("r1"),
            lambda: alice.renew_lease("r1", 60),
            lambda: alice.add_forward("b1", "web", "127.0.0.1:9"),
            lambda: alice.all_forwards("r1"),
            lambda: alice.all_stats("b1"),
        )
        for i, call in enumerate(refused):
            with self.assertRaises(NotFound, msg=str(i)):
                await call()
        await alice.add_forward("a1", "web", "127.0.0.1:9")
        self.assertEqual([f.bottle for f in await alice.all_forwards()], ["a1"])
        with self.assertRaises(PermissionDenied):
            await alice.drain()
        self.assertFalse((await client.node_info()).draining)
        await alice.node_info()

        # events: another's bottle is never shown, its own are
        stream = await alice.events()
        await client.create_bottle("r2")
        await client.destroy_bottle("r1")
        await alice.destroy_bottle("a1")
        await alice.create_bottle("a2")
        seen = []
        async for event in stream:
            seen.append((event.kind, event.bottle))
            if len(seen) == 2:
                break
        self.assertEqual(seen, [("destroyed", "a1"), ("created", "a2")])

        names = sorted(plain(b.name) for b in await client.all_bottles())
        self.assertEqual(names, ["a2", "b1", "r2"])
        # the creator survives a restart: still BOB's, still hidden from ALICE
        await self.stop()
        await self.start_scoped()
        alice, bob = await self.as_uid(ALICE), await self.as_uid(BOB)
        with self.assertRaises(NotFound):
            await alice.destroy_bottle("b1")
        await bob.destroy_bottle("b1")
        self.assertEqual([b.name for b in await bob.all_bottles()], [])

    async def _events_until(
        self, stream: EventStream, last: tuple[str, str]
    ) -> list[tuple[str, str]]:
        """The stream's (kind, bottle) pairs up to and including ``last``."""
        seen: list[tuple[str, str]] = []
        async for event in stream:
            seen.append((event.kind, event.bottle))
            if seen[-1] == last:
                return seen
        raise AssertionError(f"the stream ended before {last}: {seen}")

    async def test_a_scoped_peer_hears_the_node_and_its_own_bottles_only(self) -> None:
        """Its stream carries the node's drain and undrain, its own bottles' events (their
        ``destroyed`` too), and nothing of a bottle another made, whatever name it asked
        for: one another holds, or one its refused create named first."""
        client = await self.start_scoped()
        bob = await self.as_uid(BOB)
        stream = await bob.events()
        await client.create_bottle("x")
        with contextlib.suppress(AlreadyExists):
            await bob.create_bottle("x")  # another's name: never its events
        await client.drain()
        with self.assertRaises(Draining):
            await bob.create_bottle("y")  # a refused create: its name is not its own
        await client.undrain()
        await client.create_bottle("y")
        await client.destroy_bottle("y")
        await client.destroy_bottle("x")
        await bob.create_bottle("b1")
        await bob.destroy_bottle("b1")
        await bob.create_bottle("end")
        seen = await self._events_until(stream, ("created", "end"))
        self.assertNotIn("y", [b for _, b in seen], seen)
        self.assertNotIn(("destroyed", "x"), seen)
        mine = [e for e in seen if e[1] in ("", "b1")]  # (its own "x", if made, is its own)
        self.assertEqual(
            mine,
            [("drained", ""), ("undrained", ""), ("created", "b1"), ("ready", "b1"),
             ("destroyed", "b1")],
        )  # fmt: skip

    async def test_a_restored_bottles_events_reach_its_scoped_creator(self) -> None:
        """After a restart the restored bottle's events are still its creator's."""
        await self.start_scoped()
        alice = await self.as_uid(ALICE)
        await alice.create_bottle("a1")
        await self.stop()
        await self.start_scoped()
        alice = await self.as_uid(ALICE)
        stream = await alice.events()
        await alice.destroy_bottle("a1")
        await alice.create_bottle("end")
        seen = await self._events_until(stream, ("created", "end"))
        self.assertEqual(seen, [("destroyed", "a1"), ("created", "end")])

    async def test_a_scoped_peers_forward_listings_are_its_own(self) -> None:
        """ListForwards and Stats without a bottle list its own bottles' forwards only."""
        client = await self.start_scoped()
        alice, bob = await self.as_uid(ALICE), await self.as_uid(BOB)
        await client.create_bottle("r1")
        await client.add_forward("r1", "db", "127.0.0.1:9")
        await bob.create_bottle("b1")
        await bob.add_forward("b1", "db", "127.0.0.1:9")
        await alice.create_bottle("a1")
        await alice.add_forward("a1", "web", "127.0.0.1:9")
        self.assertEqual([(f.bottle, f.label) for f in await alice.all_forwards()], [("a1", "web")])
        self.assertEqual([s.bottle for s in await alice.all_stats()], ["a1"])
        self.assertEqual(
            [(s.bottle, s.label) for s in await alice.all_stats("a1")], [("a1", "web")]
        )
        self.assertEqual(len(await client.all_forwards()), 3)

    async def test_one_uids_jobs_reach_only_their_own_capabilitys_bottles(self) -> None:
        """Two jobs of one scoped uid (two capabilities) may both name a bottle ``x``; each
        lists, uses, hears and destroys only its own; without the capability a bottle is
        NOT_FOUND, and a create without one is answered a capability of its own."""
        client = await self.start_scoped()
        job_a, job_b = await self.as_uid(ALICE, 1), await self.as_uid(ALICE, 2)
        stream_a = await job_a.events()
        await client.create_bottle("x")  # the operator's x: a name space of its own too
        xa = await job_a.create_bottle("x", owner="trainer-a")
        xb = await job_b.create_bottle("x", owner="trainer-b")
        self.assertEqual((xa.capability, xb.capability), (key(ALICE, 1), key(ALICE, 2)))
        self.assertEqual([b.owner for b in await job_a.all_bottles()], ["trainer-a"])
        self.assertEqual([b.owner for b in await job_b.all_bottles()], ["trainer-b"])
        await job_a.add_forward("x", "web", "127.0.0.1:9")
        self.assertEqual(await job_b.all_forwards(), [])
        await job_b.destroy_bottle("x")
        self.assertEqual((await job_a.bottle_status("x")).owner, "trainer-a")
        await job_a.create_bottle("end")
        seen = await self._events_until(stream_a, ("created", "end"))
        self.assertEqual(seen, [("created", "x"), ("ready", "x"), ("created", "end")])
        named = await (await self.as_uid(ALICE, 1)).events("x")  # a watch of its own x
        await job_a.destroy_bottle("x")
        self.assertEqual(await self._events_until(named, ("destroyed", "x")), [("destroyed", "x")])
        # a call without a capability reaches none of them; a create without one gets one
        self.arriving.append(ALICE)
        bare = await connect_control(reactor, self.control, timeout=30)
        self.clients.append(bare)
        with self.assertRaises(NotFound):
            await bare.destroy_bottle("x")
        self.assertEqual(await bare.all_bottles(), [])
        minted = await bare.create_bottle("x")
        self.assertIsNotNone(minted.capability)
        self.assertNotIn(minted.capability, (key(ALICE, 1), key(ALICE, 2)))
        # the operator's x, the new capability's x and job a's end
        self.assertEqual(
            sorted(plain(b.name) for b in await client.all_bottles()), ["end", "x", "x"]
        )

    async def test_a_name_of_its_name_space_made_by_another_is_not_heard(self) -> None:
        """The operator names a bottle ``x-<tag>`` of a scoped identity's name space: that
        identity neither reaches it as ``x`` nor hears its events."""
        client = await self.start_scoped()
        alice = await self.as_uid(ALICE)
        stream = await alice.events()
        tag = Identity(ALICE, key(ALICE)).digest[:12]
        await client.create_bottle(f"x-{tag}")
        with self.assertRaises(NotFound):
            await alice.bottle_status("x")
        await client.destroy_bottle(f"x-{tag}")
        await alice.create_bottle("end")
        seen = await self._events_until(stream, ("created", "end"))
        self.assertEqual(seen, [("created", "end")])
