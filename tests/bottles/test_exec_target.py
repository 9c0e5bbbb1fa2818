"""Where a command may run: the registry's exec rules, in process (unit seam).

These two once ran through a daemon process and the fake smolvm (10.4 s and 4.1 s); they are
rules of the registry's table and the bottle's machine, so a clock and the in-memory smolvm
(a test double) check them. ``test_vm_e2e.py`` stays the process-level proof of exec.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bottlenet.bottles.bottle import VMBottle
from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.errors import Busy, Degraded
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import Rig

Rigs = Callable[..., Rig]


def test_exec_on_a_degraded_bottle_is_refused(rigs: Rigs, tmp: str) -> None:
    """Its sidecar VM died: the bottle is degraded and Exec is DEGRADED, naming why."""
    rig = rigs()
    rig.run(rig.registry.create_bottle("b1", spec=parse_bottle_spec("b1", spec_doc(tmp))))
    assert rig.registry.exec_target("b1").name == "b1"
    rig.registry.owner("b1", VMBottle).sidecar_exited()
    rig.settle()
    assert rig.registry.get_bottle("b1").state == "degraded"
    with pytest.raises(Degraded, match="sidecar VM process exited") as refused:
        rig.registry.exec_target("b1")
    assert refused.value.code == "DEGRADED"


def test_exec_while_the_bottle_is_created_is_busy(rigs: Rigs, tmp: str) -> None:
    """While its create runs (its sidecar starting), Exec is BUSY ("being created")."""
    rig = rigs()
    gate = rig.smolvm.hold("start", "bn-b2-sidecar")
    create = rig.start(
        rig.registry.create_bottle("b2", spec=parse_bottle_spec("b2", spec_doc(tmp)))
    )
    assert ("create", "bn-b2-sidecar") in rig.smolvm.calls and not create.called
    with pytest.raises(Busy, match="being created"):
        rig.registry.exec_target("b2")
    gate.callback(None)
    assert rig.result(create).state == "ready"
    assert rig.registry.exec_target("b2").name == "b2"
