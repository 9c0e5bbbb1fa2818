"""Forward value types and the validation that enforces the binding invariants.

Invariant 1: an agent endpoint binds only its own bottle's alias (a canonical IPv4 literal
from the pool) or a UNIX path inside its own bottle directory. Invariant 2: targets are fixed
loopback IP literals or UNIX paths in the bottle's own target dir, never resolved. Everything
that comes from a client or a config file passes through the parsers below before it becomes
a value.
"""

from __future__ import annotations

import ipaddress
import os
import re
import struct
from typing import TypeAlias

from attrs import field, frozen

from bottlenet.errors import InvalidArgument, safe_repr
from bottlenet.paths import MAX_SUN_PATH

#: A bottle name: 1-63 of ``a-z0-9-``, starting with a letter or digit.
BOTTLE_NAME_MAX = 63
BOTTLE_NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
LABEL_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
# A canonical dotted-quad: four decimal octets, no leading zeros, nothing else.
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"
_CANONICAL_V4 = re.compile(rf"{_OCTET}\.{_OCTET}\.{_OCTET}\.{_OCTET}")
_LOOPBACK_V4 = ipaddress.IPv4Network("127.0.0.0/8")
_HOST_LOOPBACK = ipaddress.IPv4Address("127.0.0.1")
DEFAULT_POOL = "127.77.0.0/16"


def check_bottle_name(name: object) -> str:
    """Return ``name`` if it is a valid bottle name, else raise InvalidArgument."""
    if not isinstance(name, str) or not BOTTLE_NAME_RE.fullmatch(name):
        raise InvalidArgument(
            f"bottle name {safe_repr(name)} is invalid: use [a-z0-9][a-z0-9-]{{0,62}}"
        )
    return name


def check_label(label: object) -> str:
    """Return ``label`` if it is a valid forward label, else raise InvalidArgument."""
    if not isinstance(label, str) or not LABEL_RE.fullmatch(label):
        raise InvalidArgument(
            f"forward label {safe_repr(label)} is invalid: use [a-z0-9][a-z0-9_-]{{0,31}}"
        )
    return label


def check_port(port: object, *, allow_zero: bool) -> int:
    """Return ``port`` if it is an int in range (0 only when ``allow_zero``)."""
    low = 0 if allow_zero else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
        raise InvalidArgument(f"port {safe_repr(port)} is out of range {low}-65535")
    return port


def parse_canonical_ipv4(text: object, what: str = "address") -> ipaddress.IPv4Address:
    """Parse a strictly canonical dotted-quad IPv4 literal.

    Rejects every alternative spelling the C resolver would accept (``127.1``, ``0x7f.0.0.1``,
    ``2130706433``, ``127.0.0.016``), blanks, CIDR suffixes, IPv6 (including
    ``::ffff:a.b.c.d``) and hostnames: none of them is ever resolved.
    """
    if not isinstance(text, str) or not _CANONICAL_V4.fullmatch(text):
        raise InvalidArgument(f"{what} {safe_repr(text)} is not a canonical IPv4 literal")
    return ipaddress.IPv4Address(text)


@frozen
class AliasPool:
    """The loopback network that bottle aliases are drawn from (for example 127.77.0.0/16)."""

    network: ipaddress.IPv4Network

    @classmethod
    def parse(cls, text: object) -> AliasPool:
        """Parse ``--alias-pool``: a loopback IPv4 network that does not hold 127.0.0.1."""
        if not isinstance(text, str) or "/" not in text:
            raise InvalidArgument(f"alias pool {safe_repr(text)} must be an IPv4 CIDR")
        addr_text, _, prefix_text = text.partition("/")
        addr = parse_canonical_ipv4(addr_text, "alias pool")
        if not prefix_text.isdigit() or not 8 <= int(prefix_text) <= 30:
            raise InvalidArgument(f"alias pool {safe_repr(text)} needs a prefix length 8-30")
        try:
            network = ipaddress.IPv4Network(f"{addr}/{int(prefix_text)}", strict=True)
        except ValueError:
            raise InvalidArgument(f"alias pool {safe_repr(text)} has host bits set") from None
        if not network.subnet_of(_LOOPBACK_V4):
            raise InvalidArgument(f"alias pool {network} is not inside 127.0.0.0/8")
        if _HOST_LOOPBACK in network:
            raise InvalidArgument(f"alias pool {network} must not contain 127.0.0.1")
        return cls(network)

    def __contains__(self, addr: object) -> bool:
        return (
            isinstance(addr, ipaddress.IPv4Address)
            and addr in self.network
            and addr != self.network.network_address
            and addr != self.network.broadcast_address
        )

    def parse_alias(self, text: object) -> ipaddress.IPv4Address:
        """Parse an alias: a canonical IPv4 literal that is a usable address of this pool."""
        addr = parse_canonical_ipv4(text, "alias")
        if addr not in self:
            raise InvalidArgument(f"alias {addr} is not in the alias pool {self.network}")
        return addr

    def candidates(self) -> list[ipaddress.IPv4Address]:
        """Usable aliases in allocation order (lazy would be nicer; pools are small)."""
        return list(self.network.hosts())


@frozen
class TCPListen:
    """Listen on ``alias:port`` (port 0 = kernel-chosen)."""

    alias: ipaddress.IPv4Address
    port: int

    def describe(self) -> str:
        return f"{self.alias}:{self.port}"


@frozen
class UNIXListen:
    """Listen on a UNIX socket path inside the bottle's own directory."""

    path: str

    def describe(self) -> str:
        return f"unix:{self.path}"


ListenSpec: TypeAlias = TCPListen | UNIXListen


@frozen
class TCPTarget:
    """Connect to a loopback IP literal and port (never a name)."""

    host: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int

    def describe(self) -> str:
        if isinstance(self.host, ipaddress.IPv6Address):
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"


@frozen
class HeldSocket:
    """Which socket file a UNIX target must still be at each connect: the one the process
    behind it was seen to hold (its device, inode and owner), not merely a socket there."""

    dev: int
    ino: int
    uid: int

    @classmethod
    def at(cls, path: str) -> HeldSocket | None:
        """The socket at ``path`` now (lstat: a link is not followed); None: nothing there
        (then the connect-time check finds nothing to connect to either)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        return cls(st.st_dev, st.st_ino, st.st_uid)


@frozen
class UNIXTarget:
    """Connect to a UNIX socket path under an allowed root (the state dir); ``held`` (a
    sidecar's exposed socket) pins the very socket file it must be."""

    path: str
    held: HeldSocket | None = field(default=None, eq=False)

    def describe(self) -> str:
        return f"unix:{self.path}"


TargetSpec: TypeAlias = TCPTarget | UNIXTarget


#: Connections one forward holds at once unless its bottle says otherwise, and the most any may.
DEFAULT_MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_LIMIT = 65536

#: ``SO_LINGER`` on, zero seconds: ``close()`` sends RST instead of FIN.
LINGER_RST = struct.pack("ii", 1, 0)


@frozen
class ForwardSpec:
    """One fixed route: agent endpoint -> target; the target never comes from a client."""

    bottle: str
    label: str
    listen: ListenSpec
    target: TargetSpec
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: The bottle directory its UNIX endpoint and sidecar socket live in when that is not
    #: the bottle's own (a VM bottle taken from a warm pool keeps its member's); None: its own.
    home: str | None = None

    @property
    def home_dir(self) -> str:
        """The name of the bottle directory its UNIX paths must lie in."""
        return self.bottle if self.home is None else self.home


def _check_abs_path(path: object, what: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        raise InvalidArgument(f"{what} {safe_repr(path)} must be an absolute path")
    if os.path.normpath(path) != path or "/../" in f"{path}/":
        raise InvalidArgument(f"{what} {safe_repr(path)} must be a normalised path")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_SUN_PATH:
        raise InvalidArgument(f"{what} {safe_repr(path)} is longer than {MAX_SUN_PATH} bytes")
    return path


def _inside(path: str, root: str) -> bool:
    root = os.path.normpath(root)
    return path.startswith(root.rstrip("/") + "/")


def parse_target(text: object, *, unix_root: str | None = None) -> TargetSpec:
    """Parse a target: ``127.x.y.z:PORT``, ``[::1]:PORT`` or ``unix:/abs/path``.

    UNIX targets must lie under ``unix_root`` (the bottle's own target directory,
    :func:`targets_dir`); with no root they are refused.
    """
    if not isinstance(text, str):
        raise InvalidArgument(f"target {safe_repr(text)} must be a string")
    if text.startswith("unix:"):
        if unix_root is None:
            raise InvalidArgument("UNIX socket targets are not allowed here")
        path = _check_abs_path(text[len("unix:") :], "target path")
        if not _inside(path, unix_root):
            raise InvalidArgument(f"target path {safe_repr(path)} is not under {unix_root}")
        return UNIXTarget(path)
    host: ipaddress.IPv4Address | ipaddress.IPv6Address
    if text.startswith("["):
        host_text, sep, port_text = text[1:].partition("]:")
        if not sep or host_text != "::1":
            raise InvalidArgument(
                f"target {safe_repr(text)}: the only IPv6 target host allowed is [::1]"
            )
        host = ipaddress.IPv6Address("::1")
    else:
        host_text, sep, port_text = text.rpartition(":")
        if not sep:
            raise InvalidArgument(f"target {safe_repr(text)} must be HOST:PORT or unix:/path")
        host = parse_canonical_ipv4(host_text, "target host")
        if host not in _LOOPBACK_V4:
            raise InvalidArgument(f"target host {host} is not a loopback address")
    if not port_text.isdigit() or len(port_text) > 5 or port_text != str(int(port_text)):
        raise InvalidArgument(f"target {safe_repr(text)} has an invalid port")
    return TCPTarget(host, check_port(int(port_text), allow_zero=False))


def bottle_dir(state_dir: str, bottle: str) -> str:
    """The bottle's own directory, which holds its UNIX agent endpoints (mode 0700)."""
    return os.path.join(state_dir, "bottles", check_bottle_name(bottle))


#: A sidecar service's exposed socket lives in the bottle's ``sidecar/`` directory
#: (``<bottle-dir>/sidecar/<service>.sock``), made for the sidecar VMM's uid alone; bottles
#: created before it have ``<bottle-dir>/sidecar-<service>.sock``. Either is the one target
#: that may live outside the bottle's target directory (the daemon places it; no control
#: client can name it).
SIDECAR_DIR = "sidecar"
SIDECAR_SOCKET_PREFIX = "sidecar-"


def sidecar_dir(state_dir: str, bottle: str) -> str:
    """The directory the sidecar's VMM creates its exposed sockets in (its uid's, 0700)."""
    return os.path.join(bottle_dir(state_dir, bottle), SIDECAR_DIR)


def sidecar_socket_path(state_dir: str, bottle: str, service: str) -> str:
    """Where the sidecar's ``service`` socket appears on the host: the bottle's ``sidecar/``
    directory, never next to the agent endpoint ``<service>.sock``."""
    return os.path.join(sidecar_dir(state_dir, bottle), f"{check_label(service)}.sock")


def target_root(state_dir: str, bottle: str, path: str) -> str:
    """The directory a UNIX target ``path`` of ``bottle`` must stay inside: the bottle's own
    directory for its sidecar's exposed sockets, else its target directory."""
    own = bottle_dir(state_dir, bottle)
    if os.path.dirname(path) == own and os.path.basename(path).startswith(SIDECAR_SOCKET_PREFIX):
        return own
    if os.path.dirname(path) == sidecar_dir(state_dir, bottle):
        return sidecar_dir(state_dir, bottle)
    return targets_dir(state_dir, bottle)


def targets_dir(state_dir: str, bottle: str) -> str:
    """The bottle's own directory of UNIX targets: its forwards may point only in here."""
    return os.path.join(state_dir, "targets", check_bottle_name(bottle))


def unix_listen_for(state_dir: str, bottle: str, label: str) -> UNIXListen:
    """The UNIX agent endpoint of ``label`` inside ``bottle``'s own directory."""
    path = os.path.join(bottle_dir(state_dir, bottle), f"{check_label(label)}.sock")
    return UNIXListen(_check_abs_path(path, "socket path"))


def check_unix_listen(spec: UNIXListen, state_dir: str, bottle: str) -> UNIXListen:
    """Refuse a UNIX listen path that is not directly inside ``bottle``'s own directory."""
    path = _check_abs_path(spec.path, "listen path")
    if os.path.dirname(path) != bottle_dir(state_dir, bottle):
        raise InvalidArgument(f"listen path {safe_repr(path)} is outside the bottle directory")
    return spec
