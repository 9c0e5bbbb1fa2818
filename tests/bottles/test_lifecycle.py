"""A VM create's steps and the registry's one-operation-per-bottle rule (unit seam).

The machine specs the lifecycle hands to smolvm are checked on the in-memory double
(``tests/bottles/memsmolvm.py``); the same create through the fake smolvm executable, with
real bytes through the endpoints, is ``test_vm_e2e.py``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Any

import attrs
import pytest

from bottlenet.bottles import workload
from bottlenet.bottles.model import LABEL_BOTTLE, LABEL_OWNER, LABEL_ROLE
from bottlenet.bottles.spec import BottleSpec, parse_bottle_spec
from bottlenet.bottles.states import Lifecycle
from bottlenet.errors import Busy, InvalidArgument, ResourceExhausted, SmolvmUnavailable
from bottlenet.forward.spec import UNIXListen
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import PROBE_ARGV, MemorySmolvm, Rig
from vmctl.smolvm import GUEST_ROOT, Features
from vmctl.spec import create_args

Rigs = Callable[..., Rig]


def spec(tmp: str, name: str = "b1", **kw: Any) -> BottleSpec:
    kw.setdefault("mode", "socket")
    # Raw-port sidecars (the TCP opt-in): these seams pin the raw-port re-checks too; the
    # default exposed-socket sidecar is covered end to end through the fake smolvm.
    kw.setdefault("listen", "tcp")
    return parse_bottle_spec(name, spec_doc(tmp, **kw))


def test_socket_mode_create(rigs: Rigs, tmp: str) -> None:
    rig = rigs()
    b = rig.run(rig.registry.create_bottle("b1", spec=spec(tmp, workload=("/agent", "run"))))
    vm = b.require_vms()
    sidecar = rig.smolvm.machines["bn-b1-sidecar"].spec
    agent = rig.smolvm.machines["bn-b1-agent"].spec
    assert dict(sidecar.labels) == {
        LABEL_OWNER: rig.instance_id,
        LABEL_BOTTLE: "b1",
        LABEL_ROLE: "sidecar",
    }
    assert dict(agent.labels)[LABEL_ROLE] == "agent"
    # the sidecar publishes each guest port on a raw port; the agent never sees those
    assert [(p.host, p.guest) for p in sidecar.ports] == list(
        zip(vm.raw_ports, (3128, 9418), strict=True)
    )
    assert agent.net is False and agent.ports == ()
    assert [(m.host, m.guest) for m in agent.mount_sockets] == [
        (e.path, e.guest_path) for e in vm.endpoints
    ]
    assert not any(str(raw) in v for raw in vm.raw_ports for _, v in agent.env)
    # each endpoint is a real socket in the bottle's own 0700 directory, relaying to its raw port
    bdir = os.path.join(rig.state_dir, "bottles", "b1")
    assert stat.S_IMODE(os.stat(bdir).st_mode) == 0o700
    for info, e in zip(rig.table.list("b1"), vm.endpoints, strict=True):
        assert isinstance(info.bound, UNIXListen) and info.bound.path == e.path
        assert stat.S_ISSOCK(os.stat(e.path).st_mode)
        assert info.spec.target.describe() == f"127.0.0.1:{e.raw_port}"
    # the gate ran before the workload, which runs detached with the stamped env
    mine = [
        (argv, user)
        for (name, argv), user in zip(rig.smolvm.execs, rig.smolvm.exec_users, strict=True)
        if name == "bn-b1-agent"
    ]
    (probe, u1), (who, u2), (check, u3), (started, u4) = mine
    assert probe == PROBE_ARGV and check == workload.prepare_argv(("/agent", "run"), "bn-b1-agent")
    # the image's USER is read without -u (it is root here); bottlenet's own run as root
    assert who == workload.IMAGE_USER_ARGV and u2 is None
    assert started == workload.wrap(("/agent", "run"), "bn-b1-agent")
    assert u1 == u3 == u4 == GUEST_ROOT
    assert vm.probe == "PASS" and b.warnings == ()
    assert rig.state()["b1"] == b.to_state()


def test_one_operation_per_bottle_and_creates_count_against_the_limit(rigs: Rigs, tmp: str) -> None:
    rig = rigs(max_bottles=2)
    gate = rig.smolvm.hold("start", "bn-m1-agent")
    first = rig.start(rig.registry.create_bottle("m1", spec=spec(tmp, name="m1")))
    assert not first.called and rig.registry.state_of("m1") is Lifecycle.CREATING
    with pytest.raises(Busy):
        rig.run(rig.registry.destroy_bottle("m1"))
    with pytest.raises(Busy):
        rig.run(rig.registry.create_bottle("m1"))
    rig.run(rig.registry.create_bottle("m2"))  # forward-only counts too
    with pytest.raises(ResourceExhausted):
        rig.run(rig.registry.create_bottle("m3"))
    gate.callback(None)
    assert rig.result(first).state == "ready"
    assert rig.registry.state_of("m1") is Lifecycle.READY
    rig.run(rig.registry.destroy_bottle("m1"))
    rig.run(rig.registry.create_bottle("m3"))


def test_changes_wait_for_recovery(rigs: Rigs, tmp: str) -> None:
    first = rigs()
    first.run(first.registry.create_bottle("r1", spec=spec(tmp, name="r1")))
    first.close()
    rig = rigs(smolvm=first.smolvm)
    gate = rig.smolvm.hold("list", "")
    recovery = rig.start(rig.recover_later())
    assert rig.registry.recovering
    create = rig.start(rig.registry.create_bottle("p1"))
    assert not create.called and not rig.registry.has_bottle("p1")
    gate.callback(None)
    rig.result(recovery)
    assert rig.result(create).name == "p1"
    assert sorted(rig.state()) == ["p1", "r1"]


@pytest.mark.parametrize(
    ("part", "image"),
    [
        ("agent", "{tmp}/nope.tar"),
        ("agent", "{tmp}/agent.smolmachine"),
        ("sidecar", "{tmp}/sidecar-image-dir/"),
    ],
)
def test_missing_local_image_is_refused_before_any_machine(
    rigs: Rigs, tmp: str, part: str, image: str
) -> None:
    """Issue 19: a local image that is not there is INVALID_ARGUMENT naming the field, no VM."""
    rig = rigs()
    doc = spec_doc(tmp, listen="tcp")
    doc[part]["image"] = image.format(tmp=tmp)
    parsed = parse_bottle_spec("b1", doc)  # parsing alone never looks at the image
    with pytest.raises(InvalidArgument) as info:
        rig.run(rig.registry.create_bottle("b1", spec=parsed))
    assert info.value.message == (
        f"{part}.image: local image {image.format(tmp=tmp)!r} does not exist"
    )
    assert rig.smolvm.calls == [] and rig.smolvm.machines == {}
    assert "b1" not in rig.state()
    assert not os.path.exists(os.path.join(rig.state_dir, "bottles", "b1"))


class NoFloorSmolvm(MemorySmolvm):
    """A smolvm CLI without ``--block-private`` (everything else as 1.32's)."""

    @property
    def features(self) -> Features:
        return attrs.evolve(super().features, block_private=False)


@pytest.mark.parametrize("listen", ["unix", "tcp"])
def test_a_cli_without_block_private_gets_no_sidecar(rigs: Rigs, tmp: str, listen: str) -> None:
    """Issue 35: without ``--block-private`` a networked sidecar would reach the host's
    loopback (1.37's default), LAN and metadata: the create is refused, naming the flag, and
    no machine is created (never a sidecar sent without it)."""
    rig = rigs(smolvm=NoFloorSmolvm())
    with pytest.raises(SmolvmUnavailable) as info:
        rig.run(rig.registry.create_bottle("b1", spec=spec(tmp, listen=listen)))
    assert "--block-private" in str(info.value)
    assert rig.smolvm.machines == {}
    assert not [c for c in rig.smolvm.calls if c[0] == "create"], rig.smolvm.calls
    assert "b1" not in rig.state()


def test_every_sidecar_is_created_with_block_private(rigs: Rigs, tmp: str) -> None:
    """The floor is in the sidecar's create whatever the CLI, and --auto-ports never is."""
    rig = rigs()
    rig.run(rig.registry.create_bottle("b1", spec=spec(tmp, listen="unix")))
    sidecar = rig.smolvm.machines["bn-b1-sidecar"].spec
    assert sidecar.block_private and sidecar.net
    assert "--auto-ports" not in create_args(sidecar)
