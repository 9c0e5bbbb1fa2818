"""The typed smolvm API: one CLI call per method, typed results, typed errors.

Each method returns a Deferred. Failures are VmctlError subclasses (``vmctl.errors``); a guest
command's own exit code from ``exec`` is a result, not an error.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from attrs import field, frozen
from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger

from vmctl.errors import (
    InvalidArgument,
    SmolvmFailed,
    SmolvmUnavailable,
    UnsupportedVersion,
    VmctlError,
    classify,
    error_text,
    sanitize,
    stderr_tail,
)
from vmctl.runner import ProcessRunner, ProcResult, build_env
from vmctl.spec import (
    DEFAULT_DEVICE_BUDGET,
    MachineSpec,
    create_args,
    exec_args,
    validate_name,
    validate_spec,
)

T = TypeVar("T")

#: The oldest smolvm vmctl drives: 1.x CLI forms (``--name``) plus ``--mount-socket``.
MIN_VERSION = (1, 6, 4)
_VERSION = re.compile(r"^smolvm (\d+)\.(\d+)\.(\d+)(\S*)\s*$", re.MULTILINE)
_PID = re.compile(r"running \(PID: (\d+)\)")

#: What an ``on_call`` observer is told a call was: a fixed set, never an argv word.
SUBCOMMANDS = frozenset(
    {"create", "start", "stop", "delete", "exec", "ls", "status", "data-dir", "version", "other"}
)
#: Results of calls that did not end in a VmctlError: cancelled, or a bug (any other error).
CANCELLED = "CANCELLED"
INTERNAL = "INTERNAL"

#: ``on_call(subcommand, result, seconds)``: ``result`` is ``"ok"`` or a VmctlError code.
CallObserver = Callable[[str, str, float], None]


def subcommand_of(args: Sequence[str]) -> str:
    """The :data:`SUBCOMMANDS` name of a smolvm argv (without the binary)."""
    if list(args[:1]) == ["--version"]:
        return "version"
    if len(args) >= 2 and args[0] == "machine" and args[1] in SUBCOMMANDS:
        return args[1]
    return "other"


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
    def supports_mount_socket(self) -> bool:
        """``--mount-socket HOST:GUEST`` (socket-mode bottles)."""
        return self.triple >= (1, 6, 4)

    @property
    def ports_force_virtio_net(self) -> bool:
        """Published ports select virtio-net (loopback-only publishing) since 1.0.4."""
        return self.triple >= (1, 0, 4)

    @property
    def egress_forces_virtio_net(self) -> bool:
        """An egress policy selects virtio-net (TSI + allow-list refused) since 1.1.3."""
        return self.triple >= (1, 1, 3)


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

    @property
    def running(self) -> bool:
        return self.state == "running"

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


def _coro(c: Coroutine[Deferred[Any], Any, T]) -> Deferred[T]:
    return Deferred.fromCoroutine(c)


class Smolvm:
    """Drives one smolvm binary against one state directory.

    ``binary`` is the absolute path from :func:`vmctl.runner.resolve_smolvm`; when it is None
    every call fails with SmolvmUnavailable. ``environ`` is the source the child environment
    is built from (allow-list only, see :func:`vmctl.runner.build_env`); it defaults to a
    snapshot of ``os.environ`` taken here. ``on_call`` (e.g. the daemon's metrics) is told
    about every CLI call made: its :func:`subcommand_of` name, ``"ok"`` or the error code,
    and its wall time; vmctl itself stays free of any metrics library.
    """

    log = Logger()

    def __init__(
        self,
        runner: ProcessRunner,
        binary: str | None,
        data_dir: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        timeouts: Timeouts = Timeouts(),
        device_budget: int = DEFAULT_DEVICE_BUDGET,
        check_version: bool = True,
        on_call: CallObserver | None = None,
    ) -> None:
        if binary is not None and not os.path.isabs(binary):
            raise ValueError("binary must be an absolute path (see resolve_smolvm)")
        self.runner = runner
        self.binary = binary
        self.data_dir_root = data_dir
        self.env = build_env(os.environ if environ is None else environ, data_dir)
        self.timeouts = timeouts
        self.device_budget = device_budget
        self.check_version = check_version
        self.on_call = on_call
        self._version: SmolvmVersion | None = None

    # -- plumbing ---------------------------------------------------------------------

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
                raise SmolvmUnavailable("no smolvm binary configured or found on PATH")
            result = await self.runner.run([self.binary, *args], self.env, timeout, stdin=stdin)
            self.log.info(
                "smolvm {sub} exited {code} signal={sig} in {dur:.3f}s",
                sub=" ".join(args[:2]),
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

    async def _call(self, args: Sequence[str], timeout: float, what: str) -> ProcResult:
        await self._gate()

        def check(result: ProcResult) -> None:
            if result.exit_code != 0:
                raise classify(result.stderr, result.exit_code, what, result.signal)

        return await self._run(args, timeout, check=check)

    async def _gate(self) -> None:
        if self.check_version and self._version is None:
            await self._version_call()

    async def _version_call(self) -> SmolvmVersion:
        parsed: list[SmolvmVersion] = []

        def check(result: ProcResult) -> None:
            if result.exit_code != 0:
                raise classify(result.stderr, result.exit_code, "--version", result.signal)
            version = SmolvmVersion.parse(result.stdout)
            if not version.supported:
                oldest = ".".join(map(str, MIN_VERSION))
                raise UnsupportedVersion(
                    f"smolvm {version} is too old: vmctl needs smolvm {oldest} or newer"
                )
            parsed.append(version)

        await self._run(["--version"], self.timeouts.version, check=check)
        self._version = parsed[0]
        return parsed[0]

    # -- API --------------------------------------------------------------------------

    def version(self) -> Deferred[SmolvmVersion]:
        """Run ``smolvm --version``; fails with UnsupportedVersion below MIN_VERSION."""
        return _coro(self._version_call())

    @property
    def known_version(self) -> SmolvmVersion | None:
        """The version seen by the last successful :meth:`version` (or gate) call."""
        return self._version

    def create(self, spec: MachineSpec) -> Deferred[None]:
        """``machine create``: validates ``spec`` (including the device budget) first."""

        async def go() -> None:
            validate_spec(spec, self.device_budget)
            if spec.mount_sockets:
                await self._gate()
                if self._version is not None and not self._version.supports_mount_socket:
                    raise UnsupportedVersion(f"smolvm {self._version} has no --mount-socket")
            await self._call(create_args(spec), self.timeouts.create, "machine create")

        return _coro(go())

    def start(self, name: str) -> Deferred[int | None]:
        """``machine start``: fires with the VM process pid once smolvm reports it ready."""

        async def go() -> int | None:
            validate_name(name)
            result = await self._call(
                ["machine", "start", "--name", name], self.timeouts.start, "machine start"
            )
            m = _PID.search(result.stdout.decode("utf-8", "replace"))
            return int(m.group(1)) if m else None

        return _coro(go())

    def stop(self, name: str) -> Deferred[None]:
        """``machine stop``: succeeds too when the machine was not running."""

        async def go() -> None:
            validate_name(name)
            await self._call(
                ["machine", "stop", "--name", name], self.timeouts.stop, "machine stop"
            )

        return _coro(go())

    def delete(self, name: str) -> Deferred[None]:
        """``machine delete -f`` (always forced: without it smolvm stops, then prompts)."""

        async def go() -> None:
            validate_name(name)
            await self._call(
                ["machine", "delete", "--name", name, "-f"], self.timeouts.delete, "machine delete"
            )

        return _coro(go())

    def exec(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
        workdir: str | None = None,
        detach: bool = False,
    ) -> Deferred[ExecResult]:
        """``machine exec``: the guest's exit code is returned, smolvm's failures raised.

        With ``detach`` (``-d``) smolvm starts the command, prints only its guest pid and
        returns: the result's stdout holds that pid and the command keeps running.

        smolvm exits with the guest's code, so a failure is recognised by its last stderr
        line: ``Error: `` plus a known smolvm phrase (or a clap usage error, exit 2).
        """

        async def go() -> ExecResult:
            args = exec_args(name, argv, env, workdir, interactive=stdin is not None, detach=detach)
            await self._gate()

            def check(result: ProcResult) -> None:
                # A guest's non-zero exit is a result ("ok"); only smolvm's own failure raises.
                if result.exit_code is None:
                    raise classify(result.stderr, result.exit_code, "machine exec", result.signal)
                if _exec_smolvm_failure(result, name):
                    raise _exec_error(result, name)

            result = await self._run(args, timeout or self.timeouts.exec, stdin=stdin, check=check)
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

        return _coro(go())

    def list(
        self, labels: Mapping[str, str] | None = None, include_ephemeral: bool = False
    ) -> Deferred[list[Machine]]:
        """``machine ls --json``, keeping machines that carry every ``labels`` pair."""

        async def go() -> list[Machine]:
            result = await self._call(["machine", "ls", "--json"], self.timeouts.query, "ls")
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

        return _coro(go())

    def status(self, name: str) -> Deferred[Machine]:
        """``machine status --json`` for one machine (NotFound when it does not exist)."""

        async def go() -> Machine:
            validate_name(name)
            result = await self._call(
                ["machine", "status", "--name", name, "--json"],
                self.timeouts.query,
                "machine status",
            )
            machine = Machine.from_json(_json(result, "machine status"))
            if machine is None or machine.name != name:
                raise SmolvmFailed(f"smolvm machine status --json gave no record for {name}")
            return machine

        return _coro(go())

    def data_dir(self, name: str) -> Deferred[str]:
        """``machine data-dir``: the machine's per-VM state directory on the host."""

        async def go() -> str:
            validate_name(name)
            result = await self._call(
                ["machine", "data-dir", "--name", name], self.timeouts.query, "machine data-dir"
            )
            path = result.stdout.decode("utf-8", "replace").strip()
            if not path or "\n" in path or not os.path.isabs(path):
                raise SmolvmFailed(f"smolvm machine data-dir printed {sanitize(path, 80)!r}")
            return path

        return _coro(go())


_EXEC_FAILURES = re.compile(
    r"^Error: (vm not found: |agent operation failed: |config operation failed: )"
)


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
    # smolvm prints its error last. A guest can still forge such a line; that only turns its
    # own result into an error (documented in docs/smolvm.md).
    return bool(_EXEC_FAILURES.match(error_text(result.stderr)))


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
    "MIN_VERSION",
    "ExecResult",
    "InvalidArgument",
    "Machine",
    "Smolvm",
    "SmolvmVersion",
    "Timeouts",
]
