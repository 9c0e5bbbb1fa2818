"""Rollback: what only the fake smolvm executable's process model shows, and two rules that ran
through it before (now on the in-memory smolvm, a TEST DOUBLE).

The step-by-step rollback logic is unit-tested on the in-memory smolvm (``test_rollback.py``);
a start that fails the way a host without usable KVM fails it goes through the fake in
``test_vm_e2e.py`` (``test_a_failed_create_takes_its_volume_grant_back``) and vmctl's own
tests; alias mode refused before any machine is ``test_rollback.py``'s and ``test_vm_e2e.py``'s.
Only a start cut short, which leaves a real VMM behind a ``created`` record, needs the fake here.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.errors import BottlenetError
from tests.bottles.harness import DaemonCase, spec_doc
from tests.bottles.memsmolvm import Rig
from tests.bottles.test_rollback import assert_nothing_left
from vmctl.errors import KvmUnavailable
from vmctl.ports import Ownership, PortCheck
from vmctl.smolvm import Timeouts

Rigs = Callable[..., Rig]


def test_sidecar_socket_not_owned(rigs: Rigs, tmp: str) -> None:
    """A sidecar socket its VM process does not hold fails the create (SMOLVM_FAILED) and
    leaves nothing."""
    rig = rigs()
    rig.use(check_socket=lambda path, pid: PortCheck(0, pid, Ownership.FOREIGN, "injected"))
    with pytest.raises(BottlenetError) as info:
        rig.run(rig.registry.create_bottle("rb", spec=parse_bottle_spec("rb", spec_doc(tmp))))
    assert info.value.code == "SMOLVM_FAILED", str(info.value)
    assert_nothing_left(rig)


def test_agent_start_fails_and_the_next_create_is_as_usual(rigs: Rigs, tmp: str) -> None:
    """No usable KVM for the agent: KVM_UNAVAILABLE, nothing left, and another bottle is
    created as usual afterwards."""
    rig = rigs()
    rig.smolvm.fail_on("start", "bn-rb-agent", KvmUnavailable("injected: no KVM"))
    with pytest.raises(BottlenetError) as info:
        rig.run(rig.registry.create_bottle("rb", spec=parse_bottle_spec("rb", spec_doc(tmp))))
    assert info.value.code == "KVM_UNAVAILABLE", str(info.value)
    assert_nothing_left(rig)
    b = rig.run(rig.registry.create_bottle("ok", spec=parse_bottle_spec("ok", spec_doc(tmp))))
    assert b.state == "ready"


class RollbackTests(DaemonCase):
    async def test_agent_start_cut_short_leaves_no_orphan_vmm(self) -> None:
        """A start that times out leaves a VMM behind a `created` record (smolvm writes
        agent.pid before its ready wait); the undo stops it before deleting."""
        self.fake.set_faults("exec-netns", "slow-start", slow_start=30)
        client = await self.start()
        assert self.root is not None
        self.root.registry.host.smolvm.timeouts = Timeouts(start=1.5)  # type: ignore[union-attr]
        try:
            await client.create_bottle("rb", spec=self.spec_json(mode="socket"))
        except BottlenetError as e:
            self.assertEqual(e.code, "SMOLVM_FAILED", str(e))
        else:
            self.fail("create succeeded")
        self.assertEqual(self.machines(), {})
        self.assertEqual(self.fake.live_pids(), [])
        self.assertEqual(self.root.table.list(), [])
        self.assertFalse(os.path.exists(os.path.join(self.state_dir, "bottles", "rb")))
        self.assertEqual(self.state_file()["bottles"], {})
        self.assertEqual((await client.list_bottles()).total, 0)
        self.assertIsNone(self.registry.aliases.alias_of("rb"))
        self.assertIsNone(self.registry.state_of("rb"))  # no machine left: nothing in flight
        stops = [a for a in self.fake.argvs() if a[1:2] == ["stop"]]
        self.assertTrue(stops)
