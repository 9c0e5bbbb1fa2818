"""``bottlenetctl node info|drain|undrain`` and ``status`` against the daemon's real service
tree (in process, fake smolvm test double; bottlenetctl in its own process)."""

from __future__ import annotations

import json

from bottlenet.errors import Draining
from tests.bottles.harness import DaemonCase


class NodeCLITests(DaemonCase):
    async def _drained(self) -> None:
        """A daemon with labels, two bottles (one leased) and the node drained."""
        client = await self.start("--label", "zone=eu-1", "--label", "kvm=false", vm_bottles=False)
        await client.create_bottle("held")
        await client.create_bottle("leased", lease_seconds=3600)
        await client.drain()

    async def test_info_and_drain(self) -> None:
        """node info reports labels and capacity; drain refuses a create with DRAINING (exit
        1), shows in status and node info and says so on the event stream; the bottles
        held keep working."""
        client = await self.start("--label", "zone=eu-1", "--label", "kvm=false", vm_bottles=False)
        await client.create_bottle("held")
        await client.create_bottle("leased", lease_seconds=3600)  # counted on after a restart
        r = await self.ctl("--json", "node", "info")
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        self.assertEqual(info["labels"], {"kvm": "false", "zone": "eu-1"})
        self.assertEqual((info["bottles"], info["vm_bottles"], info["draining"]), (2, 0, False))
        self.assertEqual(info["max_bottles"], 256)
        self.assertIn(info["health"], ("ok", "degraded"))
        self.assertEqual(info["protocol"], 1)

        events = await client.events()
        r = await self.ctl("node", "drain")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(b"2 still held", r.stdout)
        event = await events.__anext__()
        self.assertEqual((event.kind, event.bottle), ("drained", ""))
        r = await self.ctl("bottle", "create", "refused")
        self.assertEqual(r.returncode, 1)
        self.assertIn(b"error: DRAINING:", r.stderr)
        with self.assertRaises(Draining):
            await client.create_bottle("refused")
        r = await self.ctl("status")
        self.assertRegex(r.stdout.decode(), r"draining\s+yes")
        # the bottle held keeps working: it is listed and destroyed as usual
        self.assertEqual([b.name for b in await client.all_bottles()], ["held", "leased"])

    async def test_drain_survives_a_restart_and_undrain(self) -> None:
        """A drain survives a restart (the lease counted on), drain --wait times out while a
        bottle is held and answers empty once none is; undrain takes bottles again."""
        await self._drained()
        await self.stop()
        client = await self.start(vm_bottles=False)
        assert self.root is not None and self.root.node is not None
        self.assertEqual(self.root.node.leases.leased, 1)
        await client.destroy_bottle("leased")
        r = await self.ctl("--json", "node", "info")
        self.assertTrue(json.loads(r.stdout)["draining"], "the drain survives a restart")
        with self.assertRaises(Draining):
            await client.create_bottle("refused")
        r = await self.ctl("node", "drain", "--wait", "--wait-timeout", "0.2")
        self.assertEqual(r.returncode, 1)
        self.assertIn(b"error: TIMEOUT:", r.stderr)
        await client.destroy_bottle("held")
        r = await self.ctl("--json", "node", "drain", "--wait", "--wait-timeout", "30")
        self.assertEqual(json.loads(r.stdout), {"draining": True, "empty": True, "held": 0})
        r = await self.ctl("node", "undrain")
        self.assertEqual(r.returncode, 0, r.stderr)
        await client.create_bottle("again")
        r = await self.ctl("status")
        self.assertRegex(r.stdout.decode(), r"draining\s+no")

    async def test_lease_create_renew_and_reap(self) -> None:
        """bottle create --owner --lease, bottle renew, bottle status shows them; the
        daemon reaps the bottle its owner abandoned (lease_expired, then destroyed) and
        leaves the one without a lease."""
        client = await self.start("--lease-grace", "0", vm_bottles=False)
        events = await client.events()
        argv = ("--json", "bottle", "create", "leased", "--owner", "t1", "--lease", "600")
        r = await self.ctl(*argv)
        self.assertEqual(r.returncode, 0, r.stderr)
        record = json.loads(r.stdout)
        self.assertEqual((record["owner"], record["lease_seconds"]), ("t1", 600.0))
        await client.create_bottle("plain")
        r = await self.ctl("bottle", "status", "leased")
        self.assertRegex(r.stdout.decode(), r"owner\s+t1")
        self.assertRegex(r.stdout.decode(), r"lease\s+600s, runs out at")
        r = await self.ctl("bottle", "renew", "plain", "3")
        self.assertEqual(r.returncode, 1)
        self.assertIn(b"INVALID_ARGUMENT", r.stderr)
        # the owner renews once more, for a second, then goes away
        r = await self.ctl("bottle", "renew", "leased", "1")
        self.assertEqual((r.returncode, r.stdout), (0, b"leased: lease renewed for 1s\n"))
        seen = []
        async for event in events:
            seen.append((event.kind, event.bottle))
            if event.kind == "destroyed":
                break
        self.assertEqual(seen[-2:], [("lease_expired", "leased"), ("destroyed", "leased")])
        self.assertEqual([b.name for b in await client.all_bottles()], ["plain"])
        self.assertIn("bottle leased: lease of 1s ran out", self.log_text())
