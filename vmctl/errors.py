"""vmctl's own typed errors, and the mapping from smolvm's stderr and exit codes to them.

vmctl knows nothing of bottles, so it does not import ``bottlenet.errors``; every class carries a
stable ``code`` string that the control plane maps onto its own wire codes. Messages keep the
useful smolvm line, sanitised (control characters replaced, length bounded), never raw bytes.
"""

from __future__ import annotations

import re

#: Longest message text kept from smolvm's stderr.
MESSAGE_LIMIT = 300
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def sanitize(text: str | bytes, limit: int = MESSAGE_LIMIT) -> str:
    """Make smolvm (or guest) text safe to put in a log line or an error message.

    Bytes are decoded with replacement, control characters become ``?``, line breaks become
    `` | `` and the result is cut to ``limit`` characters with a trailing ``...``.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", " ").strip("\n")
    text = " | ".join(line.rstrip() for line in text.split("\n") if line.strip())
    text = _CONTROL.sub("?", text)
    if len(text) > limit:
        text = text[: max(0, limit - 3)] + "..."
    return text


class VmctlError(Exception):
    """Base class: ``code`` is the stable machine-readable error code."""

    code = "SMOLVM_FAILED"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidArgument(VmctlError):
    """A value was refused before smolvm was called (nothing was spawned)."""

    code = "INVALID_ARGUMENT"


class DeviceBudgetExceeded(InvalidArgument):
    """The machine would need more virtio-mmio devices than the configured budget."""

    code = "DEVICE_BUDGET"


class SmolvmUnavailable(VmctlError):
    """No smolvm binary is configured or it could not be spawned."""

    code = "SMOLVM_UNAVAILABLE"


class UnsupportedVersion(VmctlError):
    """The installed smolvm is older than the oldest version vmctl supports."""

    code = "UNSUPPORTED_VERSION"


class Unavailable(VmctlError):
    """The runner is shutting down and accepts no new calls."""

    code = "UNAVAILABLE"


class CallTimeout(VmctlError):
    """A smolvm call did not finish within its timeout; the child was killed.

    ``partial`` holds the runner's result (output so far, the killing signal) when known.
    """

    code = "TIMEOUT"

    def __init__(self, message: str, partial: object | None = None) -> None:
        super().__init__(message)
        self.partial = partial


class SmolvmFailed(VmctlError):
    """smolvm failed for a reason vmctl has no closer class for.

    ``stderr_tail`` keeps the sanitised end of smolvm's stderr for diagnosis.
    """

    code = "SMOLVM_FAILED"

    def __init__(self, message: str, stderr_tail: str = "", exit_code: int | None = None) -> None:
        super().__init__(message)
        self.stderr_tail = stderr_tail
        self.exit_code = exit_code


class UsageError(SmolvmFailed):
    """smolvm refused the argv (clap usage error, exit 2): a vmctl bug or a version skew."""

    code = "USAGE_ERROR"


class NotFound(SmolvmFailed):
    code = "NOT_FOUND"


class AlreadyExists(SmolvmFailed):
    code = "ALREADY_EXISTS"


class PortInUse(SmolvmFailed):
    """A published host port is taken: by another smolvm machine or by a foreign process."""

    code = "PORT_IN_USE"

    def __init__(
        self,
        message: str,
        stderr_tail: str = "",
        exit_code: int | None = None,
        port: int | None = None,
        holder: str | None = None,
    ) -> None:
        super().__init__(message, stderr_tail, exit_code)
        self.port = port
        #: The smolvm machine that holds the port, or None for a foreign process.
        self.holder = holder


class KvmUnavailable(SmolvmFailed):
    """/dev/kvm is missing or not accessible (smolvm only checks at start)."""

    code = "KVM_UNAVAILABLE"


class DeviceBudget(SmolvmFailed):
    """libkrun ran out of virtio-mmio IRQ slots (``krun_start_enter returned: -22``)."""

    code = "DEVICE_BUDGET"


class NotRunning(SmolvmFailed):
    code = "NOT_RUNNING"


class ReadinessTimeout(SmolvmFailed):
    """The VM booted but its agent did not become ready in time."""

    code = "READINESS_TIMEOUT"


class PortNotOwned(VmctlError):
    """A raw port is not (or not verifiably) held by the machine's VM process."""

    code = "PORT_NOT_OWNED"


ALL_ERRORS: tuple[type[VmctlError], ...] = (
    InvalidArgument,
    DeviceBudgetExceeded,
    SmolvmUnavailable,
    UnsupportedVersion,
    Unavailable,
    CallTimeout,
    SmolvmFailed,
    UsageError,
    NotFound,
    AlreadyExists,
    PortInUse,
    KvmUnavailable,
    DeviceBudget,
    NotRunning,
    ReadinessTimeout,
    PortNotOwned,
)

_PORT_BY_MACHINE = re.compile(r"host port (\d+) is already in use by running machine '([^']*)'")
_FOREIGN_PORT = re.compile(r"Address already in use|EADDRINUSE|os error 98")


def error_text(stderr: bytes) -> str:
    """Return smolvm's ``Error: ...`` text (that line and any following lines), or ''.

    stderr may also hold WARN log lines and progress bars before the error; only the error
    itself (which may span lines, as the KVM hints do) is kept.
    """
    text = stderr.decode("utf-8", "replace")
    lines = text.replace("\r", "\n").split("\n")
    for i, line in enumerate(lines):
        if line.startswith("Error: "):
            return "\n".join(lines[i:]).strip()
    return ""


def stderr_tail(stderr: bytes, limit: int = MESSAGE_LIMIT) -> str:
    """The sanitised end of stderr (the most useful part of a failure)."""
    tail = stderr[-4 * limit :]
    return sanitize(tail, 10 * limit)[-limit:]


def classify(
    stderr: bytes, exit_code: int | None, what: str, signal: int | None = None
) -> SmolvmFailed:
    """Map a failed smolvm call (non-zero exit) to the closest typed error.

    ``what`` names the call for the message (``"machine start"``). The checks are ordered from
    the most to the least specific, since one smolvm chain can mention several things (a
    foreign port clash ends with "boot process exited ... before the agent was ready").
    """
    tail = stderr_tail(stderr)
    err = error_text(stderr)
    if exit_code == 2 and not err:
        first = next(
            (
                ln
                for ln in stderr.decode("utf-8", "replace").splitlines()
                if ln.startswith("error:")
            ),
            tail,
        )
        return UsageError(f"smolvm {what}: usage error: {sanitize(first)}", tail, exit_code)
    if signal is not None:
        return SmolvmFailed(f"smolvm {what} was killed by signal {signal}", tail, exit_code)
    if not err:
        return SmolvmFailed(
            f"smolvm {what} failed (exit {exit_code}): {tail or 'no error message'}",
            tail,
            exit_code,
        )
    line = sanitize(err)
    msg = f"smolvm {what}: {line}"
    lowered = err.lower()
    m = _PORT_BY_MACHINE.search(err)
    if m:
        return PortInUse(msg, tail, exit_code, port=int(m.group(1)), holder=m.group(2))
    if _FOREIGN_PORT.search(err):
        return PortInUse(msg, tail, exit_code)
    if "kvm not available" in lowered or "kvm permission denied" in lowered or "/dev/kvm" in err:
        return KvmUnavailable(msg, tail, exit_code)
    if "krun_start_enter returned: -22" in err or "krun_start_enter returned -22" in err:
        return DeviceBudget(msg, tail, exit_code)
    if "already exists or is being created" in err:
        return AlreadyExists(msg, tail, exit_code)
    if "vm not found:" in err or re.search(r"machine '[^']*' not found", err):
        return NotFound(msg, tail, exit_code)
    if "is not running" in err:
        return NotRunning(msg, tail, exit_code)
    if "did not become ready" in err:
        return ReadinessTimeout(msg, tail, exit_code)
    return SmolvmFailed(msg, tail, exit_code)
