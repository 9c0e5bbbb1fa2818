"""What the launch gate checks inside a guest: one frozen plan, built and validated here.

Every value that ends up in the guest script is checked against a narrow alphabet first (IP
literals, absolute paths of ``[A-Za-z0-9._/-]``, DNS names, a hex nonce), so the renderer can
quote it without escaping, and a message can repeat it without echoing anything a guest chose.
"""

from __future__ import annotations

import enum
import hashlib
import ipaddress
import re
import secrets

from attrs import field, frozen

from bottlenet.errors import InvalidArgument, safe_repr


class IsolationMode(enum.StrEnum):
    """How an agent reaches its own endpoints (the strings are the wire's and the state
    file's). Only socket mode can be enforced; alias mode stays nameable so the gate can be
    run by hand against an alias-mode guest, and so a request for it is refused by name."""

    SOCKET = "socket"
    ALIAS = "alias"


MODES = tuple(m.value for m in IsolationMode)

#: Production defaults: an address outside the host and a public name. Tests point both at
#: stand-ins (a loopback or namespace address, a name only a stand-in resolver knows).
DEFAULT_OUTSIDE = "1.1.1.1:443"
DEFAULT_DNS_NAME = "example.com"
#: Well-known host ports probed on every path to the host (ssh, dns, http, https, proxies,
#: databases): a host service a guest must never reach, whoever runs it.
WELL_KNOWN_PORTS = (22, 53, 80, 443, 3128, 5432, 6379, 8080)
#: Well-known UDP ports probed on the same paths (dns, ntp, snmp, quic, mdns): any answer
#: is a leak (a service that ignores an unknown datagram stays unseen).
WELL_KNOWN_UDP_PORTS = (53, 123, 161, 443, 5353)
#: The host's vsock CID: the host ports are also tried over vsock.
VSOCK_HOST_CID = 2
#: The guest's loopback addresses: with a transparent socket proxy (TSI) they can be the host's.
LOOPBACKS = ("127.0.0.1", "::1")
#: Per-check connect/resolve budget in the guest, seconds.
CHECK_TIMEOUT = 2.0

_PATH = re.compile(r"/[A-Za-z0-9._/-]{0,200}")
_NONCE = re.compile(r"[0-9a-f]{16,64}")
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_DNS = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")


def new_nonce() -> str:
    """A per-run nonce the daemon chooses (128 bits, hex)."""
    return secrets.token_hex(16)


def check_nonce(nonce: str) -> str:
    if not isinstance(nonce, str) or not _NONCE.fullmatch(nonce):
        raise InvalidArgument("nonce must be 16-64 lowercase hex digits")
    return nonce


def check_guest_path(path: str, what: str = "path") -> str:
    if (
        not isinstance(path, str)
        or not _PATH.fullmatch(path)
        or "/../" in f"{path}/"
        or "//" in path
    ):
        raise InvalidArgument(
            f"{what} {safe_repr(path)} must be an absolute path of [A-Za-z0-9._/-]"
        )
    return path


def check_dns_name(name: str) -> str:
    if not isinstance(name, str) or not _DNS.fullmatch(name):
        raise InvalidArgument(f"DNS name {safe_repr(name)} is not a lowercase host name")
    return name


def check_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidArgument(f"port {safe_repr(port)} is out of range 1-65535")
    return port


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        raise InvalidArgument(f"{safe_repr(text)} is not an IP address literal") from None


@frozen
class Target:
    """``tcp:HOST:PORT`` (HOST an IP literal, IPv6 in brackets) or ``unix:PATH``."""

    kind: str
    host: str | None = None
    port: int | None = None
    path: str | None = None

    @classmethod
    def parse(cls, text: str) -> Target:
        if not isinstance(text, str):
            raise InvalidArgument("endpoint must be a string")
        if text.startswith("unix:"):
            return cls("unix", path=check_guest_path(text[5:], "unix endpoint"))
        if text.startswith("tcp:"):
            host, sep, port = text[4:].rpartition(":")
            if not sep or not port.isdigit():
                raise InvalidArgument(f"endpoint {safe_repr(text)} must be tcp:HOST:PORT")
            if host.startswith("[") and host.endswith("]"):
                addr = _ip(host[1:-1])
                if addr.version != 6:
                    raise InvalidArgument(f"endpoint {safe_repr(text)}: brackets are for IPv6")
            else:
                addr = _ip(host)
                if addr.version != 4:
                    raise InvalidArgument(f"endpoint {safe_repr(text)}: IPv6 needs brackets")
            return cls("tcp", host=str(addr), port=check_port(int(port)))
        raise InvalidArgument(f"endpoint {safe_repr(text)} must be tcp:HOST:PORT or unix:PATH")

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        assert self.host is not None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp:{host}:{self.port}"


def _mode(value: object) -> IsolationMode:
    if isinstance(value, str) and value in MODES:
        return IsolationMode(value)
    raise InvalidArgument(f"mode must be one of {', '.join(MODES)}")


def _targets(values: object) -> tuple[Target, ...]:
    items = [v if isinstance(v, Target) else Target.parse(v) for v in values]  # type: ignore[attr-defined]
    return tuple(dict.fromkeys(items))


def _ports(values: object) -> tuple[int, ...]:
    return tuple(dict.fromkeys(check_port(p) for p in values))  # type: ignore[attr-defined]


def _paths(values: object) -> tuple[str, ...]:
    return tuple(dict.fromkeys(check_guest_path(p) for p in values))  # type: ignore[attr-defined]


def _outside(value: str | Target) -> Target:
    if isinstance(value, Target):
        value = str(value)
    t = Target.parse(value if value.startswith("tcp:") else f"tcp:{value}")
    if t.kind != "tcp":
        raise InvalidArgument("the outside address must be tcp:HOST:PORT")
    return t


def _target_or_none(value: str | Target | None) -> Target | None:
    if value is None or isinstance(value, Target):
        return value
    return Target.parse(value)


def _host_ports(values: object) -> tuple[str, ...]:
    """``name:port`` for a CONNECT request (a lowercase DNS name, a port 1-65535)."""
    out = []
    for v in values:  # type: ignore[attr-defined]
        name, sep, port = str(v).rpartition(":")
        if not sep or not port.isdigit():
            raise InvalidArgument(f"CONNECT target {safe_repr(v)} must be NAME:PORT")
        out.append(f"{check_dns_name(name)}:{check_port(int(port))}")
    return tuple(dict.fromkeys(out))


def _hex64_or_none(value: object) -> str | None:
    return None if value is None else _hex64([value])[0]


def _hex64(values: object) -> tuple[str, ...]:
    out = []
    for v in values:  # type: ignore[attr-defined]
        if not isinstance(v, str) or not re.fullmatch(r"[0-9a-f]{64}", v):
            raise InvalidArgument("host identity hashes must be 64 hex digits")
        out.append(v)
    return tuple(out)


@frozen
class ProbePlan:
    """One run of the gate.

    ``own``: must connect (and, with ``witness``, be seen by the host listener carrying the
    nonce). ``deny``: explicit targets that must not connect. ``host_ports``: probed on every
    path the guest has to the host (127.0.0.1, [::1], each default gateway, each nameserver)
    and over vsock to the host. ``udp_ports``: sent a datagram on the same paths; none may
    answer. ``outside``: must be unreachable by TCP, UDP and ICMP. ``dns``: names that must
    not resolve.
    ``absent``: host paths (the daemon's per-run markers) that must not exist in the guest.
    ``host_ids``: sha256(nonce:value) of the host's machine-id and hostname, which the guest's
    must differ from. ``ro``/``rw``: guest paths of read-only volumes (a write must fail) and
    read-write volumes (a file must round-trip to the host).
    """

    mode: IsolationMode = field(converter=_mode)
    nonce: str = field(converter=check_nonce)
    own: tuple[Target, ...] = field(converter=_targets, default=())
    deny: tuple[Target, ...] = field(converter=_targets, default=())
    host_ports: tuple[int, ...] = field(converter=_ports, default=())
    udp_ports: tuple[int, ...] = field(converter=_ports, default=WELL_KNOWN_UDP_PORTS)
    outside: Target = field(converter=_outside, default=Target("tcp", "1.1.1.1", 443))
    dns: tuple[str, ...] = field(default=(DEFAULT_DNS_NAME,))
    absent: tuple[str, ...] = field(converter=_paths, default=())
    host_ids: tuple[str, ...] = field(converter=_hex64, default=())
    ro: tuple[str, ...] = field(converter=_paths, default=())
    rw: tuple[str, ...] = field(converter=_paths, default=())
    #: An own endpoint that is an HTTP CONNECT proxy: ``connect_ok`` HOST:PORTs must be
    #: answered (2xx) through it, ``connect_no`` ones refused.
    connect_via: Target | None = field(converter=_target_or_none, default=None)
    connect_ok: tuple[str, ...] = field(converter=_host_ports, default=())
    connect_no: tuple[str, ...] = field(converter=_host_ports, default=())
    witness: bool = True
    timeout: float = CHECK_TIMEOUT
    #: The digest of the kit the host built and mounted (None: the image's python3 runs the
    #: checks): the guest's kit must report exactly this, else the run is refused.
    kit: str | None = field(converter=_hex64_or_none, default=None)

    @dns.validator
    def _check_dns(self, _attr: object, value: tuple[str, ...]) -> None:
        for name in value:
            check_dns_name(name)


def host_id_hash(nonce: str, value: str) -> str:
    """The form in which a host identity (machine-id, hostname) is compared in the guest."""
    return hashlib.sha256(f"{nonce}:{value.strip()}".encode()).hexdigest()


#: The canaries' reserved ranges (RFC 5737 TEST-NET-1, RFC 3849) and a name under .invalid.
CANARY_V4_NET = "192.0.2"
CANARY_V6_NET = "2001:db8::"
CANARY_DOMAIN = "gate.bottlenet.invalid"


@frozen
class LayerPlan:
    """The second half of the gate for a bottle with transparent egress: with the layer
    installed, canary dials to reserved addresses and to a name (each chosen from the nonce)
    must arrive at the proxy service as ``CONNECT``, witnessed by the host; UDP and ICMP to
    the outside address must still go nowhere."""

    nonce: str = field(converter=check_nonce)
    outside: Target = field(converter=_outside, default=Target("tcp", "1.1.1.1", 443))
    timeout: float = CHECK_TIMEOUT
    #: The digest of the kit that runs the check (None: the image's python3), as ProbePlan's.
    kit: str | None = field(converter=_hex64_or_none, default=None)

    @property
    def port(self) -> int:
        return 1024 + int(self.nonce[2:6], 16) % 60000

    def canaries(self) -> tuple[str, ...]:
        """``tcp:HOST:PORT`` for the IPv4 and IPv6 literals, ``name:NAME:PORT`` for the name
        the guest resolves through the layer's resolver."""
        host = int(self.nonce[:2], 16) % 254 + 1
        return (
            f"tcp:{CANARY_V4_NET}.{host}:{self.port}",
            f"tcp:[{CANARY_V6_NET}{self.nonce[6:10]}]:{self.port}",
            f"name:{self.nonce[:16]}.{CANARY_DOMAIN}:443",
        )

    @staticmethod
    def connect_target(canary: str) -> str:
        """What the proxy must be asked for a canary: ``CONNECT`` of this."""
        return canary.partition(":")[2]
