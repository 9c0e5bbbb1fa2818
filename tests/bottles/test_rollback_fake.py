"""Rollback through the fake smolvm executable: what only a real child process shows.

The step-by-step rollback logic is unit-tested on the in-memory smolvm
(``test_rollback.py``); these cases need the fake's process model: a start that fails the
way a host without usable KVM fails it, a start cut short that leaves a VMM behind a
``created`` record, a sidecar socket its VM does not hold, and alias mode refused before any
``machine create``.
"""

from __future__ import annotations

import os
from typing import Any

from bottlenet.control.client import ControlClient
from bottlenet.errors import BottlenetError
from tests.bottles.harness import DaemonCase
from vmctl.ports import Ownership, PortCheck
from vmctl.smolvm import Timeouts


class RollbackTests(DaemonCase):
    async def _create_fails(
        self, client: ControlClient, code: str, mode: str = "socket", **spec: Any
    ) -> None:
        try:
            await client.create_bottle("rb", spec=self.spec_json(mode=mode, **spec))
        except BottlenetError as e:
            self.assertEqual(e.code, code, str(e))
        else:
            self.fail("create succeeded")
        await self.assertNothingLeft(client)

    async def assertNothingLeft(self, client: ControlClient) -> None:
        self.assertEqual(self.machines(), {})
        self.assertEqual(self.fake.live_pids(), [])
        assert self.root is not None
        self.assertEqual(self.root.table.list(), [])
        self.assertFalse(os.path.exists(os.path.join(self.state_dir, "bottles", "rb")))
        self.assertEqual(self.state_file()["bottles"], {})
        self.assertEqual((await client.list_bottles()).total, 0)
        self.assertIsNone(self.registry.aliases.alias_of("rb"))
        self.assertIsNone(self.registry.state_of("rb"))  # no machine left: nothing in flight

    async def test_alias_mode_fails_closed_before_anything_exists(self) -> None:
        client = await self.start("--unsafe-skip-isolation-probe")
        await self._create_fails(client, "ISOLATION_UNAVAILABLE", mode="alias")
        creates = [a for a in self.fake.argvs() if a[1:2] == ["create"] and a[-1] != "--help"]
        self.assertEqual(creates, [])

    async def test_sidecar_start_fails(self) -> None:
        """No usable KVM: one typed error that says so, and nothing left behind."""
        self.fake.set_faults("exec-netns", fail_start=["bn-rb-sidecar"])
        await self._create_fails(await self.start(), "KVM_UNAVAILABLE")

    async def test_sidecar_socket_not_owned(self) -> None:
        self.fake.set_faults("exec-netns")
        client = await self.start()
        vms = self.registry.vms
        assert vms is not None
        vms.check_socket = lambda path, pid: PortCheck(0, pid, Ownership.FOREIGN, "injected")
        await self._create_fails(client, "SMOLVM_FAILED")

    async def test_agent_start_fails(self) -> None:
        self.fake.set_faults("exec-netns", fail_start=["bn-rb-agent"])
        client = await self.start()
        await self._create_fails(client, "KVM_UNAVAILABLE")
        # the daemon is fine afterwards: another bottle is created as usual
        b = await client.create_bottle("ok", spec=self.spec_json(mode="socket"))
        self.assertEqual(b.state, "ready")

    async def test_agent_start_cut_short_leaves_no_orphan_vmm(self) -> None:
        """A start that times out leaves a VMM behind a `created` record (smolvm writes
        agent.pid before its ready wait); the undo stops it before deleting."""
        self.fake.set_faults("exec-netns", "slow-start", slow_start=30)
        client = await self.start()
        assert self.root is not None
        self.root.registry.vms.smolvm.timeouts = Timeouts(start=1.5)  # type: ignore[union-attr]
        await self._create_fails(client, "SMOLVM_FAILED")
        stops = [a for a in self.fake.argvs() if a[1:2] == ["stop"]]
        self.assertTrue(stops)
