"""A bottle's workload, the registry's rules, in process (unit seam): the registry on a clock
with the in-memory smolvm (a test double) whose attached execs (the workload waiter, ``bottle
logs``) the test sees and ends. A restart is two rigs on one state dir sharing the smolvm.

These once ran through a daemon and the fake smolvm (``tests/control/test_workload.py``, which
keeps the process-level proof: the real wrapper and waiter in the guest, the forge refusal
of T12, and what ``bottlenetctl`` prints).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IProcessProtocol
from twisted.internet.protocol import ProcessProtocol

from bottlenet.bottles import workload
from bottlenet.bottles.attach import ExecRequest
from bottlenet.bottles.model import BottleState
from bottlenet.control.records import bottle_record
from bottlenet.errors import InvalidArgument, NotFound
from tests.bottles.memsmolvm import MemorySmolvm, Rig
from tests.bottles.test_bottle import end_workload
from tests.bottles.test_recovery import spec

Rigs = Callable[..., Rig]


class _Transport:
    def signalProcess(self, sig: str) -> None:
        """A waiter that is cancelled is told TERM (nothing to do here)."""


class Spawned:
    """The rig's smolvm with ``spawn_exec`` (the in-memory double has none): each attached
    exec is recorded and left running until the test ends it."""

    def __init__(self, smolvm: MemorySmolvm) -> None:
        self._smolvm = smolvm
        self.attached: list[tuple[str, list[str], IProcessProtocol]] = []

    def spawn_exec(self, name: str, argv: list[str], protocol: Any, **kw: Any) -> Deferred[Any]:
        self.attached.append((name, list(argv), protocol))
        protocol.makeConnection(_Transport())
        return succeed(protocol)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._smolvm, name)

    def waiter(self) -> IProcessProtocol:
        """The one workload waiter attached now."""
        argv = workload.waiter_argv("bn-r1-agent")
        [protocol] = [p for name, a, p in self.attached if a == argv]
        return protocol


def attach(rig: Rig) -> Spawned:
    spawned = Spawned(rig.smolvm)
    rig.use(smolvm=spawned)
    return spawned


def record(rig: Rig, name: str = "r1") -> tuple[str, str | None, int | None]:
    """The bottle's (state, workload, exit code) as ``bottle status`` carries them."""
    r = bottle_record(rig.registry.get_bottle(name), 0)
    return (r.state, r.workload, r.workload_exit_code)


def test_an_exited_workload_leaves_the_bottle_up_for_exec_logs_and_removal(
    rigs: Rigs, tmp: str
) -> None:
    """The workload's exit turns the bottle exited with its code, once; both VMs stay up,
    exec and ``logs --tail 1`` still run in its agent VM, and it can be removed."""
    rig = rigs()
    spawned = attach(rig)
    rig.run(rig.registry.create_bottle("r1", spec=spec(tmp, workload=("/agent", "run"))))
    assert record(rig) == ("ready", "running", None)
    events: list[tuple[str, Any, str | None, int | None]] = []
    rig.registry.events.subscribe(lambda e: events.append((e.kind, e.state, e.detail, e.exit_code)))
    end_workload(spawned.waiter(), 4)
    assert record(rig) == ("exited", "exited", 4)
    assert events == [("workload_exited", BottleState.EXITED, "workload exited with code 4", 4)]
    assert {n: m.state for n, m in rig.smolvm.machines.items()} == {
        "bn-r1-agent": "running",
        "bn-r1-sidecar": "running",
    }
    rig.run(rig.registry.spawn_exec("r1", ExecRequest(("true",)), ProcessProtocol()))
    assert spawned.attached[-1][:2] == ("bn-r1-agent", ["true"])
    rig.run(rig.registry.spawn_logs("r1", 1, False, ProcessProtocol()))
    assert spawned.attached[-1][:2] == ("bn-r1-agent", workload.logs_argv("bn-r1-agent", 1, False))
    rig.run(rig.registry.destroy_bottle("r1"))
    assert rig.registry.list_bottles() == [] and rig.smolvm.machines == {}


def test_a_restarted_daemon_waits_for_the_running_workload_again(rigs: Rigs, tmp: str) -> None:
    """After a restart the running workload is found again (a new waiter in its agent VM)
    and its exit is seen: exited, with its code."""
    before = rigs()
    attach(before)
    before.run(before.registry.create_bottle("r1", spec=spec(tmp, workload=("/agent", "run"))))
    before.close()
    rig = rigs(smolvm=before.smolvm)
    spawned = attach(rig)
    rig.recover()
    assert record(rig) == ("ready", "running", None)
    end_workload(spawned.waiter(), 9)
    assert record(rig) == ("exited", "exited", 9)
    assert rig.state()["r1"]["workload_exit_code"] == 9


def test_logs_of_a_bottle_without_a_workload_or_of_none(rigs: Rigs, tmp: str) -> None:
    """``bottle logs`` of a bottle that runs no workload is INVALID_ARGUMENT saying so; of an
    unknown bottle NOT_FOUND; nothing runs in the guest."""
    rig = rigs()
    spawned = attach(rig)
    rig.run(rig.registry.create_bottle("r1", spec=spec(tmp)))
    protocol = ProcessProtocol()
    with pytest.raises(InvalidArgument, match="runs no workload"):
        rig.run(rig.registry.spawn_logs("r1", 200, False, protocol))
    with pytest.raises(NotFound):
        rig.run(rig.registry.spawn_logs("nope", 200, False, protocol))
    assert spawned.attached == []
