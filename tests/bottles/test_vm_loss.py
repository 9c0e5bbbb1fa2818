"""A workload waiter that ends without an exit code (``bottles/vmloss.py``, issue 27 item 6),
driven on one VM bottle's owner with a clock and the in-memory smolvm (a TEST DOUBLE).

The rule half of ``tests/control/test_agent_limits.py``'s dying agent VM: what smolvm says of
the agent VM decides whether the bottle turns degraded, naming it, and the log says the waiter
lost the workload either way. That test keeps the process-level half (a killed VMM ends an open
``bottle exec`` with ``connection to VM lost``, exit 1, and the daemon degrades the bottle);
a bridge not restarted against a dead VM is ``test_bridge_keeper.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from twisted.internet.error import ProcessTerminated
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure

from bottlenet.bottles.events import DEGRADED
from bottlenet.bottles.model import BottleState
from tests.bottles.memsmolvm import Rig
from tests.bottles.test_bottle import Attached, Owned
from vmctl.errors import SmolvmFailed

LOST = "bottle b1: its workload waiter ended without an exit code"


@pytest.fixture
def owned(rigs: Callable[..., Rig], tmp: str) -> Owned:
    owned = Owned(rigs(), Attached())
    owned.create(tmp, workload=("/agent", "run"))
    return owned


def lose_the_waiter(owned: Owned) -> list[str]:
    """smolvm's CLI ends the waiter as a VM's loss does (exit 1, no code printed): the log."""
    [waiter] = owned.attached.protocols
    with capturedLogs() as events:
        waiter.processEnded(Failure(ProcessTerminated(exitCode=1)))
        owned.rig.settle()
    return [formatEvent(e) for e in events]


def test_a_waiter_lost_with_its_stopped_agent_vm_degrades_the_bottle_naming_it(
    owned: Owned,
) -> None:
    """smolvm calls the agent VM stopped: degraded at once, the detail names the VM, one
    DEGRADED event, and the log says the waiter ended without an exit code (agent VM ...)."""
    owned.rig.smolvm.machines["bn-b1-agent"].state = "stopped"
    said = lose_the_waiter(owned)
    bottle = owned.owner.require()
    assert bottle.state is BottleState.DEGRADED
    assert (bottle.detail or "").startswith("agent VM bn-b1-agent is stopped"), bottle.detail
    assert owned.rig.state()["b1"]["state"] == "degraded"
    assert [(e[0], e[3]) for e in owned.events] == [(DEGRADED, bottle.detail)]
    assert any(f"{LOST} (agent VM bn-b1-agent is stopped" in line for line in said), said


def test_a_waiter_lost_while_its_agent_vm_runs_keeps_the_bottle(owned: Owned) -> None:
    """smolvm says the agent VM runs: nothing degrades; the log says the end goes unnoticed."""
    said = lose_the_waiter(owned)
    assert owned.owner.require().state is BottleState.READY and owned.events == []
    assert any(f"{LOST} (the agent VM runs" in line for line in said), said


def test_a_waiter_lost_while_its_agent_vm_is_unreachable_keeps_the_bottle(owned: Owned) -> None:
    """smolvm calls the agent VM ``unreachable`` (its VMM runs, its agent did not answer a
    ping): not a loss, the bottle stays ready."""
    owned.rig.smolvm.machines["bn-b1-agent"].state = "unreachable"
    lose_the_waiter(owned)
    assert owned.owner.require().state is BottleState.READY and owned.events == []


def test_a_waiter_lost_with_its_agent_vm_deleted_degrades_the_bottle(owned: Owned) -> None:
    """The agent VM no longer exists in smolvm: degraded, the detail says so."""
    del owned.rig.smolvm.machines["bn-b1-agent"]
    lose_the_waiter(owned)
    bottle = owned.owner.require()
    assert bottle.state is BottleState.DEGRADED
    assert (bottle.detail or "").startswith("agent VM bn-b1-agent no longer exists"), bottle.detail
    assert [e[0] for e in owned.events] == [DEGRADED]


def test_a_waiter_lost_when_smolvm_cannot_tell_keeps_the_bottle_and_says_so(
    owned: Owned,
) -> None:
    """smolvm's status fails: the bottle stays as it is and the log line is still written."""
    owned.rig.smolvm.fail_on("status", "bn-b1-agent", SmolvmFailed("injected"))
    said = lose_the_waiter(owned)
    assert owned.owner.require().state is BottleState.READY and owned.events == []
    assert any(LOST in line for line in said), said


def test_a_waiter_ended_by_the_daemon_is_no_loss(owned: Owned) -> None:
    """The daemon's own stop ends the waiter: smolvm is not asked about the VM, nothing
    degrades, and no loss is logged."""
    [waiter] = owned.attached.protocols
    with capturedLogs() as events:
        owned.owner.stop_watching()
        waiter.processEnded(Failure(ProcessTerminated(exitCode=1)))  # the child it ended
        owned.rig.settle()
    said = [formatEvent(e) for e in events]
    assert ("status", "bn-b1-agent") not in owned.rig.smolvm.calls
    assert owned.owner.require().state is BottleState.READY and owned.events == []
    assert not any(LOST in line for line in said), said
