"""Typed errors shared by every layer.

Each error carries a stable wire code (used by the AMP control plane and the CLI) and a
message that is safe to show to the caller: it never echoes raw client- or agent-controlled
bytes (use :func:`safe_repr` to mention a bad value) and never carries a secret.
"""

from __future__ import annotations

_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-:/[]@+=,")


class BottlenetError(Exception):
    """Base class: ``code`` is the stable machine-readable error code."""

    code = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ListenError(Exception):
    """A listener of the daemon's own cannot be set up; the message is one clear line.

    Not a wire error: it never reaches a control client, it ends the daemon at start.
    """


class InvalidArgument(BottlenetError):
    code = "INVALID_ARGUMENT"


class NotFound(BottlenetError):
    code = "NOT_FOUND"


class AlreadyExists(BottlenetError):
    code = "ALREADY_EXISTS"


class BindRefused(BottlenetError):
    """The operating system refused to bind a listener (address in use, not available...)."""

    code = "BIND_REFUSED"


class Busy(BottlenetError):
    """Another operation on the same object is in flight, or a capacity limit is reached."""

    code = "BUSY"


class ResourceExhausted(BottlenetError):
    code = "RESOURCE_EXHAUSTED"


class SmolvmUnavailable(BottlenetError):
    code = "SMOLVM_UNAVAILABLE"


class SmolvmFailed(BottlenetError):
    code = "SMOLVM_FAILED"


class KvmUnavailable(SmolvmFailed):
    """The host cannot boot VMs: /dev/kvm is missing or not usable by smolvm's VM process."""

    code = "KVM_UNAVAILABLE"


class BridgeFailed(SmolvmFailed):
    """bottlenet's in-guest bridge could not start, or does not reach the bottle's endpoints."""

    code = "BRIDGE_FAILED"


class EgressLayerFailed(SmolvmFailed):
    """bottlenet's transparent egress layer could not be installed or kept in the agent VM
    (a kernel without nf_tables among the reasons, named)."""

    code = "EGRESS_LAYER_FAILED"


class SidecarNotReady(SmolvmFailed):
    """A sidecar service never answered on its socket after the sidecar started (within the
    bound); the create was rolled back."""

    code = "SIDECAR_NOT_READY"


class IsolationUnavailable(BottlenetError):
    code = "ISOLATION_UNAVAILABLE"


class IsolationFailed(BottlenetError):
    code = "ISOLATION_FAILED"


class Degraded(BottlenetError):
    """The bottle is degraded (its sidecar died or a teardown failed): only destroy works."""

    code = "DEGRADED"


class Draining(BottlenetError):
    """The node is draining (``Drain``): it refuses new bottles; existing ones keep running."""

    code = "DRAINING"


class PermissionDenied(BottlenetError):
    """The peer may not do this (a scoped peer asked for a full-control command)."""

    code = "PERMISSION_DENIED"


class Unavailable(BottlenetError):
    """The daemon is shutting down or a dependency is not ready."""

    code = "UNAVAILABLE"


ALL_ERRORS: tuple[type[BottlenetError], ...] = (
    InvalidArgument,
    NotFound,
    AlreadyExists,
    BindRefused,
    Busy,
    ResourceExhausted,
    SmolvmUnavailable,
    SmolvmFailed,
    KvmUnavailable,
    BridgeFailed,
    EgressLayerFailed,
    SidecarNotReady,
    IsolationUnavailable,
    IsolationFailed,
    Unavailable,
    Degraded,
    Draining,
    PermissionDenied,
)


def listen_reason(exc: BaseException) -> str | None:
    """``EADDRINUSE (Address already in use)`` for a failed bind (an ``OSError`` or Twisted's
    ``CannotListenError``, which carries one), or None when there is no errno to name."""
    import errno
    import os

    os_error = getattr(exc, "socketError", exc)
    if isinstance(os_error, OSError) and os_error.errno is not None:
        name = errno.errorcode.get(os_error.errno, str(os_error.errno))
        return f"{name} ({os.strerror(os_error.errno)})"
    return None


def safe_repr(value: object, limit: int = 64) -> str:
    """Describe an untrusted value without echoing it raw.

    Short values made only of harmless characters are quoted as they are; anything else
    (control characters, newlines, non-ASCII, long values) becomes a length plus a sha256
    prefix, so logs and error messages can never be used for injection or exfiltration.
    """
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 10**18:
        return str(value)
    if isinstance(value, bytes):
        raw = value
        text = None
        try:
            text = value.decode("ascii")
        except UnicodeDecodeError:
            pass
    else:
        text = value if isinstance(value, str) else repr(value)
        raw = text.encode("utf-8", "surrogatepass")
    if text is not None and 0 < len(text) <= limit and all(c in _SAFE for c in text):
        return repr(text)
    import hashlib  # here, not at import: bottlenetctl's start needs no OpenSSL digests

    digest = hashlib.sha256(raw).hexdigest()[:12]
    return f"<{len(raw)} bytes sha256:{digest}>"
