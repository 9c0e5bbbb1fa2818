"""``bottlenetctl node info|drain|undrain`` and ``status`` against the daemon's real service
tree (in process, fake smolvm test double; bottlenetctl in its own process)."""

from __future__ import annotations

import json

from bottlenet.errors import Draining
from tests.bottles.harness import DaemonCase


class NodeCLITests(DaemonCase):
    async def test_info_drain_undrain(self) -> None:
        """node info reports labels and capacity; drain refuses a create with DRAINING (exit
        1), shows in status and node info, says so on the event stream, survives a
        restart; undrain takes bottles again."""
        client = await self.start("--label", "zone=eu-1", "--label", "kvm=false", vm_bottles=False)
        await client.create_bottle("held")
        r = await self.ctl("--json", "node", "info")
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        self.assertEqual(info["labels"], {"kvm": "false", "zone": "eu-1"})
        self.assertEqual((info["bottles"], info["vm_bottles"], info["draining"]), (1, 0, False))
        self.assertEqual(info["max_bottles"], 256)
        self.assertIn(info["health"], ("ok", "degraded"))
        self.assertEqual(info["protocol"], 1)

        events = await client.events()
        r = await self.ctl("node", "drain")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(b"1 still held", r.stdout)
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
        self.assertEqual([b.name for b in await client.all_bottles()], ["held"])

        await self.stop()
        client = await self.start(vm_bottles=False)
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
