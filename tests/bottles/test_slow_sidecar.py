"""A create waits for a slow sidecar, and a silent one fails only its own create (issue 27
item 10), on the unit seam: the registry on a clock with the in-memory smolvm (a test double)
whose sidecar services answer unless the test names them silent (``tests/bottles/memsmolvm.py``).

These rules once ran only through a daemon process that waited a real 1.5 s delay and a real
4 s timeout; ``tests/control/test_sidecar_ready.py`` keeps the process-level proof (the real
probe against the fake smolvm's exposed sockets, ``--sidecar-ready-timeout``, the CLI's words).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bottlenet.bottles.readiness import BACKOFF_MAX, TIMEOUT
from bottlenet.bottles.spec import BottleSpec, parse_bottle_spec
from bottlenet.errors import SidecarNotReady
from bottlenet.forward.spec import sidecar_socket_path
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import Rig

Rigs = Callable[..., Rig]


def spec(tmp: str, name: str) -> BottleSpec:
    """A socket-mode bottle whose sidecar services are exposed sockets (the default)."""
    return parse_bottle_spec(name, spec_doc(tmp, mode="socket", listen="unix"))


def test_a_slow_sidecar_is_waited_for_and_a_silent_one_fails_only_its_create(
    rigs: Rigs, tmp: str
) -> None:
    """Egress silent at first: the create waits (tries again; the agent boots meanwhile, but
    nothing runs in either VM) and succeeds once it answers. A later bottle whose egress
    never answers: SIDECAR_NOT_READY naming it; only the first bottle's machines and record
    are left."""
    rig = rigs()
    egress = sidecar_socket_path(rig.state_dir, "b1", "egress")
    rig.silent.add(egress)
    d = rig.start(rig.registry.create_bottle("b1", spec=spec(tmp, "b1")))
    for _ in range(3):
        rig.clock.advance(BACKOFF_MAX)
        rig.settle(d)
    assert not d.called and rig.probed.count(egress) > 1
    assert ("start", "bn-b1-sidecar") in rig.smolvm.calls
    assert ("start", "bn-b1-agent") in rig.smolvm.calls and rig.smolvm.execs == []
    rig.silent.discard(egress)
    for _ in range(3):
        rig.clock.advance(BACKOFF_MAX)
        rig.settle(d)
    assert rig.result(d).state == "ready"

    rig.silent.add(sidecar_socket_path(rig.state_dir, "b2", "egress"))
    d = rig.start(rig.registry.create_bottle("b2", spec=spec(tmp, "b2")))
    for _ in range(int(TIMEOUT) + 5):
        rig.clock.advance(1.0)
        rig.settle(d)
    with pytest.raises(SidecarNotReady, match="egress") as refused:
        rig.result(d)
    assert refused.value.code == "SIDECAR_NOT_READY"
    assert rig.smolvm.names() == ["bn-b1-agent", "bn-b1-sidecar"]
    assert [b.name for b in rig.registry.list_bottles()] == ["b1"]
    assert list(rig.state()) == ["b1"]
