"""The vmctl service: owns the process runner's lifetime inside the daemon's service tree."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from attrs import frozen
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorProcess, IReactorTime
from twisted.logger import Logger

from vmctl.errors import SmolvmUnavailable, sanitize
from vmctl.install import (
    SOURCE_OPTION,
    SmolvmInstall,
    discover,
    find_wheel,
    untrusted_reason,
)
from vmctl.runner import ProcessRunner, build_env
from vmctl.smolvm import MAX_STATE_DIR, CallObserver, Smolvm, SmolvmVersion, Timeouts
from vmctl.spec import DEFAULT_DEVICE_BUDGET
from vmctl.uidranges import DEFAULT_LEDGER
from vmctl.uids import UidPool

DEFAULT_STOP_DEADLINE = 10.0


class StartupRefused(SmolvmUnavailable):
    """A ``--smolvm`` or ``--smolvm-data-dir`` the daemon must not start with.

    The message is one line that names the option, the value given and the reason.
    """


class VmctlService(Service):
    """stopService waits for smolvm calls in flight and kills those past ``stop_deadline``.

    VMs themselves are left running: they survive a daemon restart by design.
    """

    log = Logger()

    def __init__(
        self,
        runner: ProcessRunner,
        stop_deadline: float = DEFAULT_STOP_DEADLINE,
        smolvm: Smolvm | None = None,
    ):
        self.runner = runner
        self.stop_deadline = stop_deadline
        #: Whose disk templates are unpacked at start (issue 38: the first create expands none).
        self.smolvm = smolvm

    def startService(self) -> None:
        super().startService()
        if self.smolvm is not None:
            self.smolvm.unpack_templates()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        if self.smolvm is not None:
            self.smolvm.stop_templates()
        self.log.info("stopping vmctl: {n} call(s) in flight", n=self.runner.in_flight)
        return self.runner.shutdown(self.stop_deadline)


@frozen
class SmolvmChoice:
    """Which smolvm the daemon runs and where its state goes: found and checked once, up front."""

    install: SmolvmInstall | None
    data_dir: str | None
    environ: Mapping[str, str]
    #: The host's record of which data dir owns which per-VM uids (``vmctl.uidranges``).
    uid_ledger: str = DEFAULT_LEDGER


def choose_smolvm(
    smolvm_option: str | None,
    data_dir_option: str | None,
    *,
    environ: Mapping[str, str] | None = None,
    default_data_dir: str | None = None,
    wheel: Callable[[], SmolvmInstall | None] = find_wheel,
    uid_ledger: str = DEFAULT_LEDGER,
) -> SmolvmChoice:
    """Check the daemon's ``--smolvm`` and ``--smolvm-data-dir`` options (StartupRefused).

    The binary is found once, here (:func:`vmctl.install.discover`: the option, then PATH,
    then the ``bottlenet[vm]`` wheel). When none is found the daemon still runs and every VM
    call fails with SMOLVM_UNAVAILABLE. smolvm's state goes to ``--smolvm-data-dir`` or else
    ``default_data_dir`` (the daemon passes ``<state-dir>/smolvm``), so bottlenet's machines
    never mix with a user's own.
    """
    env = dict(os.environ if environ is None else environ)
    if data_dir_option:
        check_data_dir_option(data_dir_option)
    install = discover(smolvm_option, env.get("PATH"), wheel=wheel)
    if smolvm_option:
        install = check_smolvm_option(smolvm_option, install, env)
    if install is None:
        VmctlService.log.warn("no smolvm binary found; VM calls will fail (SMOLVM_UNAVAILABLE)")
    else:
        VmctlService.log.info("smolvm: {where}", where=install.describe())
    chosen = data_dir_option or default_data_dir
    data_dir = os.path.abspath(chosen) if chosen else None
    return SmolvmChoice(install, data_dir, env, os.path.abspath(uid_ledger))


def build_smolvm(
    reactor: IReactorProcess,
    choice: SmolvmChoice,
    *,
    clock: IReactorTime | None = None,
    timeouts: Timeouts = Timeouts(),  # noqa: B008 - frozen value
    device_budget: int = DEFAULT_DEVICE_BUDGET,
    stop_deadline: float = DEFAULT_STOP_DEADLINE,
    on_call: CallObserver | None = None,
    session_pythons: Sequence[str] = ("python3",),
    uid_roots: Sequence[str] = (),
) -> tuple[VmctlService, Smolvm]:
    """The runner's service and the Smolvm for a checked choice (``on_call`` hears every call;
    ``session_pythons``: the guest interpreters the session wrapper tries; ``uid_roots``:
    where else VM uids' files may stay)."""
    runner = ProcessRunner(reactor, clock)
    pool = None
    if choice.data_dir is not None:
        pool = UidPool(choice.data_dir, ledger=choice.uid_ledger, roots=uid_roots)
    smolvm = Smolvm(
        runner,
        choice.install,
        choice.data_dir,
        environ=dict(choice.environ),
        timeouts=timeouts,
        device_budget=device_budget,
        on_call=on_call,
        session_pythons=session_pythons,
        uid_pool=pool,
    )
    return VmctlService(runner, stop_deadline, smolvm), smolvm


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
    """:func:`choose_smolvm` then :func:`build_smolvm`, in one call."""
    choice = choose_smolvm(
        smolvm_option,
        data_dir_option,
        environ=environ,
        default_data_dir=default_data_dir,
        wheel=wheel,
    )
    return build_smolvm(
        reactor,
        choice,
        clock=clock,
        timeouts=timeouts,
        device_budget=device_budget,
        stop_deadline=stop_deadline,
        on_call=on_call,
    )


def check_data_dir_option(option: str) -> None:
    """Refuse a ``--smolvm-data-dir`` smolvm could not bind its per-machine sockets below."""
    path = os.path.abspath(option)
    size = len(os.fsencode(path))
    if size > MAX_STATE_DIR:
        raise StartupRefused(
            f"--smolvm-data-dir {sanitize(path, 120)}: too long ({size} bytes, at most "
            f"{MAX_STATE_DIR}): smolvm binds per-machine UNIX sockets below it"
        )


def check_smolvm_option(
    option: str, install: SmolvmInstall | None, environ: Mapping[str, str]
) -> SmolvmInstall:
    """The ``--smolvm`` the operator named, or StartupRefused saying why it cannot be used.

    Missing, not executable, not trusted (:func:`vmctl.install.untrusted_reason`), or not a
    smolvm: its ``--version`` must exit 0 and print ``smolvm X.Y.Z``. Run once, blocking, while
    the daemon is built (before the reactor runs and before anything is bound).
    """
    given = sanitize(option, 120)
    if install is None or install.source != SOURCE_OPTION:
        raise StartupRefused(f"--smolvm {given}: {_why_unusable(option, environ.get('PATH'))}")
    _probe_version(install, environ, given)
    return install


def _why_unusable(option: str, env_path: str | None) -> str:
    if os.sep not in option:
        return "not found as an executable on the daemon's PATH (relative entries are ignored)"
    path = os.path.abspath(option)
    if not os.path.lexists(path):
        return "no such file"
    if not os.path.isfile(path):
        return "not a regular file"
    if not os.access(path, os.X_OK):
        return "not executable"
    return untrusted_reason(path) or "not usable"


def _probe_version(install: SmolvmInstall, environ: Mapping[str, str], given: str) -> None:
    import subprocess

    env = build_env(environ, None, install.env())
    try:
        done = subprocess.run(
            [install.binary, "--version"],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=Timeouts().version,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise StartupRefused(f"--smolvm {given}: `--version` did not answer") from None
    except OSError as e:
        raise StartupRefused(f"--smolvm {given}: cannot run it: {e.strerror or e}") from None
    said = sanitize(done.stdout or done.stderr, 60)
    if done.returncode != 0:  # whatever it printed: a smolvm answers --version with 0
        raise StartupRefused(
            f"--smolvm {given}: not a usable smolvm (`--version` exited {done.returncode}: "
            f"{said!r})"
        )
    try:
        SmolvmVersion.parse(done.stdout)
    except Exception:
        raise StartupRefused(
            f"--smolvm {given}: not a smolvm (`--version` printed no `smolvm X.Y.Z`: {said!r})"
        ) from None
