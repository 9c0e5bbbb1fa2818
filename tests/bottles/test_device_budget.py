"""smolvm's device budget is checked for the agent VM before any machine exists (issue 36
follow-up): bottlenet's guest kit takes one of smolvm's virtiofs devices per VM, so an agent
with a local image and three volumes needs five of the four; the refusal counts the kit."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from bottlenet.bottles.creation import check_agent_devices
from bottlenet.bottles.host import vm_parts
from bottlenet.bottles.spec import AgentSpec, parse_bottle_spec
from bottlenet.errors import InvalidArgument
from bottlenet.kit.build import Kit
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import Rig
from vmctl.spec import Volume

DIGEST = "ab" * 32


class MountedKit:
    """The daemon's kit keeper with a kit ready (its files are never read here)."""

    def __init__(self, root: str) -> None:
        self.kit = Kit(root, "0" * 16, DIGEST, "x86_64", "lib/ld-linux-x86-64.so.2", 1)

    async def checked(self) -> Kit:
        return self.kit


def with_volumes(tmp: str, n: int) -> dict[str, Any]:
    doc = spec_doc(tmp)  # its agent image is a local archive: one device of its own
    dirs = []
    for i in range(n):
        d = os.path.join(tmp, f"vol{i}")
        os.makedirs(d, exist_ok=True)
        dirs.append(f"{d}:/work/v{i}:rw")
    doc["agent"]["volumes"] = dirs
    return doc


def test_a_local_image_three_volumes_and_the_kit_are_refused_before_any_machine(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """Five devices of four: INVALID_ARGUMENT naming the volumes, the kit and the image, and
    how many volumes fit; no machine was created, nothing of the bottle is left."""
    rig = rigs()
    rig.use(kit=MountedKit(tmp))
    with pytest.raises(InvalidArgument) as info:
        rig.run(
            rig.registry.create_bottle("b1", spec=parse_bottle_spec("b1", with_volumes(tmp, 3)))
        )
    assert info.value.message == (
        "agent.volumes: the agent VM would need 5 virtio devices, more than smolvm's budget of 4:"
        " 3 volume(s) (/work/v0, /work/v1, /work/v2), bottlenet's guest kit (read-only at"
        " /run/bottlenet-kit), its local image (its packed layers); give it at most 2 volume(s)"
        ' (docs/bottles.md, "Device budget")'
    )
    assert not any(call == "create" for call, _ in rig.smolvm.calls), rig.smolvm.calls
    assert rig.smolvm.machines == {} and "b1" not in rig.state()


def test_what_fits_with_and_without_the_kit(tmp: str) -> None:
    """Two volumes, the kit and a local image fit the four; without a kit (--guest-kit off)
    three volumes fit, and four are refused with no kit named."""
    kit = MountedKit(tmp).kit

    def agent(n: int) -> AgentSpec:
        _, a = vm_parts(parse_bottle_spec("b", with_volumes(tmp, n)))
        return a

    def volumes(n: int) -> list[Volume]:
        return [Volume(os.path.join(tmp, f"vol{i}"), f"/work/v{i}") for i in range(n)]

    check_agent_devices("b", agent(2), volumes(2), kit, 4)
    check_agent_devices("b", agent(3), volumes(3), None, 4)
    with pytest.raises(InvalidArgument) as info:
        check_agent_devices("b", agent(4), volumes(4), None, 4)
    assert "4 volume(s) (/work/v0, /work/v1, /work/v2, /work/v3), its local image" in str(
        info.value.message
    )
    assert "kit" not in info.value.message and "at most 3 volume(s)" in info.value.message
