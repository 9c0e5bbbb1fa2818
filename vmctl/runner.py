"""Run short-lived child processes (the smolvm CLI) safely.

One job: spawn an argv (never a shell) from an absolute path with an explicit environment,
close or feed stdin, keep bounded output, enforce a timeout with TERM then KILL, and report an
attrs value. Nothing here knows what smolvm or a bottle is.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from attrs import field, frozen
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.error import ProcessDone, ProcessExitedAlready, ProcessTerminated
from twisted.internet.interfaces import (
    IDelayedCall,
    IProcessTransport,
    IReactorProcess,
    IReactorTime,
)
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmctl.errors import CallTimeout, SmolvmUnavailable, Unavailable
from vmctl.install import ROOTFS_DIR_VAR, ROOTFS_TAR_VAR, discover, is_executable
from vmctl.install import untrusted_reason as untrusted_reason

#: Environment variables passed on to smolvm when present in the source environment.
ENV_ALLOW = ("PATH", "HOME", "LANG", "TMPDIR", "XDG_RUNTIME_DIR")
_LC = re.compile(r"LC_[A-Z_]+\Z")
#: Never passed on, whatever the source environment says (design invariant 8).
ENV_DENY = ("SMOLVM_PUBLISH_ADDR", "SMOLVM_EGRESS_FLOOR", "SMOLVM_EGRESS_ALLOW_PRIVATE")
#: Set by vmctl from what it found next to the binary (never copied from the daemon's env).
ENV_ASSETS = ("SMOLVM_LIB_DIR", ROOTFS_DIR_VAR, ROOTFS_TAR_VAR)

DEFAULT_MAX_OUTPUT = 1024 * 1024
DEFAULT_GRACE = 3.0


def build_env(
    source: Mapping[str, str],
    data_dir: str | None = None,
    assets: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The whole environment for a smolvm child, built from an allow-list.

    Only PATH (its absolute entries), HOME, LANG, LC_*, TMPDIR and XDG_RUNTIME_DIR are copied
    from ``source``;
    ``SMOLVM_DATA_DIR`` is set only when ``data_dir`` is given (a smolvm without
    ``--state-dir``), and ``assets`` (``SMOLVM_LIB_DIR``, and ``SMOLVM_AGENT_ROOTFS`` or
    ``SMOLVM_AGENT_ROOTFS_TAR`` found by :mod:`vmctl.install`) are set by vmctl itself.
    Anything else (notably ``SMOLVM_PUBLISH_ADDR``, which would widen published ports off
    loopback, ``SMOLVM_MACHINE_NAME``, or a rootfs variable of the daemon's own environment)
    never reaches the child.
    """
    env = {k: v for k, v in source.items() if (k in ENV_ALLOW or _LC.match(k)) and "\0" not in v}
    if "PATH" in env:
        # Relative entries (".", "", "bin") would make smolvm's own lookups (its helpers,
        # libkrun) depend on the daemon's cwd: only absolute directories pass.
        env["PATH"] = os.pathsep.join(
            e for e in env["PATH"].split(os.pathsep) if e and os.path.isabs(e)
        )
    if data_dir is not None:
        env["SMOLVM_DATA_DIR"] = data_dir
    for k, v in (assets or {}).items():
        if k in ENV_ASSETS and "\0" not in v:
            env[k] = v
    for k in ENV_DENY:
        env.pop(k, None)
    return env


def resolve_smolvm(path_or_none: str | None, env_path: str | None) -> str | None:
    """The binary :func:`vmctl.install.discover` would pick from the option and PATH alone
    (no wheel): an absolute path, or None when nothing executable is found."""
    install = discover(path_or_none, env_path, wheel=lambda: None)
    return install.binary if install is not None else None


class BoundedBuffer:
    """Keep the first and last ``limit // 2`` bytes of a stream and count what was dropped."""

    def __init__(self, limit: int) -> None:
        self._half = max(1, limit // 2)
        self._head = bytearray()
        self._tail = bytearray()
        self.dropped = 0

    def write(self, data: bytes) -> None:
        room = self._half - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if not data:
            return
        self._tail += data
        excess = len(self._tail) - self._half
        if excess > 0:
            del self._tail[:excess]
            self.dropped += excess

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def value(self) -> bytes:
        if not self.dropped:
            return bytes(self._head + self._tail)
        marker = b"\n[... %d bytes dropped ...]\n" % self.dropped
        return bytes(self._head) + marker + bytes(self._tail)


@frozen
class ProcResult:
    """What one child process did. Exactly one of ``exit_code`` and ``signal`` is set."""

    argv: tuple[str, ...]
    exit_code: int | None
    signal: int | None
    stdout: bytes = field(repr=lambda b: f"<{len(b)} bytes>")
    stderr: bytes = field(repr=lambda b: f"<{len(b)} bytes>")
    duration: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class _Call(ProcessProtocol):
    """One child process: collects output, escalates TERM to KILL, fires ``done``."""

    log = Logger()

    def __init__(
        self,
        argv: tuple[str, ...],
        clock: IReactorTime,
        stdin: bytes | None,
        max_output: int,
        grace: float,
    ) -> None:
        self.argv = argv
        self.clock = clock
        self.stdin = stdin
        self.out = BoundedBuffer(max_output)
        self.err = BoundedBuffer(max_output)
        self.grace = grace
        self.started = clock.seconds()
        self.exited = False
        self.finished = False
        self.timed_out = False
        #: Why vmctl killed the child (timeout, shutdown), reported instead of its result.
        self.abort: Exception | None = None
        self.process: IProcessTransport | None = None
        self._timeout_call: IDelayedCall | None = None
        self._kill_call: IDelayedCall | None = None
        self.result: Deferred[ProcResult] = Deferred(self._cancel)
        #: Fires (with None) when the child is gone, whatever happened to ``result``.
        self.ended: Deferred[None] = Deferred()

    def arm_timeout(self, timeout: float) -> None:
        self._timeout_call = self.clock.callLater(timeout, self._on_timeout)

    def connectionMade(self) -> None:
        assert self.transport is not None
        if self.stdin:
            self.transport.write(self.stdin)
        self.transport.closeStdin()

    def outReceived(self, data: bytes) -> None:
        self.out.write(data)

    def errReceived(self, data: bytes) -> None:
        self.err.write(data)

    def processExited(self, reason: Failure) -> None:
        self.exited = True

    def _on_timeout(self) -> None:
        self._timeout_call = None
        self.timed_out = True
        self.log.warn("{cmd} timed out; terminating", cmd=_describe(self.argv))
        self.terminate(CallTimeout(f"{_describe(self.argv)} timed out and was killed"))

    def _cancel(self, d: Deferred[ProcResult]) -> None:
        self.terminate()

    def terminate(self, abort: Exception | None = None) -> None:
        """TERM now, KILL after the grace period (idempotent)."""
        if self.abort is None:
            self.abort = abort
        if self.finished or self._kill_call is not None:
            return
        self._signal("TERM")
        self._kill_call = self.clock.callLater(self.grace, self._kill)

    def _kill(self) -> None:
        self._kill_call = None
        self._signal("KILL")

    def _signal(self, sig: str) -> None:
        process = self.process
        if process is None:
            return
        if not self.exited:
            try:
                process.signalProcess(sig)
                return
            except ProcessExitedAlready:
                pass
        # Reaped, but something (a grandchild) still holds our pipes: stop waiting for them.
        process.loseConnection()

    def processEnded(self, reason: Failure) -> None:
        self.finished = True
        for name in ("_timeout_call", "_kill_call"):
            call = getattr(self, name)
            if call is not None and call.active():
                call.cancel()
            setattr(self, name, None)
        code: int | None
        sig: int | None
        value = reason.value
        if isinstance(value, ProcessDone):
            code, sig = 0, None
        elif isinstance(value, ProcessTerminated):
            code, sig = value.exitCode, value.signal
        else:  # pragma: no cover - Twisted only reports these two
            code, sig = None, None
        result = ProcResult(
            argv=self.argv,
            exit_code=code,
            signal=sig,
            stdout=self.out.value(),
            stderr=self.err.value(),
            duration=max(0.0, self.clock.seconds() - self.started),
            stdout_truncated=self.out.truncated,
            stderr_truncated=self.err.truncated,
            timed_out=self.timed_out,
        )
        self.log.debug(
            "{cmd} ended: exit={code} signal={sig} out={nout}B err={nerr}B",
            cmd=_describe(self.argv),
            code=code,
            sig=sig,
            nout=len(result.stdout),
            nerr=len(result.stderr),
        )
        self.ended.callback(None)  # first, so the call is no longer "in flight" for waiters
        if not self.result.called:
            if self.abort is not None:
                if isinstance(self.abort, CallTimeout):
                    self.abort.partial = result
                self.result.errback(Failure(self.abort))
            else:
                self.result.callback(result)


def _describe(argv: Sequence[str]) -> str:
    """A short, log-safe name for a call: the program's base name and its subcommand words."""
    words = [os.path.basename(argv[0])] if argv else []
    for a in argv[1:3]:
        if a.startswith("-"):
            break
        words.append(a)
    return " ".join(w for w in words if w.replace("-", "").replace("_", "").isalnum())


class ProcessRunner:
    """Spawns children, tracks the ones in flight, and drains them on shutdown.

    ``reactor`` must provide IReactorProcess; ``clock`` defaults to the same object as
    IReactorTime (tests pass a fake reactor that is also a ``Clock``).
    """

    log = Logger()

    def __init__(
        self,
        reactor: IReactorProcess,
        clock: IReactorTime | None = None,
        *,
        grace: float = DEFAULT_GRACE,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> None:
        self.reactor = reactor
        self.clock = clock if clock is not None else IReactorTime(reactor)
        self.grace = grace
        self.max_output = max_output
        self._inflight: set[_Call] = set()
        self._stopping = False

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        timeout: float,
        stdin: bytes | None = None,
        max_output: int | None = None,
    ) -> Deferred[ProcResult]:
        """Spawn ``argv`` and fire with its ProcResult (any exit code is a result).

        Errbacks with CallTimeout (the child was killed), CancelledError (``cancel()``:
        the child gets TERM then KILL), SmolvmUnavailable (spawn failed) or Unavailable
        (the runner is stopping). ``argv[0]`` must be an absolute path.
        """
        argv_t = tuple(argv)
        if self._stopping:
            return _fail(Unavailable("vmctl is shutting down; no new smolvm calls"))
        if not argv_t or not os.path.isabs(argv_t[0]):
            raise ValueError("argv[0] must be an absolute path")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if not is_executable(argv_t[0]):
            return _fail(SmolvmUnavailable(f"cannot run {argv_t[0]}: not an executable file"))
        call = _Call(
            argv_t,
            self.clock,
            stdin,
            max_output if max_output is not None else self.max_output,
            self.grace,
        )
        try:
            process = self.reactor.spawnProcess(
                call, argv_t[0], argv_t, env=dict(env), path=None, usePTY=False
            )
        except OSError as e:
            return _fail(SmolvmUnavailable(f"cannot run {argv_t[0]}: {e.strerror or e}"))
        call.process = process
        call.arm_timeout(timeout)
        self._inflight.add(call)
        call.ended.addBoth(lambda _: self._inflight.discard(call))
        self.log.debug("spawned {cmd} pid={pid}", cmd=_describe(argv_t), pid=process.pid)
        return call.result

    def shutdown(self, deadline: float) -> Deferred[None]:
        """Refuse new calls, wait for those in flight, and kill any still running at ``deadline``.

        Fires once every child is gone.
        """
        self._stopping = True
        calls = list(self._inflight)
        if not calls:
            return succeed(None)
        self.log.info("waiting for {n} smolvm call(s) in flight", n=len(calls))
        killer = self.clock.callLater(deadline, self._kill_all)
        d: Deferred[None] = DeferredList([c.ended for c in calls], consumeErrors=True).addCallback(
            lambda _: None
        )

        def cleanup(r: None) -> None:
            if killer.active():
                killer.cancel()
            return r

        return d.addCallback(cleanup)

    def _kill_all(self) -> None:
        self.log.warn(
            "killing {n} smolvm call(s) past the shutdown deadline", n=len(self._inflight)
        )
        for call in list(self._inflight):
            call.terminate(Unavailable("vmctl is shutting down; the smolvm call was killed"))


def _fail(exc: Exception) -> Deferred[ProcResult]:
    d: Deferred[ProcResult] = Deferred()
    d.errback(Failure(exc))
    return d


__all__ = [
    "ENV_ALLOW",
    "ENV_ASSETS",
    "ENV_DENY",
    "BoundedBuffer",
    "ProcResult",
    "ProcessRunner",
    "build_env",
    "resolve_smolvm",
]
