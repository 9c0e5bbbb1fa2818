"""One exit waiter per VM bottle whose workload runs, kept by name.

A waiter is a process in the agent VM that ends when the workload does and reports its exit
code (:class:`~bottlenet.bottles.workload.WorkloadWaiter`); the registry hears the code and
turns the bottle ``exited``. A waiter whose exec fails or whose process is lost is dropped and
logged; the workload itself is never touched (it outlives a daemon stop). A waiter lost because
the agent VM stopped or crashed (a real VM takes its sessions with it: ``connection to VM
lost``) makes the registry degrade the bottle with that reason (``bottles/vmloss.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from bottlenet.bottles import attach, workload
from bottlenet.bottles.attach import ExecRequest
from bottlenet.bottles.lifecycle import VMLifecycle
from bottlenet.bottles.model import Bottle
from bottlenet.bottles.vmloss import lost_reason


class WorkloadWatches:
    """The registry's workload waiters: at most one per bottle."""

    log = Logger()

    def __init__(
        self,
        exited: Callable[[str, int], None],
        vm_lost: Callable[[str, str], None] = lambda name, why: None,
    ) -> None:
        self._exited = exited
        self._vm_lost = vm_lost
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
                if not waiter.cancelled:
                    Deferred.fromCoroutine(self._after_loss(vms.smolvm, name, vm.agent_vm))

        waiter = workload.WorkloadWaiter(lambda code: self._ended(name, code), lost)
        self._waiters[name] = waiter
        request = ExecRequest(tuple(workload.waiter_argv(vm.agent_vm)))

        def failed(f: Failure) -> None:
            lost()
            self.log.warn(
                "bottle {bottle}: cannot watch its workload: {err}",
                bottle=name,
                err=getattr(f.value, "message", type(f.value).__name__),
            )

        d = Deferred.fromCoroutine(attach.spawn_exec(vms, bottle, request, waiter))
        d.addErrback(failed)

    async def _after_loss(self, smolvm: Any, name: str, agent_vm: str) -> None:
        """The waiter ended without a code: said so, and the VM's loss made the bottle's."""
        gone = await lost_reason(smolvm, agent_vm)
        self.log.warn(
            "bottle {bottle}: its workload waiter ended without an exit code ({why})",
            bottle=name,
            why=gone or "the agent VM runs; the workload's end will not be noticed",
        )
        if gone is not None:
            self._vm_lost(name, gone)

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
