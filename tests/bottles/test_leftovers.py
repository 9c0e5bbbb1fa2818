"""``Leftovers`` (``bottles/leftovers.py``, selftest's teardown line): what a gone bottle left,
its own machines only, both of them, and its directory even as a dangling link. In process,
on a clock, with the in-memory smolvm (``tests/bottles/memsmolvm.py``)."""

from __future__ import annotations

import os
from collections.abc import Callable

from attrs import evolve

from bottlenet.bottles.model import Role, machine_name
from tests.bottles.memsmolvm import MemMachine, Rig
from tests.bottles.test_rollback import spec

Rigs = Callable[..., Rig]


def test_a_gone_bottles_left_sidecar_is_named_and_no_other_bottles_machine(
    rigs: Rigs, tmp: str
) -> None:
    """Another VM bottle's machines are never a gone bottle's leftovers; a sidecar machine
    the destroy left is."""
    rig = rigs()
    rig.run(rig.registry.create_bottle("other", spec=spec(tmp, "other")))
    rig.run(rig.registry.create_bottle("gone", spec=spec(tmp, "gone")))
    left = rig.smolvm.machines[machine_name("gone", Role.SIDECAR)]
    rig.run(rig.registry.destroy_bottle("gone"))
    assert rig.run(rig.registry.leftovers("gone")) == []
    sidecar = machine_name("gone", Role.SIDECAR)
    rig.smolvm.machines[sidecar] = MemMachine(evolve(left.spec, name=sidecar))
    assert rig.run(rig.registry.leftovers("gone")) == [f"machine {sidecar} still exists (stopped)"]
    assert rig.run(rig.registry.leftovers("other")) == ["bottle other still exists"]


def test_a_dangling_link_at_a_gone_bottles_directory_is_a_leftover(rigs: Rigs, tmp: str) -> None:
    """The bottle's directory left as a symlink to nothing is still reported."""
    rig = rigs()
    path = os.path.join(rig.state_dir, "bottles", "gone")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink(os.path.join(tmp, "nowhere"), path)
    assert rig.run(rig.registry.leftovers("gone")) == [
        f"the bottle's directory {path} still exists"
    ]


def test_an_ephemeral_machine_with_a_gone_bottles_name_is_a_leftover(rigs: Rigs, tmp: str) -> None:
    """smolvm's listing leaves ephemeral machines out unless asked: one holding the gone
    bottle's agent name (a ``machine run`` in the same data dir) is still reported."""
    rig = rigs()
    rig.run(rig.registry.create_bottle("gone", spec=spec(tmp, "gone")))
    left = rig.smolvm.machines[machine_name("gone", Role.AGENT)]
    rig.run(rig.registry.destroy_bottle("gone"))
    agent = machine_name("gone", Role.AGENT)
    rig.smolvm.machines[agent] = MemMachine(evolve(left.spec, name=agent), ephemeral=True)
    assert rig.run(rig.registry.leftovers("gone")) == [f"machine {agent} still exists (stopped)"]
