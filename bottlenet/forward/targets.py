"""Where a forward may point: never back into the daemon, never out of its own target dir.

A forward's target is fixed at creation, but a target that is one of the daemon's own sockets
turns the forward into a door: through a forward to the control socket any uid that reaches
the endpoint speaks to the control plane *as the daemon* (the peer-uid check sees the
daemon's own uid). A target that is one of its own listeners makes a loop (one connection
becomes a relay per connection slot). So:

- a UNIX target lives in the bottle's own target directory, ``<state-dir>/targets/<bottle>/``
  (checked lexically when the forward is added and again when it is restored); the one
  exception is a sidecar service's exposed socket, ``<state-dir>/bottles/<bottle>/sidecar/*``
  (``sidecar-*`` for older bottles), which the daemon itself places
  (``forward.spec.target_root``) and no control client can name;
- right before each connect the path is checked again on disk: a socket, not a symlink, whose
  real path is still inside that directory, and not (same device and inode) one of the
  daemon's own sockets (control, metrics, any agent endpoint); a sidecar's exposed socket must
  moreover still be the very socket file its VM was seen to hold (device, inode and owner:
  ``HeldSocket``), so a process of another uid, or a leftover of a deleted bottle's, that
  replaced it in the directory is never connected to;
- a TCP target is never inside the alias pool (every agent endpoint lives there) nor one of
  the daemon's own TCP listeners (TLS control, metrics).
"""

from __future__ import annotations

import ipaddress
import os
import stat
from collections.abc import Callable, Iterable
from typing import Any

from twisted.internet import defer
from twisted.internet.error import ConnectError
from twisted.internet.interfaces import IProtocol, IProtocolFactory, IStreamClientEndpoint
from zope.interface import implementer

from bottlenet.errors import InvalidArgument, safe_repr
from bottlenet.forward.spec import HeldSocket, TCPTarget, UNIXTarget


class TargetRefused(ConnectError):
    """The target failed the on-disk re-check; the relay ends as connect-failed."""


class OwnSockets:
    """The daemon's own listening sockets, which no forward may target.

    ``unix`` paths are registered by the daemon's composition (control socket, metrics
    socket); ``extra_unix`` is asked each time for the live agent endpoints' paths.
    """

    def __init__(self) -> None:
        self.unix: set[str] = set()
        self.tcp: set[tuple[str, int]] = set()
        self.extra_unix: Callable[[], Iterable[str]] = lambda: ()

    def add_unix(self, path: str) -> None:
        self.unix.add(os.path.abspath(path))

    def add_tcp(self, host: str, port: int) -> None:
        self.tcp.add((host, port))

    def unix_paths(self) -> list[str]:
        return [*self.unix, *self.extra_unix()]

    def inodes(self) -> set[tuple[int, int]]:
        out = set()
        for path in self.unix_paths():
            try:
                st = os.stat(path)
            except OSError:
                continue
            out.add((st.st_dev, st.st_ino))
        return out

    def is_own_tcp(self, host: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> bool:
        for own_host, own_port in self.tcp:
            if own_port != port:
                continue
            if own_host in (str(host), "0.0.0.0", "::", ""):
                return True
        return False


def check_target(
    target: TCPTarget | UNIXTarget,
    root: str,
    pool: Any,
    own: OwnSockets,
) -> None:
    """Add-time rules (raise InvalidArgument); ``root`` is the bottle's own target dir."""
    if isinstance(target, TCPTarget):
        if target.host in pool:
            raise InvalidArgument(
                f"target {target.describe()} is inside the alias pool: a forward may not "
                "point at an agent endpoint (it would loop)"
            )
        if own.is_own_tcp(target.host, target.port):
            raise InvalidArgument(f"target {target.describe()} is one of the daemon's own sockets")
        return
    path = target.path
    if not path.startswith(root.rstrip("/") + "/"):
        raise InvalidArgument(
            f"target path {safe_repr(path)} is not in the bottle's target directory {root}"
        )
    for mine in own.unix_paths():
        if os.path.abspath(mine) == path:
            raise InvalidArgument(f"target {safe_repr(path)} is one of the daemon's own sockets")
    problem = unix_target_problem(path, root, own)
    if problem is not None and problem != "does not exist":
        raise InvalidArgument(f"target {safe_repr(path)} {problem}")


def unix_target_problem(
    path: str, root: str, own: OwnSockets, held: HeldSocket | None = None
) -> str | None:
    """Why ``path`` may not be connected to now, or None (the connect-time re-check)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "does not exist"
    except OSError:
        return "cannot be inspected"
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISSOCK(st.st_mode):
        return "is not a socket"
    if held is not None and HeldSocket(st.st_dev, st.st_ino, st.st_uid) != held:
        return "is no longer the socket its sidecar holds"
    real_root = os.path.realpath(root)
    if not os.path.realpath(path).startswith(real_root.rstrip("/") + "/"):
        return "resolves outside the bottle's target directory"
    if (st.st_dev, st.st_ino) in own.inodes():
        return "is one of the daemon's own sockets"
    return None


@implementer(IStreamClientEndpoint)
class CheckedUNIXTarget:
    """Wraps a UNIX target's client endpoint with the connect-time re-checks.

    The transport handed to the relay is the wrapped endpoint's own (splice still works).
    """

    def __init__(
        self,
        inner: IStreamClientEndpoint,
        path: str,
        root: str,
        own: OwnSockets,
        held: HeldSocket | None = None,
    ) -> None:
        self._inner = inner
        self._path = path
        self._root = root
        self._own = own
        self._held = held

    def connect(self, protocolFactory: IProtocolFactory) -> defer.Deferred[IProtocol]:
        problem = unix_target_problem(self._path, self._root, self._own, self._held)
        if problem is not None and problem != "does not exist":
            return defer.fail(TargetRefused(string=problem))
        d: defer.Deferred[IProtocol] = self._inner.connect(protocolFactory)
        return d


__all__ = ["CheckedUNIXTarget", "OwnSockets", "TargetRefused", "check_target"]
