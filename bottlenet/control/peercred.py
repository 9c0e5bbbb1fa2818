"""Who is on the other end of a UNIX control connection.

Twisted has no peer-credential API (``getPeer()`` on an accepted UNIX connection is
``UNIXAddress(None)``), so we ask the kernel directly. This is the one place that does it;
the server takes the function as a parameter so tests can fake it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import sys
from collections.abc import Callable, Iterable

from attrs import frozen


@frozen
class PeerCred:
    """Kernel-reported identity of a UNIX socket peer (pid/gid may be unknown)."""

    uid: int
    pid: int | None
    gid: int | None = None
    #: Its supplementary groups at connect (``SO_PEERGROUPS``; empty where unknown).
    groups: tuple[int, ...] = ()


PeerCredentials = Callable[[socket.socket], PeerCred]

# macOS <sys/un.h>: SOL_LOCAL = 0, LOCAL_PEERCRED = 1, LOCAL_PEERPID = 2.
_SOL_LOCAL = 0
_LOCAL_PEERCRED = 0x001
_LOCAL_PEERPID = 0x002


def get_peer_credentials(sock: socket.socket) -> PeerCred:
    """Read the peer's credentials; raise OSError when the platform cannot tell."""
    if sock.family != socket.AF_UNIX:
        raise OSError("peer credentials need an AF_UNIX socket")
    so_peercred = getattr(socket, "SO_PEERCRED", None)
    if so_peercred is not None:
        size = struct.calcsize("3i")
        pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, so_peercred, size))
        return PeerCred(uid=uid, pid=pid or None, gid=gid, groups=_peer_groups(sock))
    if sys.platform == "darwin":  # pragma: no cover - exercised on macOS only
        # struct xucred { u_int cr_version; uid_t cr_uid; short cr_ngroups; gid_t groups[16]; }
        raw = sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERCRED, struct.calcsize("IIh16I"))
        _version, uid, ngroups = struct.unpack_from("IIh", raw)
        groups = struct.unpack_from("16I", raw, struct.calcsize("IIh"))
        raw_pid = sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERPID, struct.calcsize("i"))
        (pid,) = struct.unpack("i", raw_pid)
        return PeerCred(uid=uid, pid=pid or None, gid=groups[0] if ngroups > 0 else None)
    raise OSError(f"no peer-credential support on {sys.platform}")


#: Linux ``SO_PEERGROUPS`` (not in Python's socket module before 3.13).
_SO_PEERGROUPS = 59
#: Groups read at first (Python's own ``getsockopt`` reads at most 1024 bytes).
_FEW_GROUPS = 64


def _peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """The peer's supplementary groups as the kernel recorded them at connect (Linux); empty
    where it cannot tell (then only the peer's uid and primary gid count). A peer with more
    than :data:`_FEW_GROUPS` is read again at the size the kernel asks for (ERANGE), up to
    ``NGROUPS_MAX``, through libc (Python's ``getsockopt`` stops at 1024 bytes)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, _FEW_GROUPS * 4)
    except OSError as e:
        if e.errno != errno.ERANGE:
            return ()
        raw = _peer_groups_raw(sock.fileno())
    return struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])


def _peer_groups_raw(fd: int) -> bytes:
    libc = ctypes.CDLL(None, use_errno=True)
    size = ctypes.c_uint(0)
    libc.getsockopt(fd, socket.SOL_SOCKET, _SO_PEERGROUPS, None, ctypes.byref(size))
    buf = ctypes.create_string_buffer(max(size.value, 4))
    if libc.getsockopt(fd, socket.SOL_SOCKET, _SO_PEERGROUPS, buf, ctypes.byref(size)) != 0:
        return b""
    return buf.raw[: size.value]


def default_allowed_uids(extra: Iterable[int] = ()) -> frozenset[int]:
    """The daemon's own uid plus ``--allow-uid`` values (root is not implied)."""
    return frozenset({os.geteuid(), *extra})
