"""The vmctl service: owns the process runner's lifetime inside the daemon's service tree."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorProcess, IReactorTime
from twisted.logger import Logger

from vmctl.install import SmolvmInstall, discover, find_wheel, untrusted_reason
from vmctl.runner import ProcessRunner
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
    default_data_dir: str | None = None,
    wheel: Callable[[], SmolvmInstall | None] = find_wheel,
) -> tuple[VmctlService, Smolvm]:
    """Wire the daemon's ``--smolvm`` and ``--smolvm-data-dir`` options into a Smolvm.

    The binary is found once, here (:func:`vmctl.install.discover`: the option, then PATH,
    then the ``bottlenet[vm]`` wheel). When none is found the daemon still runs and every VM
    call fails with SMOLVM_UNAVAILABLE. smolvm's state goes to ``--smolvm-data-dir`` or else
    ``default_data_dir`` (the daemon passes ``<state-dir>/smolvm``), so bottlenet's machines
    never mix with a user's own. ``on_call`` is passed on to :class:`Smolvm` (the daemon's
    metrics hear every call through it).
    """
    env = dict(os.environ if environ is None else environ)
    install = discover(smolvm_option, env.get("PATH"), wheel=wheel)
    if install is None and smolvm_option and os.path.isfile(smolvm_option):
        VmctlService.log.warn(
            "--smolvm {path} is not used: {why}; VM calls will fail (SMOLVM_UNAVAILABLE)",
            path=os.path.abspath(smolvm_option),
            why=untrusted_reason(os.path.abspath(smolvm_option)) or "it is not executable",
        )
    elif install is None:
        VmctlService.log.warn("no smolvm binary found; VM calls will fail (SMOLVM_UNAVAILABLE)")
    else:
        VmctlService.log.info("smolvm: {where}", where=install.describe())
    chosen = data_dir_option or default_data_dir
    data_dir = os.path.abspath(chosen) if chosen else None
    runner = ProcessRunner(reactor, clock)
    smolvm = Smolvm(
        runner,
        install,
        data_dir,
        environ=env,
        timeouts=timeouts,
        device_budget=device_budget,
        on_call=on_call,
    )
    return VmctlService(runner, stop_deadline), smolvm
