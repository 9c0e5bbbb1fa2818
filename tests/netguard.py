"""No packet leaves the machine: the suite's guard (a pytest plugin, loaded by conftest.py).

As root (CI), the test process moves into a network and mount namespace of its own before any
test runs, so the suite and every process it starts (daemons, the fake smolvm, the fake's
``exec`` "guest" commands that run on the host) share it:

* ``lo`` is up, so loopback works as usual (127.0.0.0/8, ::1);
* the default routes (IPv4 and IPv6) point into a TUN device the plugin reads: any attempt to
  reach another address (a TCP SYN, a UDP datagram, an ICMP echo) lands there and nowhere
  else, and fails the test during which it arrived;
* ``/etc/resolv.conf`` is replaced (in this mount namespace only) by ``nameserver 127.0.0.1``,
  so no resolver query goes to the host's nameserver.

Namespaces a test makes itself (``unshare -n``, the real-VM tier) are separate and unaffected.
Without root the namespace cannot be made; the in-process part still runs (``socket.connect``,
``connect_ex`` and ``sendto`` refuse non-loopback addresses and fail the test), and the run says
that child processes are not covered. ``BOTTLENET_NETGUARD=off`` turns it all off.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import ipaddress
import os
import socket
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
TRAP = "bntrap0"
TRAP_V4 = "198.18.0.1"  # RFC 2544 benchmarking range: never routed anywhere
TRAP_V6 = "fd42:b077:1e70::1"
#: Where the suite's daemons cache bottlenet's guest kit: one build for the whole run (the
#: cache is keyed by the kit's inputs and locked while a daemon builds, bottlenet/kit/build.py).
#: One per checkout: each daemon's start removes the kits no daemon holds in use, and a
#: checkout of an older bottlenet (before ``<key>.use``) holds none of its own.
TEST_KIT_DIR = os.path.join(
    "/var/tmp",
    f"bottlenet-test-kit-{os.geteuid()}-"
    + hashlib.sha256(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))).encode()
    ).hexdigest()[:8],
)
#: Daemon options every test daemon gets: the gate's outside address and DNS name pointed at
#: stand-ins, an address local to the suite's own namespace (nothing listens on port 9) and a
#: name that only the loopback resolver could answer; and the suite's shared guest kit cache.
GATE_STAND_INS = (
    "--gate-outside",
    f"{TRAP_V4}:9",
    "--gate-dns-name",
    "gate.invalid",
    "--guest-kit",
    TEST_KIT_DIR,
)

_state: dict[str, Any] = {"fd": None, "why": None, "seen": [], "inproc": []}
_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex
_real_sendto = socket.socket.sendto


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)


def enter() -> str | None:
    """Move this process into the guarded namespaces; the reason when that is not possible."""
    if os.geteuid() != 0:
        return "not root: child processes are not covered (in-process checks only)"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET | CLONE_NEWNS) != 0:
        return f"unshare failed: {os.strerror(ctypes.get_errno())}"
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return f"making mounts private failed: {os.strerror(ctypes.get_errno())}"
    _ip("link", "set", "lo", "up")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", TRAP.encode(), IFF_TUN | IFF_NO_PI))
    _ip("addr", "add", f"{TRAP_V4}/32", "dev", TRAP)
    _ip("link", "set", TRAP, "up")
    _ip("route", "add", "default", "dev", TRAP)
    try:
        _ip("-6", "addr", "add", f"{TRAP_V6}/128", "dev", TRAP, "nodad")
        _ip("-6", "route", "add", "default", "dev", TRAP)
    except subprocess.CalledProcessError:
        pass  # no IPv6 in this kernel: IPv6 connects fail with ENETUNREACH, nothing is sent
    resolv = tempfile.NamedTemporaryFile("w", prefix="netguard-resolv-", delete=False)
    resolv.write("nameserver 127.0.0.1\n")
    resolv.close()
    if libc.mount(resolv.name.encode(), b"/etc/resolv.conf", None, MS_BIND, None) != 0:
        return f"replacing /etc/resolv.conf failed: {os.strerror(ctypes.get_errno())}"
    _state["fd"] = fd
    return None


def _describe(packet: bytes) -> str | None:
    if not packet:
        return None
    version = packet[0] >> 4
    if version == 4 and len(packet) >= 20:
        ihl = (packet[0] & 0x0F) * 4
        proto, dst = packet[9], ipaddress.IPv4Address(packet[16:20])
        l4 = packet[ihl:]
    elif version == 6 and len(packet) >= 40:
        proto, dst = packet[6], ipaddress.IPv6Address(packet[24:40])
        l4 = packet[40:]
    else:
        return "a packet of an unknown kind"
    if dst.is_multicast:
        return None  # the kernel's own router solicitations and MLD reports on the trap
    if proto in (6, 17) and len(l4) >= 4:
        port = struct.unpack("!H", l4[2:4])[0]
        return f"{'tcp' if proto == 6 else 'udp'} {dst}:{port}"
    if proto in (1, 58):
        return f"icmp {dst}"
    return f"protocol {proto} to {dst}"


def take() -> list[str]:
    """Every off-machine attempt seen since the last call (and forget them)."""
    fd = _state["fd"]
    if fd is not None:
        while True:
            try:
                packet = os.read(fd, 65536)
            except BlockingIOError:
                break
            what = _describe(packet)
            if what is not None:
                _state["seen"].append(what)
    seen: list[str] = list(dict.fromkeys(_state["seen"] + _state["inproc"]))
    _state["seen"].clear()
    _state["inproc"].clear()
    return seen


def _allowed(address: object, family: int) -> bool:
    if family not in (socket.AF_INET, socket.AF_INET6):
        return True
    if not isinstance(address, tuple) or not address:
        return True
    host = str(address[0]).split("%", 1)[0]
    if host in ("localhost", ""):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: resolving and dialling it is what must not happen
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or ip.is_unspecified or bool(mapped and mapped.is_loopback)


def _guard(sock: socket.socket, address: object) -> None:
    if not _allowed(address, sock.family):
        what = f"connect to {address!r}"
        _state["inproc"].append(what)
        raise OSError(errno.ENETUNREACH, f"netguard: tests may not {what} (not loopback)")


def _connect(self: socket.socket, address: Any) -> None:
    _guard(self, address)
    return _real_connect(self, address)


def _connect_ex(self: socket.socket, address: Any) -> int:
    _guard(self, address)
    return _real_connect_ex(self, address)


def _sendto(self: socket.socket, data: Any, *args: Any) -> int:
    _guard(self, args[-1] if args else None)
    return _real_sendto(self, data, *args)  # type: ignore[arg-type]


def install() -> None:
    socket.socket.connect = _connect  # type: ignore[method-assign]
    socket.socket.connect_ex = _connect_ex  # type: ignore[method-assign]
    socket.socket.sendto = _sendto  # type: ignore[method-assign, assignment]


def active() -> bool:
    """True when the namespace part runs (child processes are covered)."""
    return _state["fd"] is not None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("BOTTLENET_NETGUARD") == "off":
        _state["why"] = "off (BOTTLENET_NETGUARD=off)"
        return
    why = enter()
    if why is not None and os.environ.get("CI") and os.geteuid() == 0:
        raise pytest.UsageError(f"netguard: cannot guard the suite: {why}")
    _state["why"] = why
    install()


def pytest_report_header(config: pytest.Config) -> str:
    if active():
        return "netguard: own network namespace; off-machine attempts fail the test"
    return f"netguard: {_state['why']}"


@pytest.fixture(autouse=True)
def _no_packet_leaves() -> Iterator[None]:
    earlier = take()
    if earlier:
        pytest.fail(
            "netguard: off-machine attempts before this test (from an earlier one): "
            + ", ".join(earlier)
        )
    yield
    seen = take()
    if seen:
        pytest.fail("netguard: this test tried to reach off the machine: " + ", ".join(seen))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    late = take()
    if late:
        session.config.get_terminal_writer().line(
            "netguard: off-machine attempts after the last test: " + ", ".join(late), red=True
        )
        session.exitstatus = 1
