"""vmctl's own typed errors, and the mapping from smolvm's stderr and exit codes to them.

vmctl knows nothing of bottles, so it does not import ``bottlenet.errors``; every class carries a
stable ``code`` string that the control plane maps onto its own wire codes. Messages keep the
useful smolvm line, sanitised (control characters replaced, length bounded), never raw bytes.
"""

from __future__ import annotations

import json
import os
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
        #: The ``--error-format json`` code smolvm gave, when it gave one.
        self.smolvm_code: str | None = None


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
    """/dev/kvm is missing or not usable by the VM process (smolvm only finds out at start)."""

    code = "KVM_UNAVAILABLE"


class DeviceBudget(SmolvmFailed):
    """libkrun ran out of virtio-mmio IRQ slots (``krun_start_enter returned: -22``)."""

    code = "DEVICE_BUDGET"


class NotRunning(SmolvmFailed):
    code = "NOT_RUNNING"


class AgentBusy(SmolvmFailed):
    """The guest agent refused the call at one of its admission limits (smolvm 1.37's agent
    admits execs and sessions explicitly); ``limit`` is that limit, in :data:`AGENT_LIMITS`'
    words (never text of the guest's). Retried later it may pass."""

    code = "AGENT_BUSY"

    def __init__(
        self, message: str, stderr_tail: str = "", exit_code: int | None = None, limit: str = ""
    ) -> None:
        super().__init__(message, stderr_tail, exit_code)
        self.limit = limit


#: The 1.37.3 agent's admission refusals (its strings) -> the limit each one names. How the
#: CLI reports them (code, exit) is not seen without a boot: they are matched in the text.
AGENT_LIMITS = {
    "exec was not admitted": "the agent's exec admission limit",
    "container session limit reached": "the agent's container session limit",
    "too many controlled sessions": "the agent's controlled-session limit",
    "too many active app connections": "the agent's app-connection limit",
    "too many container process groups": "the agent's container process-group limit",
}


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
#: What smolvm says when the VM process cannot use KVM (1.9 texts, and 1.32.2 as root, where
#: the VM process drops to its own uid and cannot open the 0600 /dev/kvm).
_KVM = re.compile(
    r"kvm not available|kvm permission denied|/dev/kvm|kvmopen|kvmcontext|kvm inaccessible",
    re.IGNORECASE,
)
_JSON_CODE = re.compile(r"[A-Z][A-Z0-9_]{0,39}\Z")
#: Wheel builds of smolvm print this on every call when the file is not named ``smolvm``.
_WHEEL_NOTE = re.compile(rb"^note: no packed assets found for [^\n]*\n?", re.MULTILINE)


def strip_notes(stderr: bytes) -> bytes:
    """Drop smolvm's informational lines that are not part of any error (the wheel note)."""
    return _WHEEL_NOTE.sub(b"", stderr)


def json_error(stderr: bytes) -> tuple[str, str] | None:
    """smolvm's ``--error-format json`` failure, ``(code, message)``, or None.

    The object is the last ``{"error": ...}`` line on stderr (log lines may come before it).
    """
    for line in reversed(stderr.decode("utf-8", "replace").splitlines()):
        line = line.strip()
        if not line.startswith('{"error"'):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        inner = obj.get("error") if isinstance(obj, dict) else None
        if not isinstance(inner, dict):
            return None
        code, message = inner.get("code"), inner.get("message")
        if not isinstance(code, str) or not _JSON_CODE.match(code):
            return None
        return code, message if isinstance(message, str) else ""
    return None


def error_text(stderr: bytes) -> str:
    """Return smolvm's error text: the ``--error-format json`` message, else the
    ``Error: ...`` line and any following lines, else ''.

    stderr may also hold WARN log lines and progress bars before the error; only the error
    itself (which may span lines, as the KVM hints do) is kept.
    """
    found = json_error(stderr)
    if found is not None:
        return "Error: " + found[1]
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


def kvm_message(what: str, err: str, euid: int | None = None) -> str:
    """Plain words for a KVM failure: no rootfs, usage or libkrun noise, and advice that fits
    the uid smolvm's VM process had (``euid``: the daemon's, by default this process's).

    As root smolvm drops each VM process to a uid of its own with no supplementary groups,
    so only /dev/kvm's mode for others helps; as any other user the VM process is that
    user, and smolvm's own advice (the kvm group) is kept.
    """
    euid = os.geteuid() if euid is None else euid
    lowered = err.lower()
    if "permission denied" in lowered or "error(13)" in lowered:
        if euid == 0:
            why = (
                "the VM process may not open /dev/kvm (permission denied): the daemon runs as "
                "root, so smolvm runs each VM under a uid of its own with no supplementary "
                "groups, and only a /dev/kvm every user may read and write (crw-rw-rw-, as "
                "many distributions ship it) lets those uids in"
            )
        else:
            why = (
                f"the VM process runs as the daemon's user (uid {euid}), which may not open "
                "/dev/kvm (permission denied): give that user /dev/kvm, usually through the "
                "group that owns it (under systemd: SupplementaryGroups= in the unit)"
            )
            advice = _advice(err)
            if advice:
                why += f"; smolvm says: {advice}"
    elif "not available" in lowered or "no such file" in lowered or "error(2)" in lowered:
        why = "/dev/kvm is missing (load kvm_intel or kvm_amd; needs hardware virtualization)"
    else:
        why = "the VM process cannot use /dev/kvm"
    return (
        f"smolvm {what}: KVM is not usable on this host: {why}. VM bottles need a Linux host "
        "with working KVM that smolvm's VM process can open"
    )


def _advice(err: str) -> str:
    """smolvm's own advice: the lines after its error line (1.32.2 prints ``Add your user to
    the 'kvm' group:``, the ``usermod`` command and ``Then log out ...``), as one line."""
    lines = [line.strip() for line in err.splitlines()[1:]]
    return sanitize(" ".join(line for line in lines if line), 200)


def classify(
    stderr: bytes, exit_code: int | None, what: str, signal: int | None = None
) -> SmolvmFailed:
    """Map a failed smolvm call (non-zero exit) to the closest typed error.

    ``what`` names the call for the message (``"machine start"``). A ``--error-format json``
    code decides where it is specific; otherwise (and for a smolvm without json errors) the
    message is matched, from the most to the least specific check, since one smolvm chain can
    mention several things (a foreign port clash ends with "boot process exited ... before
    the agent was ready"; a KVM failure as root also says "krun_start_enter returned: -22").
    """
    stderr = strip_notes(stderr)
    tail = stderr_tail(stderr)
    found = json_error(stderr)
    err = error_text(stderr)
    if exit_code == 2 and found is None and not err:
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
    code = found[0] if found is not None else None
    line = sanitize(err)
    msg = f"smolvm {what}: {line}"
    error = _classify(err, code, msg, tail, exit_code, what)
    error.smolvm_code = code
    return error


def _classify(
    err: str, code: str | None, msg: str, tail: str, exit_code: int | None, what: str
) -> SmolvmFailed:
    if code in ("KVM_UNAVAILABLE", "HYPERVISOR_UNAVAILABLE") or _KVM.search(err):
        return KvmUnavailable(kvm_message(what, err), tail, exit_code)
    if code == "NOT_FOUND":
        return NotFound(msg, tail, exit_code)
    m = _PORT_BY_MACHINE.search(err)
    if m:
        return PortInUse(msg, tail, exit_code, port=int(m.group(1)), holder=m.group(2))
    if _FOREIGN_PORT.search(err):
        return PortInUse(msg, tail, exit_code)
    if "krun_start_enter returned: -22" in err or "krun_start_enter returned -22" in err:
        return DeviceBudget(msg, tail, exit_code)
    if code == "CONFLICT" or "already exists or is being created" in err:
        return AlreadyExists(msg, tail, exit_code)
    if "vm not found:" in err or re.search(r"machine '[^']*' not found", err):
        return NotFound(msg, tail, exit_code)
    if "is not running" in err:
        return NotRunning(msg, tail, exit_code)
    for phrase, limit in AGENT_LIMITS.items():
        if phrase in err:
            return AgentBusy(msg, tail, exit_code, limit=limit)
    if "did not become ready" in err:
        return ReadinessTimeout(msg, tail, exit_code)
    return SmolvmFailed(msg, tail, exit_code)
