"""One exit waiter per VM bottle whose workload runs, kept by name.

A waiter is a process in the agent VM that ends when the workload does and reports its exit
code (:class:`~bottlenet.bottles.workload.WorkloadWaiter`); the registry hears the code and
turns the bottle ``exited``. A waiter whose exec fails or whose process is lost is dropped and
logged; the workload itself is never touched (it outlives a daemon stop).
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from bottlenet.bottles import attach, workload
from bottlenet.bottles.attach import ExecRequest
from bottlenet.bottles.lifecycle import VMLifecycle
from bottlenet.bottles.model import Bottle
from vmctl.smolvm import GUEST_ROOT


class WorkloadWatches:
    """The registry's workload waiters: at most one per bottle."""

    log = Logger()

    def __init__(self, exited: Callable[[str, int], None]) -> None:
        self._exited = exited
        self._waiters: dict[str, workload.WorkloadWaiter] = {}

    def watch(self, vms: VMLifecycle, bottle: Bottle) -> None:
        """Wait for the bottle's running workload to end (nothing if one already waits)."""
        vm = bottle.vms
        name = bottle.name
        if vm is None or vm.workload != workload.WorkloadState.RUNNING or name in self._waiters:
            return

        def lost() -> None:
            if self._waiters.get(name) is waiter:
                del self._waiters[name]

        waiter = workload.WorkloadWaiter(lambda code: self._ended(name, code), lost)
        self._waiters[name] = waiter
        request = ExecRequest(tuple(workload.waiter_argv(vm.agent_vm)), user=GUEST_ROOT)

        def failed(f: Failure) -> None:
            lost()
            self.log.warn(
                "bottle {bottle}: cannot watch its workload: {err}",
                bottle=name,
                err=getattr(f.value, "message", type(f.value).__name__),
            )

        d = Deferred.fromCoroutine(attach.spawn_exec(vms, bottle, request, waiter))
        d.addErrback(failed)

    def _ended(self, name: str, code: int) -> None:
        self._waiters.pop(name, None)
        self._exited(name, code)

    def stop(self, name: str) -> None:
        """End the bottle's waiter (the workload keeps running)."""
        waiter = self._waiters.pop(name, None)
        if waiter is not None:
            waiter.cancel()

    def stop_all(self) -> None:
        """The daemon stops: end every waiter."""
        for name in list(self._waiters):
            self.stop(name)
