"""What a control client raises when a call fails: a connection that could not be made or
broke, or an error code it has no class for. No Twisted, no attrs: ``bottlenetctl`` imports
this for every command, ``--help`` included."""

from __future__ import annotations

from collections.abc import Mapping

from bottlenet.errors import BottlenetError


class ControlConnectionError(Exception):
    """The daemon could not be reached, or the connection broke mid-call."""


class DaemonUnreachable(ControlConnectionError):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot reach the bottlenet daemon at {path}: {reason}")
        self.path = path
        self.reason = reason


class ClosedBeforeAnswer(ControlConnectionError):
    """The daemon took the connection and ended it before answering anything on it.

    That is how it refuses a peer: a uid it was not told to accept (``--allow-uid``), or a
    listener at its ``--control-max-connections`` cap. The client cannot tell which (the
    daemon says nothing to a peer it refuses); its hint names both, the uid first.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(
            f"the bottlenet daemon at {path} closed the connection before answering ({reason})"
        )
        self.path = path
        self.reason = reason


def broken(path: str, answered: bool, detail: str | None) -> ControlConnectionError:
    """The error for a connection that ended (``detail`` None) or failed (``detail`` the OS's
    reason): a refusal when the daemon never answered on it, else a break mid-session."""
    if not answered:
        return ClosedBeforeAnswer(path, detail or "closed")
    if detail is None:
        return ControlConnectionError("the daemon closed the connection")
    return ControlConnectionError(f"connection failed: {detail}")


class RemoteError(BottlenetError):
    """An error code this client has no class for (a newer daemon, ``INTERNAL``, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def error_for(code: str, message: str, known: Mapping[str, type[BottlenetError]]) -> BottlenetError:
    """The typed exception for an error code (RemoteError when ``known`` has none)."""
    cls = known.get(code)
    return RemoteError(code or "UNKNOWN", message) if cls is None else cls(message)
