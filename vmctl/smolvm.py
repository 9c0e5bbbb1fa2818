"""The typed smolvm API: one CLI call per method, typed results, typed errors.

Each method returns a Deferred. Failures are VmctlError subclasses (``vmctl.errors``); a guest
command's own exit code from ``exec`` is a result, not an error.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import math
import os
import re
import struct
import termios
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from enum import StrEnum
from typing import Any, ParamSpec, TypeVar

from attrs import asdict, evolve, field, frozen
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IProcessProtocol, IProcessTransport
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from vmctl import sessionend, templates
from vmctl.errors import (
    InvalidArgument,
    NotFound,
    SmolvmFailed,
    SmolvmUnavailable,
    UnsupportedVersion,
    UsageError,
    VmctlError,
    classify,
    error_text,
    json_error,
    sanitize,
    stderr_tail,
    strip_notes,
)
from vmctl.forksignals import child_signals_default
from vmctl.install import SOURCE_OPTION, SmolvmInstall, with_assets
from vmctl.runner import ProcessRunner, ProcResult, build_env
from vmctl.spec import (
    DEFAULT_DEVICE_BUDGET,
    MachineSpec,
    create_args,
    exec_args,
    validate_name,
    validate_spec,
)
from vmctl.uids import (
    UidEnd,
    UidPool,
    UidRegistryError,
    UidReservation,
    UidSupply,
    registry_of,
)

T = TypeVar("T")
P = ParamSpec("P")

#: The oldest smolvm vmctl drives. 1.8.0 is the first with ``machine create --label`` and
#: ``labels`` in ``ls --json`` (every create sends labels, recovery finds our machines by
#: them), and the first whose ``--mount-socket`` sockets are visible inside image containers.
MIN_VERSION = (1, 8, 0)
#: The releases the contract tiers run against the real CLI (CI runs both; docs/smolvm.md).
#: Another version is driven too, with one warning at start and an "untested" mark in
#: ``status``, ``NodeInfo`` and the self-test.
TESTED_VERSIONS = frozenset({(1, 32, 2), (1, 37, 3)})
#: The ``bottlenet[vm]`` extra's pin (pyproject.toml), said in the untested warning.
EXTRA_PIN = ">=1.32.2,<1.38"
_VERSION = re.compile(r"^smolvm (\d+)\.(\d+)\.(\d+)(\S*)\s*$", re.MULTILINE)
_PID = re.compile(r"running \(PID: (\d+)\)")
#: Longest ``--state-dir`` smolvm can use: it binds per-machine sockets 46 bytes below it
#: (``/.cache/smolvm/vms/<16 hex>/agent.sock``) and a UNIX socket path has 107 bytes.
MAX_STATE_DIR = 107 - 46
#: Seconds vmctl waits past smolvm's own ``exec --timeout`` before killing the CLI.
EXEC_TIMEOUT_MARGIN = 5.0
#: ``user=GUEST_ROOT``: the guest's root, for the commands of bottlenet's own (gate, bridge,
#: workload wrapper, ...). Without ``-u`` smolvm runs a command as the machine's user, then
#: the image's ``USER`` (1.32.2 ``machine exec --help``), with no capability when that user is
#: not root (fidelity.md #1). Sent as ``-u 0:0`` where the CLI has ``exec -u``; a CLI older
#: than that (1.32) cannot choose the user, so the command runs as its default user there.
GUEST_ROOT = "0:0"

#: What an ``on_call`` observer is told a call was: a fixed set, never an argv word.
SUBCOMMANDS = frozenset(
    {"create", "start", "stop", "delete", "exec", "ls", "status", "data-dir", "egress-events",
     "version", "help", "other"}
)  # fmt: skip
#: Results of calls that did not end in a VmctlError: cancelled, or a bug (any other error).
CANCELLED = "CANCELLED"
INTERNAL = "INTERNAL"

#: ``on_call(subcommand, result, seconds)``: ``result`` is ``"ok"`` or a VmctlError code.
CallObserver = Callable[[str, str, float], None]


def vm_dir_of(data_dir: str, name: str) -> str:
    """Where smolvm keeps machine ``name``'s own files under its state dir ``data_dir``: the
    first 16 hex digits of the name's SHA-256 (1.32.2 and 1.37.3, pinned by
    ``tests/vmctl/test_contract_layout.py``)."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return os.path.join(data_dir, ".cache", "smolvm", "vms", digest)


def subcommand_of(args: Sequence[str]) -> str:
    """The :data:`SUBCOMMANDS` name of a smolvm argv (without the binary)."""
    if list(args[:1]) == ["--version"]:
        return "version"
    if list(args[-1:]) == ["--help"]:
        return "help"
    if len(args) >= 2 and args[0] == "machine" and args[1] in SUBCOMMANDS:
        return args[1]
    return "other"


def call_words(args: Sequence[str]) -> str:
    """How a call is named in the log: ``machine create``, but ``machine create --help``
    for a feature probe (which creates nothing) and ``--version``."""
    words = list(args[:2])
    if len(args) > 2 and args[-1] == "--help":
        words.append("--help")
    return " ".join(words)


class VmUids(StrEnum):
    """Which uid smolvm runs each VM process (VMM) under: its privilege model.

    smolvm 1.32 started by root drops every VMM to its own unprivileged uid from a registry in
    its data dir (2000000 up; ``SMOLVM_VM_UID_DROP=off``, which vmctl never passes, would keep
    them root); started by any other user it cannot, and every VMM runs as that user.
    """

    PER_VM = "per-VM uids"
    ONE = "one uid"

    @classmethod
    def for_euid(cls, euid: int) -> VmUids:
        return cls.PER_VM if euid == 0 else cls.ONE


@frozen
class VmmSeen:
    """The uid one started VM process (VMM) ran under, read from ``/proc`` right after its
    ``machine start``: what the privilege model is, seen rather than assumed."""

    machine: str
    uid: int

    def model(self, daemon_euid: int) -> VmUids:
        """``per-VM uids`` if the VMM ran under a uid other than the daemon's, else one uid."""
        return VmUids.PER_VM if self.uid != daemon_euid else VmUids.ONE


def vmm_uid_of(pid: int, proc: str = "/proc") -> int | None:
    """A process's effective uid from ``/proc/PID/status`` (its ``/proc/PID`` owner is root for
    a process that changed uid, so the directory's owner would lie), or None if it is gone."""
    try:
        with open(os.path.join(proc, str(pid), "status"), "rb") as f:
            status = f.read(8192)
    except OSError:
        return None
    m = re.search(rb"^Uid:\s+\d+\s+(\d+)", status, re.M)
    return int(m.group(1)) if m else None


@frozen(order=True)
class SmolvmVersion:
    """A parsed ``smolvm --version``; the properties say which features it has."""

    major: int
    minor: int
    patch: int
    suffix: str = field(default="", order=False)

    @classmethod
    def parse(cls, stdout: bytes) -> SmolvmVersion:
        m = _VERSION.search(stdout.decode("utf-8", "replace"))
        if not m:
            raise SmolvmFailed(f"smolvm --version printed no version: {sanitize(stdout, 80)}")
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4))

    @property
    def triple(self) -> tuple[int, int, int]:
        return (self.major, self.minor, self.patch)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}{self.suffix}"

    @property
    def supported(self) -> bool:
        return self.triple >= MIN_VERSION

    @property
    def tested(self) -> bool:
        """One of :data:`TESTED_VERSIONS` (a suffix such as ``-rc1`` is another build)."""
        return self.triple in TESTED_VERSIONS and not self.suffix


def tested_names() -> tuple[str, ...]:
    """The tested versions, oldest first: ``("1.32.2", "1.37.3")``."""
    return tuple(".".join(map(str, v)) for v in sorted(TESTED_VERSIONS))


def untested_note(version: SmolvmVersion) -> str:
    """What the start warning, ``status`` and the self-test say of an untested smolvm."""
    return (
        f"smolvm {version} is untested: bottlenet is tested with {', '.join(tested_names())} "
        f"(the vm extra pins smolmachines{EXTRA_PIN}); it is driven all the same"
    )


_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@frozen
class Features:
    """What this smolvm's CLI offers beyond the 1.8.0 floor, read from its own ``--help``.

    Detected, not inferred from the version number: a build may lack a flag its version
    would suggest, and the contract tests check these against the real binary.
    """

    error_format_json: bool = False
    state_dir: bool = False
    expose_socket: bool = False
    user: bool = False
    exec_timeout: bool = False
    exec_user: bool = False
    block_private: bool = False

    @classmethod
    def from_help(cls, create_help: bytes, exec_help: bytes) -> Features:
        create = set(_FLAG.findall(create_help.decode("utf-8", "replace")))
        exec_ = set(_FLAG.findall(exec_help.decode("utf-8", "replace")))
        if "--label" not in create or "--name" not in create:
            raise UnsupportedVersion(
                "smolvm machine create has no --label: vmctl needs smolvm 1.8.0 or newer"
            )
        return cls(
            error_format_json="--error-format" in create and "--error-format" in exec_,
            state_dir="--state-dir" in create and "--state-dir" in exec_,
            expose_socket="--expose-socket" in create,
            user="--user" in create,
            exec_timeout="--timeout" in exec_,
            exec_user="--user" in exec_,
            block_private="--block-private" in create,
        )

    def names(self) -> list[str]:
        return [k for k, v in sorted(asdict(self).items()) if v is True]


@frozen
class Timeouts:
    """Seconds allowed for each kind of call before the child is killed."""

    version: float = 10.0
    create: float = 120.0
    start: float = 180.0
    stop: float = 30.0
    delete: float = 60.0
    exec: float = 60.0
    query: float = 30.0


@frozen
class Machine:
    """One record of ``machine ls --json`` / ``status --json``, parsed defensively."""

    name: str
    state: str
    pid: int | None = None
    labels: Mapping[str, str] = field(factory=dict)
    ports: int = 0
    mounts: int = 0
    ephemeral: bool = False
    network: bool = False
    image: str | None = None
    cpus: int | None = None
    memory_mib: int | None = None
    created_at: int | None = None
    state_reason: str | None = None
    cmd: tuple[str, ...] = ()
    #: ``--block-private`` as the record reports it (1.37): the private ranges re-opened under
    #: it (``()``: the floor whole), or None when the record does not show it.
    block_private: tuple[str, ...] | None = None
    #: Whether the record reports the floor at all: 1.37's records (which carry
    #: ``port_mappings``) show ``block_private`` exactly on machines created with it; 1.32's
    #: say nothing of it.
    reports_floor: bool = False

    @property
    def floor_whole(self) -> bool | None:
        """The private-range floor as recorded: True whole, False missing or re-opened,
        None when this smolvm does not report it."""
        if not self.reports_floor:
            return None
        return self.block_private == ()

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def unreachable(self) -> bool:
        """smolvm's ``unreachable``: the VMM pid is alive but its agent did not answer a
        250 ms ping (a busy host). Not a death: the caller checks the pid itself."""
        return self.state == "unreachable"

    @classmethod
    def from_json(cls, obj: object) -> Machine | None:
        """Build a record from one JSON object, or None when it is unusable."""
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return None
        state = obj.get("state")
        raw_labels = obj.get("labels")
        labels = (
            {k: v for k, v in raw_labels.items() if isinstance(k, str) and isinstance(v, str)}
            if isinstance(raw_labels, dict)
            else {}
        )
        image = obj.get("image")
        reason = obj.get("state_reason")
        raw_cmd = obj.get("cmd")
        cmd = tuple(w for w in raw_cmd if isinstance(w, str)) if isinstance(raw_cmd, list) else ()
        raw_floor = obj.get("block_private")
        floor = tuple(str(c) for c in raw_floor) if isinstance(raw_floor, list) else None
        return cls(
            name=name,
            state=state if isinstance(state, str) else "unknown",
            pid=_int(obj.get("pid")),
            labels=labels,
            ports=_int(obj.get("ports")) or 0,
            mounts=_int(obj.get("mounts")) or 0,
            ephemeral=obj.get("ephemeral") is True,
            network=obj.get("network") is True,
            image=image if isinstance(image, str) else None,
            cpus=_int(obj.get("cpus")),
            memory_mib=_int(obj.get("memory_mib")),
            created_at=_int(obj.get("created_at")),
            state_reason=reason if isinstance(reason, str) else None,
            cmd=cmd,
            block_private=floor,
            reports_floor=floor is not None or "port_mappings" in obj,
        )


def _int(v: object) -> int | None:
    return v if type(v) is int and v >= 0 else None


@frozen
class ExecResult:
    """The guest command's own outcome (smolvm's failures are raised instead)."""

    exit_code: int
    stdout: bytes = field(repr=lambda b: f"<{len(b)} bytes>")
    stderr: bytes = field(repr=lambda b: f"<{len(b)} bytes>")
    duration: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False


#: The operations an egress denial names (the API spec's EgressDenialInfo); others: "other".
EGRESS_OPERATIONS = frozenset({"connect", "sendto"})
#: The most denials asked for in one ``machine egress-events`` call (smolvm's default 200).
MAX_EGRESS_EVENTS = 200
_DEST = re.compile(r"^[0-9A-Za-z.:\[\]%-]{1,64}$")


@frozen
class EgressDenial:
    """One denial of a machine's egress policy (``machine egress-events --json``): what the
    guest tried, never a byte of its traffic. ``at`` is smolvm's RFC 3339 time ('' if none)."""

    at: str
    operation: str
    dest: str

    @classmethod
    def from_json(cls, obj: object) -> EgressDenial | None:
        """One record, checked: a destination that is not an address and port is dropped."""
        if not isinstance(obj, dict):
            return None
        op, dest, at = obj.get("operation"), obj.get("dest"), obj.get("timestamp")
        if not isinstance(dest, str) or not _DEST.match(dest):
            return None
        return cls(
            at=at if isinstance(at, str) and len(at) <= 40 and at.isprintable() else "",
            operation=op if op in EGRESS_OPERATIONS else "other",
            dest=dest,
        )


def machine_argv(
    features: Features, state_dir: str | None, sub: str, rest: Sequence[str]
) -> list[str]:
    """The argv (after the binary) of one ``machine SUB`` call: json errors and smolvm's own
    state directory wherever this CLI has them, then the subcommand's own ``rest``."""
    args = ["machine", sub]
    if features.error_format_json:
        args += ["--error-format", "json"]
    if features.state_dir and state_dir is not None:
        args += ["--state-dir", state_dir]
    return [*args, *rest]


def as_deferred(
    method: Callable[P, Coroutine[Deferred[Any], Any, T]],
) -> Callable[P, Deferred[T]]:
    """The API's one wrapper: a coroutine method called as a method that returns a Deferred
    (callers add callbacks, cancel it, or await it; a bad argument fails the Deferred)."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> Deferred[T]:
        return Deferred.fromCoroutine(method(*args, **kwargs))

    return call


class Smolvm:
    """Drives one smolvm binary against one state directory.

    ``binary`` is a :class:`vmctl.install.SmolvmInstall` (from :func:`vmctl.install.discover`)
    or an absolute path (its neighbouring assets are used if present); when it is None every
    call fails with SmolvmUnavailable. ``data_dir`` is smolvm's own state directory: passed as
    ``--state-dir`` where the CLI has it, else as ``SMOLVM_DATA_DIR``. ``environ`` is the source
    the child environment is built from (allow-list only, see :func:`vmctl.runner.build_env`);
    it defaults to a snapshot of ``os.environ`` taken here. ``on_call`` (e.g. the daemon's
    metrics) is told about every CLI call made: its :func:`subcommand_of` name, ``"ok"`` or the
    error code, and its wall time; vmctl itself stays free of any metrics library.
    """

    log = Logger()

    def __init__(
        self,
        runner: ProcessRunner,
        binary: str | SmolvmInstall | None,
        data_dir: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        timeouts: Timeouts = Timeouts(),
        device_budget: int = DEFAULT_DEVICE_BUDGET,
        check_version: bool = True,
        on_call: CallObserver | None = None,
        session_pythons: Sequence[str] = ("python3",),
        uid_pool: UidPool | None = None,
    ) -> None:
        if isinstance(binary, str):
            if not os.path.isabs(binary):
                raise ValueError("binary must be an absolute path (see vmctl.install.discover)")
            binary = with_assets(binary, SOURCE_OPTION)
        self.install = binary
        self.binary = binary.binary if binary is not None else None
        self.runner = runner
        self.data_dir_root = data_dir
        #: The per-VM uids of the data dir (as root): its blocks, reservations, retirements.
        self.uid_pool = uid_pool
        self._environ = dict(os.environ if environ is None else environ)
        self.timeouts = timeouts
        self.device_budget = device_budget
        self.check_version = check_version
        self.on_call = on_call
        #: The guest interpreters tried, in order, for the session wrapper
        #: (:mod:`vmctl.sessionend`): every attached command ends with its session.
        self.session_pythons = tuple(session_pythons)
        self._version: SmolvmVersion | None = None
        self._features: Features | None = None
        #: smolvm's ``machine data-dir`` answered as :func:`vm_dir_of` says once: from then on
        #: that layout gives a machine's VM dir, without a call (issue 38).
        self._vm_dir_layout = False
        #: The last started VM process's uid, as seen (None until a start reported a pid).
        self.vmm_seen: VmmSeen | None = None
        #: The version+features run in flight; it fires with None or the exception it met (a
        #: value, so it never fails and every waiter sees the same outcome).
        self._learning: Deferred[Exception | None] | None = None
        #: The disk templates' unpack (:meth:`unpack_templates`): fires with None when it is
        #: over, whatever its outcome; None when none was started.
        self._templates: Deferred[None] | None = None
        self._templates_stop = threading.Event()
        #: Set once the CLI turned out to have no ``machine egress-events``.
        self._no_egress_events = False

    @property
    def env(self) -> dict[str, str]:
        """The child environment: ``SMOLVM_DATA_DIR`` only for a smolvm without --state-dir."""
        # Once the CLI is known to have --state-dir, the state dir goes there and nowhere
        # else; before that (--version, --help) and on older CLIs it is SMOLVM_DATA_DIR.
        features = self._features
        data_dir = None if features is not None and features.state_dir else self.data_dir_root
        assets = self.install.env() if self.install is not None else {}
        return build_env(self._environ, data_dir, assets)

    def describe(self) -> str:
        """Which smolvm this is and where it came from (for status and the start log)."""
        if self.install is None:
            return "no smolvm (none given with --smolvm, none on PATH, no bottlenet[vm] wheel)"
        version = self._version
        said = "" if version is None else f"smolvm {version} "
        if version is not None and not version.tested:
            said += "(untested) "
        return said + self.install.describe()

    # -- plumbing ---------------------------------------------------------------------

    def machine_args(self, sub: str, *rest: str) -> list[str]:
        """``machine SUB`` plus the options every call gets, then ``rest``."""
        return machine_argv(self._features or Features(), self.data_dir_root, sub, rest)

    async def _run(
        self,
        args: Sequence[str],
        timeout: float,
        stdin: bytes | None = None,
        check: Callable[[ProcResult], None] | None = None,
    ) -> ProcResult:
        """One CLI call; ``check`` raises the VmctlError a finished call amounts to.

        The call, with its outcome, is reported to ``on_call`` whatever happens.
        """
        started = self.runner.clock.seconds()
        outcome = "ok"
        try:
            if self.binary is None:
                raise SmolvmUnavailable(
                    "no smolvm found: give --smolvm, put smolvm on PATH, or install "
                    "bottlenet[vm] (the smolmachines wheel)"
                )
            result = await self.runner.run([self.binary, *args], self.env, timeout, stdin=stdin)
            result = evolve(result, stderr=strip_notes(result.stderr))
            self.log.info(
                "smolvm {sub} exited {code} signal={sig} in {dur:.3f}s",
                sub=call_words(args),
                code=result.exit_code,
                sig=result.signal,
                dur=result.duration,
            )
            if check is not None:
                check(result)
            return result
        except VmctlError as e:
            outcome = e.code
            raise
        except CancelledError:
            outcome = CANCELLED
            raise
        except BaseException:
            outcome = INTERNAL
            raise
        finally:
            self._observe(args, outcome, self.runner.clock.seconds() - started)

    def _observe(self, args: Sequence[str], outcome: str, seconds: float) -> None:
        if self.on_call is None:
            return
        try:
            self.on_call(subcommand_of(args), outcome, max(0.0, seconds))
        except Exception:
            self.log.failure("smolvm call observer failed")

    async def _call(self, sub: str, rest: Sequence[str], timeout: float) -> ProcResult:
        await self._gate()

        def check(result: ProcResult) -> None:
            if result.exit_code != 0:
                raise classify(result.stderr, result.exit_code, f"machine {sub}", result.signal)

        return await self._run(self.machine_args(sub, *rest), timeout, check=check)

    async def _gate(self) -> None:
        if self.check_version:
            await self._learned()
        root = self.data_dir_root
        if root is not None and len(os.fsencode(root)) > MAX_STATE_DIR:
            raise SmolvmUnavailable(
                f"smolvm's state directory {sanitize(root, 120)} is too long "
                f"({len(os.fsencode(root))} bytes, at most {MAX_STATE_DIR}): smolvm binds "
                "per-machine UNIX sockets below it; choose a shorter --smolvm-data-dir "
                "or --state-dir"
            )

    async def _learned(self) -> None:
        """Version and features known, learned by one run that concurrent callers share."""
        if self._version is None or self._features is None:
            # One learning run at a time; concurrent callers wait for it.
            if self._learning is None:
                self._learning = Deferred.fromCoroutine(self._learn())
            learning = self._learning
            waiter: Deferred[Exception | None] = Deferred()

            def relay(outcome: Exception | None) -> Exception | None:
                waiter.callback(outcome)
                return outcome  # for the next waiter

            learning.addCallback(relay)
            outcome = await waiter
            if self._learning is learning:
                self._learning = None
            if outcome is not None:
                raise outcome

    async def _learn(self) -> Exception | None:
        try:
            if self._version is None:
                await self._version_call()
            if self._features is None:
                await self._feature_call()
        except Exception as e:
            return e
        return None

    async def _version_call(self) -> SmolvmVersion:
        parsed: list[SmolvmVersion] = []

        def check(result: ProcResult) -> None:
            if result.exit_code != 0:
                raise classify(result.stderr, result.exit_code, "--version", result.signal)
            version = SmolvmVersion.parse(result.stdout)
            if not version.supported:
                oldest = ".".join(map(str, MIN_VERSION))
                raise UnsupportedVersion(
                    f"smolvm {version} is too old: vmctl needs smolvm {oldest} or newer "
                    "(--label and labels in ls --json first came in 1.8.0)"
                )
            parsed.append(version)

        await self._run(["--version"], self.timeouts.version, check=check)
        version = parsed[0]
        if not version.tested and self._version is None:
            self.log.warn("{note}", note=untested_note(version))
        self._version = version
        return version

    async def _feature_call(self) -> Features:
        helps: list[bytes] = []

        def check(result: ProcResult) -> None:
            if result.exit_code != 0:
                raise classify(result.stderr, result.exit_code, "--help", result.signal)
            helps.append(result.stdout)

        await self._run(["machine", "create", "--help"], self.timeouts.version, check=check)
        await self._run(["machine", "exec", "--help"], self.timeouts.version, check=check)
        features = Features.from_help(helps[0], helps[1])
        self._features = features
        self.log.info(
            "smolvm {version} features: {names}",
            version=str(self._version),
            names=",".join(features.names()) or "none beyond 1.8.0",
        )
        return features

    # -- API --------------------------------------------------------------------------

    @as_deferred
    async def version(self) -> SmolvmVersion:
        """Run ``smolvm --version`` (and learn its features); UnsupportedVersion below
        MIN_VERSION."""
        if not self.check_version:
            return await self._version_call()
        await self._learned()  # shared with the gate: each probe runs once
        assert self._version is not None
        return self._version

    @property
    def known_version(self) -> SmolvmVersion | None:
        """The version seen by the last successful :meth:`version` (or gate) call."""
        return self._version

    @property
    def features(self) -> Features | None:
        """What the CLI offers, once the gate has run."""
        return self._features

    @as_deferred
    async def create(self, spec: MachineSpec) -> None:
        """``machine create``: validates ``spec`` (including the device budget) first."""
        validate_spec(spec, self.device_budget)
        await self._gate()
        features = self._features
        if features is not None:
            if spec.expose_sockets and not features.expose_socket:
                raise UnsupportedVersion(f"smolvm {self._version} has no --expose-socket")
            if spec.user is not None and not features.user:
                raise UnsupportedVersion(f"smolvm {self._version} has no create --user")
            if spec.block_private and not features.block_private:
                raise UnsupportedVersion(
                    f"smolvm {self._version} has no --block-private: {spec.name} would reach "
                    "the host's loopback, LAN and cloud metadata, so it is not created"
                )
        await self._call("create", create_args(spec)[2:], self.timeouts.create)

    @as_deferred
    async def start(self, name: str) -> int | None:
        """``machine start``: fires with the VM process pid once smolvm reports it ready.

        A start that fails, times out or is cancelled may leave a VMM behind whose record is
        not ``running``; only ``stop`` kills it, so undo with :meth:`remove`, never a bare
        :meth:`delete`.
        """
        validate_name(name)
        await self._templates_ready(name)
        result = await self._call("start", ["--name", name], self.timeouts.start)
        m = _PID.search(result.stdout.decode("utf-8", "replace"))
        pid = int(m.group(1)) if m else None
        uid = None if pid is None else vmm_uid_of(pid)
        if uid is not None:
            self.vmm_seen = VmmSeen(name, uid)
        return pid

    @as_deferred
    async def stop(self, name: str) -> None:
        """``machine stop``: succeeds too when the machine was not running, and kills a VMM
        left behind by a start that never finished."""
        validate_name(name)
        await self._call("stop", ["--name", name], self.timeouts.stop)

    @as_deferred
    async def delete(self, name: str) -> None:
        """``machine delete -f`` (always forced: without it smolvm stops, then prompts).

        It kills nothing when the record is not ``running``: use :meth:`remove`.
        """
        validate_name(name)
        await self._call("delete", ["--name", name, "-f"], self.timeouts.delete)

    @as_deferred
    async def remove(self, name: str) -> bool:
        """Stop, then ``delete -f``: no VMM outlives its record. Fires True if it existed.

        A failed stop does not prevent the delete (the machine must not stay listed), but it
        is logged; NotFound at either step means the machine is already gone.
        """
        try:
            await self.stop(name)
        except NotFound:
            return False
        except VmctlError as e:
            self.log.warn("stop of {name} failed: {err}; deleting anyway", name=name, err=e.message)
        try:
            await self.delete(name)
        except NotFound:
            return False
        return True

    @as_deferred
    async def exec(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
        workdir: str | None = None,
        detach: bool = False,
        user: str | None = None,
        session: Sequence[str] = (),
    ) -> ExecResult:
        """``machine exec``: the guest's exit code is returned, smolvm's failures raised.

        With ``detach`` (``-d``) smolvm starts the command, prints only its guest pid and
        returns: the result's stdout holds that pid and the command keeps running. ``user``
        (``-u``) runs it as that user. Where smolvm has ``exec --timeout`` it gets the same
        timeout, so the guest command dies with the call (exit 124) instead of running on:
        smolvm's pid-file kill on the plain path; with ``stdin`` (``-i``), where smolvm kills
        only ``crun exec``, the session wrapper (:mod:`vmctl.sessionend`).

        smolvm exits with the guest's code, so a failure is recognised by its last stderr
        line: the ``--error-format json`` object, or ``Error: `` plus a known smolvm phrase
        (or a clap usage error, exit 2).

        ``session``: the guest kit's session program (its argv up to ``session``), when the
        machine has bottlenet's kit mounted: it, not the image's python3, wraps the command.
        """
        # Refuse bad values before anything is spawned (the gate included).
        exec_args(name, argv, env, workdir, stdin is not None, detach, user)
        if stdin is not None:  # -i: smolvm's --timeout would kill only crun exec
            argv = sessionend.wrap(argv, self.session_pythons, session)
        await self._gate()
        features = self._features or Features()
        user = self._exec_user(user, features)
        seconds = timeout or self.timeouts.exec
        guest_timeout = max(1, math.ceil(seconds)) if features.exec_timeout and not detach else None
        rest = exec_args(
            name,
            argv,
            env,
            workdir,
            interactive=stdin is not None,
            detach=detach,
            user=user,
            guest_timeout=guest_timeout,
        )[2:]

        def check(result: ProcResult) -> None:
            # A guest's non-zero exit is a result ("ok"); only smolvm's own failure raises.
            if result.exit_code is None:
                raise classify(result.stderr, result.exit_code, "machine exec", result.signal)
            if _exec_smolvm_failure(result, name):
                raise _exec_error(result, name)

        # vmctl's own timeout only backs up smolvm's: a little later, so the guest's 124
        # is seen rather than a killed CLI.
        budget = seconds + (EXEC_TIMEOUT_MARGIN if guest_timeout is not None else 0.0)
        result = await self._run(self.machine_args("exec", *rest), budget, stdin=stdin, check=check)
        assert result.exit_code is not None
        self.log.info(
            "exec in {name}: guest exit {code}, out={nout}B err={nerr}B",
            name=name,
            code=result.exit_code,
            nout=len(result.stdout),
            nerr=len(result.stderr),
        )
        return ExecResult(
            exit_code=result.exit_code,
            stdout=result.stdout,
            stderr=result.stderr,
            duration=result.duration,
            stdout_truncated=result.stdout_truncated,
            stderr_truncated=result.stderr_truncated,
        )

    @as_deferred
    async def spawn_exec(
        self,
        name: str,
        argv: Sequence[str],
        protocol: IProcessProtocol,
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        tty: bool = False,
        size: tuple[int, int] | None = None,
        stdio: tuple[int, int, int] | None = None,
        session: Sequence[str] = (),
    ) -> IProcessTransport:
        """``machine exec -i [-t]`` attached to ``protocol``: the caller streams its stdio.

        With ``stdio`` (no ``tty``) the child's fds 0, 1, 2 are copies of those fds instead:
        its bytes go wherever they lead (``protocol`` only hears of its end).

        Without ``tty`` the child's stdin, stdout and stderr are pipes (fds 0, 1, 2). With
        ``tty`` the child runs on a new pseudo-terminal (``size`` is its ``(rows, cols)``):
        smolvm reads the guest terminal's size from it and, on SIGWINCH, again, so a
        resize is :func:`set_pty_size` on the transport's ``fd``. Nothing of the command
        line or its output is logged here. The caller ends the child (``signalProcess``)
        when its client goes away; smolvm then kills only ``crun exec``, and the session
        wrapper (:mod:`vmctl.sessionend`) ends the guest command.
        """
        exec_args(name, argv, env, workdir, interactive=True, tty=tty, user=user)
        await self._gate()
        user = self._exec_user(user, self._features or Features())
        if self.binary is None:
            raise SmolvmUnavailable("no smolvm binary configured or found on PATH")
        reactor: Any = self.runner.reactor
        argv = sessionend.wrap(argv, self.session_pythons, session)
        rest = exec_args(name, argv, env, workdir, interactive=True, tty=tty, user=user)[2:]
        full = [self.binary, *self.machine_args("exec", *rest)]
        self.log.info("smolvm machine exec (attached, tty={tty}) in {name}", tty=tty, name=name)
        if not tty:
            fds: dict[int, int | str] = {0: "w", 1: "r", 2: "r"}
            if stdio is not None:
                fds = dict(enumerate(stdio))
            with child_signals_default():  # a TERM before its exec ends it too
                transport: IProcessTransport = reactor.spawnProcess(
                    protocol, self.binary, full, env=self.env, childFDs=fds
                )
            return transport
        master, slave = os.openpty()
        try:
            if size is not None:
                set_pty_size(slave, *size)
            with child_signals_default():  # forked: a TERM before its exec ends it too
                transport = reactor.spawnProcess(
                    protocol,
                    self.binary,
                    full,
                    env=self.env,
                    usePTY=(master, slave, os.ttyname(slave)),
                )
        except BaseException:
            os.close(master)
            os.close(slave)
            raise
        return transport

    def _exec_user(self, user: str | None, features: Features) -> str | None:
        """``-u`` as this CLI can take it: :data:`GUEST_ROOT` falls back to the default user
        on a CLI without ``exec -u``; any other user is refused there."""
        if user is None or features.exec_user:
            return user
        if user == GUEST_ROOT:
            return None
        raise UnsupportedVersion(f"smolvm {self._version} has no exec --user")

    @as_deferred
    async def list(
        self, labels: Mapping[str, str] | None = None, include_ephemeral: bool = False
    ) -> list[Machine]:
        """``machine ls --json``, keeping machines that carry every ``labels`` pair."""
        result = await self._call("ls", ["--json"], self.timeouts.query)
        data = _json(result, "machine ls")
        if not isinstance(data, list):
            raise SmolvmFailed("smolvm machine ls --json did not print a JSON array")
        machines = [m for m in map(Machine.from_json, data) if m is not None]
        if len(machines) != len(data):
            self.log.warn("ignored {n} malformed ls entries", n=len(data) - len(machines))
        want = dict(labels or {})
        return [
            m
            for m in machines
            if (include_ephemeral or not m.ephemeral)
            and all(m.labels.get(k) == v for k, v in want.items())
        ]

    @as_deferred
    async def status(self, name: str) -> Machine:
        """``machine status --json`` for one machine (NotFound when it does not exist)."""
        validate_name(name)
        result = await self._call("status", ["--name", name, "--json"], self.timeouts.query)
        machine = Machine.from_json(_json(result, "machine status"))
        if machine is None or machine.name != name:
            raise SmolvmFailed(f"smolvm machine status --json gave no record for {name}")
        return machine

    @as_deferred
    async def egress_events(self, name: str, limit: int = 50) -> tuple[EgressDenial, ...] | None:
        """``machine egress-events --json``: the newest ``limit`` denials of ``name``'s egress
        policy, oldest first (smolvm keeps them in the VMM's log); None when this CLI has no
        such subcommand (then it is not asked again). Malformed records are dropped."""
        validate_name(name)
        if self._no_egress_events:
            return None
        limit = max(1, min(limit, MAX_EGRESS_EVENTS))
        try:
            result = await self._call(
                "egress-events", ["--name", name, "--json", "--limit", str(limit)],
                self.timeouts.query,
            )  # fmt: skip
        except UsageError:
            self._no_egress_events = True
            return None
        data = _json(result, "machine egress-events")
        if not isinstance(data, list):
            raise SmolvmFailed("smolvm machine egress-events --json did not print a JSON array")
        return tuple(d for d in map(EgressDenial.from_json, data[-limit:]) if d is not None)

    @as_deferred
    async def data_dir(self, name: str) -> str:
        """``machine data-dir``: the machine's per-VM state directory on the host."""
        validate_name(name)
        result = await self._call("data-dir", ["--name", name], self.timeouts.query)
        path = result.stdout.decode("utf-8", "replace").strip()
        if not path or "\n" in path or not os.path.isabs(path):
            raise SmolvmFailed(f"smolvm machine data-dir printed {sanitize(path, 80)!r}")
        return path

    async def _vm_dir(self, name: str) -> str:
        """The VM dir of ``name``, a machine that exists: :func:`vm_dir_of` once smolvm's own
        answer matched it (read once per daemon, not once per machine), else asked."""
        root = self.data_dir_root
        if self._vm_dir_layout and root is not None:
            return vm_dir_of(root, name)
        path = await self.data_dir(name)
        self._vm_dir_layout = root is not None and path == vm_dir_of(root, name)
        return path

    # -- disk templates (issue 38) ---------------------------------------------------

    def unpack_templates(self) -> Deferred[None] | None:
        """Unpack smolvm's disk templates beside its binary now, in the background
        (:mod:`vmctl.templates`), so the first ``machine start`` expands nothing; every start
        waits for it. None when there is nothing to do (or no way to do it here)."""
        if self.install is None or self._templates is not None:
            return self._templates
        here = os.path.dirname(os.path.realpath(self.install.binary))
        if not templates.unpackable(here):
            return None
        reactor: Any = self.runner.reactor
        clock = self.runner.clock
        began = clock.seconds()
        self.log.info("unpacking smolvm's disk templates in {dir}, in the background", dir=here)
        work: Deferred[list[str]] = deferToThreadPool(
            reactor, reactor.getThreadPool(), templates.unpack, here, self._templates_stop
        )

        def done(names: list[str]) -> None:
            self.log.info(
                "smolvm's disk templates are ready ({names} unpacked in {secs:.1f}s)",
                names=", ".join(names) or "none needed",
                secs=clock.seconds() - began,
            )

        def failed(failure: Any) -> None:
            if failure.check(templates.Stopped):
                return
            self.log.warn(
                "could not unpack smolvm's disk templates ({why}); its first start will",
                why=str(failure.value),
            )

        self._templates = work.addCallbacks(done, failed)
        return self._templates

    def stop_templates(self) -> None:
        """Stop an unpack in flight (the daemon is stopping): nothing half-written is left."""
        self._templates_stop.set()

    async def _templates_ready(self, name: str) -> None:
        """A start that comes while the templates are unpacked waits for them, and says so."""
        pending = self._templates
        if pending is None or pending.called:
            return
        self.log.info(
            "machine start of {name} waits for smolvm's disk templates (being unpacked: the "
            "first start after an install)",
            name=name,
        )
        waiter: Deferred[None] = Deferred()

        def relay(result: None) -> None:
            waiter.callback(None)
            return result

        pending.addBoth(relay)
        await waiter

    # -- per-VM uids (smolvm as root) -------------------------------------------------

    async def _off_thread(self, fn: Callable[..., T], *args: Any, name: str) -> T:
        """A blocking registry call on the reactor's thread pool (the lock is smolvm's)."""
        reactor: Any = self.runner.reactor
        try:
            result: T = await deferToThreadPool(reactor, reactor.getThreadPool(), fn, *args)
        except UidRegistryError as e:
            raise SmolvmFailed(f"the VM uid of {name}: {e}") from None
        return result

    def _pool(self, vm_dir: str | None = None) -> UidPool:
        if self.uid_pool is not None:
            return self.uid_pool
        if vm_dir is not None:
            return UidPool.of_vm_dir(vm_dir)
        return UidPool(self.data_dir_root or os.path.expanduser("~"))

    @as_deferred
    async def reserve_uid(self, name: str, volumes: Sequence[str] = ()) -> UidReservation:
        """The uid ``machine start`` will run ``name``'s VMM as (smolvm's per-VM uids, as
        root), written into smolvm's root-owned registry now, from this data dir's own uids
        (``volumes``: its read-write volumes, looked at before the uid is given out again)."""
        vm_dir = await self._vm_dir(name)
        uid = await self._off_thread(self._pool(vm_dir).reserve, vm_dir, volumes, name=name)
        return UidReservation(uid, registry_of(vm_dir), vm_dir)

    @as_deferred
    async def vmm_uid(self, name: str) -> int | None:
        """The uid smolvm's root-owned registry holds for ``name``'s VMM (None: no entry).
        Never the VM dir's ``.vm-uid``: the VMM's own uid can write that."""
        vm_dir = await self.data_dir(name)
        return await self._off_thread(self._pool(vm_dir).registered, vm_dir, name=name)

    @as_deferred
    async def end_uid(self, uid: int) -> UidEnd:
        """After a VM's delete: end every process of its machine still running as its
        per-VM uid (a compromised VMM's leftovers); what it did (:class:`UidEnd`)."""
        return await self._off_thread(self._pool().end, uid, name=f"uid {uid}")

    @as_deferred
    async def retire_uid(self, uid: int, prove: bool = False) -> bool:
        """The uid's VM is deleted: it waits until nothing of it is left (``prove``: looked
        at now; whether it is free again)."""
        return await self._off_thread(self._pool().retire, uid, prove, name=f"uid {uid}")

    @as_deferred
    async def uid_supply(self) -> UidSupply:
        """How many per-VM uids this data dir can still give out."""
        return await self._off_thread(self._pool().supply, name="the data dir")


_EXEC_FAILURES = re.compile(
    r"^Error: (vm not found: |agent operation failed: |config operation failed: )"
)
#: With --error-format json smolvm reports its own failures with one of these codes.
_EXEC_JSON_CODES = frozenset(
    {"NOT_FOUND", "CONFLICT", "INTERRUPTED", "CONFIG_ERROR", "INVALID_STATE", "STORAGE_ERROR",
     "MOUNT_ERROR", "KVM_UNAVAILABLE", "HYPERVISOR_UNAVAILABLE", "SMOLVM_ERROR"}
)  # fmt: skip


def _exec_smolvm_failure(result: ProcResult, name: str) -> bool:
    """True when a non-zero exec exit is smolvm's own failure rather than the guest's."""
    if result.exit_code == 0:
        return False
    text = result.stderr.decode("utf-8", "replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if result.exit_code == 2 and any(ln.startswith("error: ") for ln in lines[:1]):
        return "Usage: smolvm" in text or "For more information, try" in text
    if result.exit_code != 1:
        return False
    found = json_error(result.stderr)
    if found is not None:
        # COMMAND_FAILED is the guest command's own failure, reported as a result.
        return found[0] in _EXEC_JSON_CODES
    # smolvm prints its error last. A guest can still forge such a line; that only turns its
    # own result into an error (documented in docs/smolvm.md).
    return bool(_EXEC_FAILURES.match(error_text(result.stderr)))


def set_pty_size(fd: int, rows: int, cols: int) -> None:
    """``TIOCSWINSZ`` on a pty: the kernel signals SIGWINCH to its foreground group."""
    packed = struct.pack("HHHH", max(0, min(rows, 0xFFFF)), max(0, min(cols, 0xFFFF)), 0, 0)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, packed)


def _exec_error(result: ProcResult, name: str) -> SmolvmFailed:
    """smolvm's exec failure, typed by its error line but carrying none of its text.

    The guest writes exec's stderr as well, so a workload could forge an ``Error:`` line: its
    words must never become the message a control client sees (or the log's stderr tail).
    """
    err = classify(result.stderr, result.exit_code, "machine exec")
    err.message = (
        f"smolvm machine exec in {name} failed ({err.code}, exit {result.exit_code}); "
        "its error text is withheld: the guest shares that stream"
    )
    err.args = (err.message,)
    err.stderr_tail = ""
    return err


def _json(result: ProcResult, what: str) -> object:
    if result.stdout_truncated:
        raise SmolvmFailed(f"smolvm {what} output was too large")
    try:
        return json.loads(result.stdout.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise SmolvmFailed(
            f"smolvm {what} --json printed invalid JSON", stderr_tail(result.stderr)
        ) from None


__all__ = [
    "EXTRA_PIN",
    "MIN_VERSION",
    "TESTED_VERSIONS",
    "EgressDenial",
    "ExecResult",
    "Features",
    "InvalidArgument",
    "Machine",
    "Smolvm",
    "SmolvmVersion",
    "Timeouts",
    "UidReservation",
    "UidSupply",
    "VmUids",
    "set_pty_size",
    "tested_names",
    "untested_note",
]
