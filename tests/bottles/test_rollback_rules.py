"""The lifecycle's own safety rules that the end states alone did not pin (unit seam).

Each test kills a mutant that survived the whole suite (``tests-2.md``): the create-time gate
asks for the host witness (L12), a rollback runs every undo even when one fails (L08) and in
reverse order (L07), a packed image that turns networking on is refused before it starts
(L13), and recovery deletes a machine only when it carries this bottle's label (L16).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet.defer import Deferred, succeed

from bottlenet.bottles.model import LABEL_BOTTLE, LABEL_OWNER
from bottlenet.bottles.spec import PACKED_SUFFIX, parse_bottle_spec
from bottlenet.errors import BottlenetError
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import MemMachine, MemorySmolvm, Rig, exits, leak
from tests.bottles.test_recovery import _store, _stored
from tests.bottles.test_rollback import create_fails, spec
from tests.probe.guests import pass_transcript
from vmctl.smolvm import ExecResult, Machine
from vmctl.spec import MachineSpec


def test_a_guest_that_prints_a_perfect_transcript_without_connecting_fails(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """L12: the create gate needs the host witness, so forged lines alone are not a pass."""
    rig = rigs()

    def forger(script: bytes) -> ExecResult:
        return exits(*pass_transcript(script))  # every line right, no endpoint dialled

    rig.smolvm.guest = forger
    error = create_fails(rig, "ISOLATION_FAILED", spec(tmp))
    assert "not witnessed on the host" in error.message


def test_a_failing_undo_does_not_stop_the_undos_after_it(
    rigs: Callable[..., Rig], tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L08: the agent's removal fails, the sidecar and the listeners still go."""
    rig = rigs()
    rig.smolvm.on_exec = leak  # the gate fails: the create is rolled back
    real = MemorySmolvm.remove
    failed: list[str] = []

    async def flaky(smolvm: MemorySmolvm, name: str) -> bool:
        if name.endswith("-agent"):
            failed.append(name)
            raise RuntimeError("undo failed")
        return await real(smolvm, name)

    monkeypatch.setattr(MemorySmolvm, "remove", flaky)
    with pytest.raises(BottlenetError) as info:
        rig.run(rig.registry.create_bottle("rb", spec=spec(tmp)))
    assert info.value.code == "ISOLATION_FAILED"  # the cause, not the undo's error
    assert failed == ["bn-rb-agent"]
    assert list(rig.smolvm.machines) == ["bn-rb-agent"]  # only the one whose undo failed
    assert rig.table.list() == []
    assert not os.path.exists(os.path.join(rig.state_dir, "bottles", "rb"))


def test_rollback_undoes_in_reverse_creation_order(rigs: Callable[..., Rig], tmp: str) -> None:
    """L07: the agent (made last) is removed before the sidecar (made first)."""
    rig = rigs()
    rig.smolvm.on_exec = leak
    create_fails(rig, "ISOLATION_FAILED", spec(tmp))
    calls = rig.smolvm.calls
    assert calls.index(("delete", "bn-rb-agent")) < calls.index(("stop", "bn-rb-sidecar"))
    assert calls.index(("create", "bn-rb-sidecar")) < calls.index(("create", "bn-rb-agent"))


def test_a_packed_image_with_networking_is_refused_before_it_starts(
    rigs: Callable[..., Rig], tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L13: smolvm reports network: true for the created pack: refused, nothing started."""
    rig = rigs()
    doc = spec_doc(tmp)
    pack = os.path.join(tmp, "agent" + PACKED_SUFFIX)
    with open(pack, "wb") as f:
        f.write(b"\0" * 64)
    doc["agent"]["image"] = pack
    real = MemorySmolvm.status

    def status(self: MemorySmolvm, name: str) -> Deferred[Machine]:
        if name.endswith("-agent"):
            self.calls.append(("status", name))
            return succeed(Machine(name, "stopped", network=True))
        return real(self, name)

    monkeypatch.setattr(MemorySmolvm, "status", status)
    error = create_fails(rig, "ISOLATION_FAILED", parse_bottle_spec("rb", doc))
    assert "turns on networking" in error.message
    assert ("start", "bn-rb-agent") not in rig.smolvm.calls


def test_recovery_leaves_a_machine_labelled_for_another_bottle(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """L16: our owner label is not enough; the bottle label must name this bottle too."""
    first = rigs()
    first.run(first.registry.create_bottle("r1", spec=spec(tmp, "r1")))
    first.close()
    other: Any = ((LABEL_OWNER, first.instance_id), (LABEL_BOTTLE, "r2"))
    first.smolvm.machines["bn-r2-agent"] = MemMachine(
        MachineSpec("bn-r2-agent", labels=other), state="running"
    )
    first.smolvm.machines["bn-r1-sidecar"].state = "stopped"  # r1 is dead: torn down
    bottles = _stored(first.state_dir)
    bottles["r1"]["agent_vm"] = "bn-r2-agent"  # a rewritten record aims at r2's machine
    _store(first.state_dir, bottles)
    rig = rigs(smolvm=first.smolvm)
    rig.recover()
    assert rig.registry.list_bottles() == []
    assert "bn-r2-agent" in rig.smolvm.machines  # another bottle's: left alone
    assert "bn-r1-sidecar" not in rig.smolvm.machines
