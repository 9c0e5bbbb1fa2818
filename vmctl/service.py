"""The vmctl service: owns the process runner's lifetime inside the daemon's service tree."""

from __future__ import annotations

import os
from collections.abc import Mapping

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorProcess, IReactorTime
from twisted.logger import Logger

from vmctl.runner import ProcessRunner, resolve_smolvm, untrusted_reason
from vmctl.smolvm import CallObserver, Smolvm, Timeouts
from vmctl.spec import DEFAULT_DEVICE_BUDGET

DEFAULT_STOP_DEADLINE = 10.0


class VmctlService(Service):
    """stopService waits for smolvm calls in flight and kills those past ``stop_deadline``.

    VMs themselves are left running: they survive a daemon restart by design.
    """

    log = Logger()

    def __init__(self, runner: ProcessRunner, stop_deadline: float = DEFAULT_STOP_DEADLINE):
        self.runner = runner
        self.stop_deadline = stop_deadline

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self.log.info("stopping vmctl: {n} call(s) in flight", n=self.runner.in_flight)
        return self.runner.shutdown(self.stop_deadline)


def make_smolvm(
    reactor: IReactorProcess,
    smolvm_option: str | None,
    data_dir_option: str | None,
    *,
    environ: Mapping[str, str] | None = None,
    clock: IReactorTime | None = None,
    timeouts: Timeouts = Timeouts(),  # noqa: B008 - frozen value
    device_budget: int = DEFAULT_DEVICE_BUDGET,
    stop_deadline: float = DEFAULT_STOP_DEADLINE,
    on_call: CallObserver | None = None,
) -> tuple[VmctlService, Smolvm]:
    """Wire the daemon's ``--smolvm`` and ``--smolvm-data-dir`` options into a Smolvm.

    The binary is resolved once, here, on the daemon's PATH. When none is found the daemon
    still runs and every VM call fails with SMOLVM_UNAVAILABLE. ``on_call`` is passed on to
    :class:`Smolvm` (the daemon's metrics hear every call through it).
    """
    env = dict(os.environ if environ is None else environ)
    binary = resolve_smolvm(smolvm_option, env.get("PATH"))
    if binary is None and smolvm_option and os.path.isfile(smolvm_option):
        VmctlService.log.warn(
            "--smolvm {path} is not used: {why}; VM calls will fail (SMOLVM_UNAVAILABLE)",
            path=os.path.abspath(smolvm_option),
            why=untrusted_reason(os.path.abspath(smolvm_option)) or "it is not executable",
        )
    elif binary is None:
        VmctlService.log.warn("no smolvm binary found; VM calls will fail (SMOLVM_UNAVAILABLE)")
    data_dir = os.path.abspath(data_dir_option) if data_dir_option else None
    runner = ProcessRunner(reactor, clock)
    smolvm = Smolvm(
        runner,
        binary,
        data_dir,
        environ=env,
        timeouts=timeouts,
        device_budget=device_budget,
        on_call=on_call,
    )
    return VmctlService(runner, stop_deadline), smolvm
