"""Security-2 T13 (bottles side): an Exec into a bottle being destroyed is BUSY."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.errors import Busy, NotFound
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import Rig


def test_exec_during_destroy_is_busy(rigs: Callable[..., Rig], tmp: str) -> None:
    """T13: an Exec sent while DestroyBottle runs used to be accepted (now BUSY)."""
    rig = rigs()
    spec = parse_bottle_spec("d1", spec_doc(tmp, listen="tcp"))
    rig.run(rig.registry.create_bottle("d1", spec=spec))
    assert rig.registry.exec_target("d1").name == "d1"
    gate = rig.smolvm.hold("stop", "bn-d1-agent")
    destroy = rig.start(rig.registry.destroy_bottle("d1"))
    assert not destroy.called  # the teardown waits on smolvm
    with pytest.raises(Busy, match="being destroyed"):
        rig.registry.exec_target("d1")
    gate.callback(None)
    rig.result(destroy)
    with pytest.raises(NotFound):
        rig.registry.exec_target("d1")
