"""What a started machine publishes on the host, and who really holds it.

Raw published ports (the opt-in for sidecars that can only serve TCP): allocate them, retry
on collisions, verify who owns them. Exposed UNIX sockets (the default): verify that the
machine's VM process holds each one. Either is only trusted once the machine's own VM process
is seen holding the listening socket (design invariant 5). On Linux that is read from
``/proc/net/{tcp,tcp6,unix}`` and ``/proc/<pid>/fd``; elsewhere the check reports that it
could not verify. Every undo here stops the machine before deleting it: a start that failed
or was cut short can leave a VMM whose record is not ``running``, and ``delete`` alone would
leave it running, invisible to ``ls``.
"""

from __future__ import annotations

import enum
import errno
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence

from attrs import frozen
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from vmctl.errors import PortInUse, PortNotOwned, SmolvmFailed, VmctlError, sanitize
from vmctl.smolvm import Machine, Smolvm
from vmctl.spec import MachineSpec

_LISTEN = "0A"
_LOOPBACK_V4 = {"127.0.0.1", "0.0.0.0"}
_LOOPBACK_V6 = {"::1", "::", "::ffff:127.0.0.1", "::ffff:0.0.0.0"}
log = Logger()


def pid_alive(pid: int) -> bool:
    """A live, non-zombie process (a VMM is not our child, but it can sit as a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return bool(fields) and fields[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def vmm_alive(machine: Machine) -> bool:
    """Is the machine's VM process alive? ``running`` or ``unreachable`` (a live VMM whose
    agent was slow to answer smolvm's 250 ms ping) with a pid that is still there."""
    return (machine.running or machine.unreachable) and (
        machine.pid is not None and pid_alive(machine.pid)
    )


def allocate_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ask the kernel for ``count`` distinct free ports (bind :0, read, close).

    The ports are free *now* only: something may take one before smolvm binds it (TOCTOU).
    :func:`start_with_raw_ports` handles that by retrying with fresh ports.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Ownership(enum.Enum):
    OWNED = "owned"
    FOREIGN = "foreign"
    NOT_LISTENING = "not-listening"
    UNVERIFIABLE = "unverifiable"


@frozen
class PortCheck:
    """The result of checking one raw port against one VM pid."""

    port: int
    pid: int
    ownership: Ownership
    detail: str = ""

    @property
    def owned(self) -> bool:
        return self.ownership is Ownership.OWNED


def _decode_addr(hexaddr: str) -> str:
    """/proc/net/tcp prints each 32-bit word of the address in host byte order."""
    raw = bytes.fromhex(hexaddr)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw)


def listening_inodes(port: int, proc: str = "/proc") -> dict[int, str]:
    """Inodes of LISTEN sockets on loopback/wildcard ``port``, mapped to their address.

    Raises OSError when ``/proc/net/tcp`` cannot be read (not Linux).
    """
    found: dict[int, str] = {}
    for table, wanted in (("tcp", _LOOPBACK_V4), ("tcp6", _LOOPBACK_V6)):
        try:
            with open(os.path.join(proc, "net", table)) as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            if table == "tcp":
                raise
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            addr, _, hexport = fields[1].rpartition(":")
            try:
                if int(hexport, 16) != port:
                    continue
                ip = _decode_addr(addr)
                inode = int(fields[9])
            except ValueError:
                continue
            if ip in wanted and inode:
                found[inode] = ip
    return found


def socket_inodes(pid: int, proc: str = "/proc") -> set[int]:
    """Inodes of the sockets ``pid`` has open (raises OSError when unreadable)."""
    fd_dir = os.path.join(proc, str(pid), "fd")
    inodes: set[int] = set()
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target.endswith("]"):
            inodes.add(int(target[8:-1]))
    return inodes


def check_port_owner(port: int, pid: int, proc: str = "/proc") -> PortCheck:
    """Is the LISTEN socket on ``127.0.0.1:port`` (and ``[::1]:port``) held by ``pid``?

    Any loopback or wildcard listener on that port held by another process makes the answer
    FOREIGN, even when ``pid`` also listens.
    """
    try:
        listeners = listening_inodes(port, proc)
    except OSError as e:
        return PortCheck(port, pid, Ownership.UNVERIFIABLE, f"cannot read socket table: {e}")
    if not listeners:
        return PortCheck(port, pid, Ownership.NOT_LISTENING, "no listener on the port")
    try:
        mine = socket_inodes(pid, proc)
    except OSError as e:
        if e.errno == errno.ENOENT:
            return PortCheck(port, pid, Ownership.FOREIGN, "the VM process is gone")
        return PortCheck(port, pid, Ownership.UNVERIFIABLE, f"cannot read its fds: {e}")
    foreign = sorted(ip for inode, ip in listeners.items() if inode not in mine)
    if foreign:
        return PortCheck(
            port, pid, Ownership.FOREIGN, "held by another process on " + ",".join(foreign)
        )
    return PortCheck(port, pid, Ownership.OWNED)


def unix_listener_inodes(path: str, pid: int, proc: str = "/proc") -> set[int]:
    """Inodes of listening UNIX sockets bound at ``path`` in ``pid``'s network namespace.

    ``/proc/PID/net/unix`` lists the sockets of that process's namespace, which need not be the
    daemon's: a daemon restarted in a new namespace (``unshare -n``) still sees its VMs'
    sockets. Raises OSError when the table cannot be read (ENOENT: the process is gone).
    """
    found: set[int] = set()
    with open(os.path.join(proc, str(pid), "net", "unix")) as f:
        lines = f.read().splitlines()[1:]
    for line in lines:
        fields = line.split(None, 7)
        # Num RefCount Protocol Flags Type St Inode Path; flag 00010000 = __SO_ACCEPTCON
        if len(fields) < 8 or fields[7] != path:
            continue
        try:
            listening = int(fields[3], 16) & 0x10000
            inode = int(fields[6])
        except ValueError:
            continue
        if listening and inode:
            found.add(inode)
    return found


def check_socket_owner(path: str, pid: int, proc: str = "/proc") -> PortCheck:
    """Is the UNIX socket listening at ``path`` held by ``pid`` (and by nobody else in its
    network namespace)?

    The result's ``port`` is 0: a socket has a path, not a port.
    """
    try:
        listeners = unix_listener_inodes(path, pid, proc)
        mine = socket_inodes(pid, proc) if listeners else set()
    except OSError as e:
        if e.errno == errno.ENOENT and not os.path.exists(os.path.join(proc, str(pid))):
            return PortCheck(0, pid, Ownership.FOREIGN, "the VM process is gone")
        return PortCheck(0, pid, Ownership.UNVERIFIABLE, f"cannot read its sockets: {e}")
    if not listeners:
        return PortCheck(0, pid, Ownership.NOT_LISTENING, "no listener at the path")
    if listeners - mine:
        return PortCheck(0, pid, Ownership.FOREIGN, "held by another process")
    return PortCheck(0, pid, Ownership.OWNED)


@frozen
class RawPortsResult:
    """A machine created and started with raw ports its VM process was seen to own."""

    spec: MachineSpec
    pid: int
    ports: tuple[int, ...]
    checks: tuple[PortCheck, ...]
    attempts: int

    @property
    def verified(self) -> bool:
        return all(c.owned for c in self.checks)


Allocator = Callable[[int], Sequence[int]]
Checker = Callable[[int, int], PortCheck]


def start_with_raw_ports(
    smolvm: Smolvm,
    make_spec: Callable[[Sequence[int]], MachineSpec],
    count: int,
    *,
    attempts: int = 3,
    allocate: Allocator = allocate_ports,
    check: Checker = check_port_owner,
    allow_unverifiable: bool = False,
    before_start: Callable[[], Awaitable[object]] | None = None,
) -> Deferred[RawPortsResult]:
    """Create and start a machine whose ``count`` host ports vmctl picks, then verify them.

    ``make_spec(ports)`` builds the spec for a given list of host ports. When smolvm reports a
    port collision at start (another machine's record, or a foreign bind), the failed machine
    is deleted (``-f``) and the whole create+start is retried with fresh ports, at most
    ``attempts`` times. After start, each port must be held by the VM pid from
    ``status --json``; otherwise the machine is deleted and PortNotOwned raised. A platform
    without /proc gives UNVERIFIABLE, accepted only with ``allow_unverifiable``.
    ``before_start`` runs between each create and its start (e.g. reserving the VMM's uid).
    """

    async def go() -> RawPortsResult:
        last: PortInUse | None = None
        for attempt in range(1, attempts + 1):
            ports = list(allocate(count))
            spec = make_spec(ports)
            await smolvm.create(spec)
            try:
                if before_start is not None:
                    await before_start()
                await smolvm.start(spec.name)
            except PortInUse as e:
                last = e
                log.warn(
                    "raw port collision for {name} (attempt {n}): {err}",
                    name=spec.name,
                    n=attempt,
                    err=e.message,
                )
                await _undo(smolvm, spec.name)
                continue
            except BaseException:
                await _undo(smolvm, spec.name)
                raise
            try:
                return await _verify(smolvm, spec, ports, attempt, check, allow_unverifiable)
            except BaseException:
                await _undo(smolvm, spec.name)
                raise
        assert last is not None
        raise PortInUse(
            f"no free raw ports after {attempts} attempts: {last.message}",
            last.stderr_tail,
            last.exit_code,
            last.port,
            last.holder,
        )

    return Deferred.fromCoroutine(go())


async def _verify(
    smolvm: Smolvm,
    spec: MachineSpec,
    ports: Sequence[int],
    attempt: int,
    check: Checker,
    allow_unverifiable: bool,
) -> RawPortsResult:
    pid = await started_pid(smolvm, spec.name)
    checks = tuple(check(p, pid) for p in ports)
    for c in checks:
        if c.owned or (allow_unverifiable and c.ownership is Ownership.UNVERIFIABLE):
            continue
        raise PortNotOwned(
            f"raw port {c.port} of machine {spec.name} is not held by its VM process "
            f"(pid {c.pid}): {c.ownership.value}, {c.detail}"
        )
    return RawPortsResult(spec, pid, tuple(ports), checks, attempt)


async def started_pid(smolvm: Smolvm, name: str) -> int:
    """The VM pid of a machine that was just started; ``unreachable`` with a live pid counts
    as started (smolvm's agent ping has a 250 ms budget that a busy host misses)."""
    machine = await smolvm.status(name)
    if machine.pid is None or not vmm_alive(machine):
        why = f" ({sanitize(machine.state_reason, 120)})" if machine.state_reason else ""
        raise SmolvmFailed(f"machine {name} is {machine.state} right after start{why}")
    return machine.pid


@frozen
class SocketsResult:
    """A machine created and started whose exposed sockets its VM process was seen to hold."""

    spec: MachineSpec
    pid: int
    checks: tuple[PortCheck, ...]

    @property
    def verified(self) -> bool:
        return all(c.owned for c in self.checks)


SocketChecker = Callable[[str, int], PortCheck]


def start_with_sockets(
    smolvm: Smolvm,
    spec: MachineSpec,
    *,
    check: SocketChecker = check_socket_owner,
    allow_unverifiable: bool = False,
    before_start: Callable[[], Awaitable[object]] | None = None,
) -> Deferred[SocketsResult]:
    """Create and start a machine with ``--expose-socket``s, then verify who holds them.

    ``before_start`` runs between create and start (e.g. reserving the VMM's uid and handing
    it the directory its sockets go to).

    No ports, so no collisions and no retries. On any failure (including a cancelled or
    timed-out start) the machine is stopped, then deleted, and the error raised.
    """

    async def go() -> SocketsResult:
        await smolvm.create(spec)
        try:
            if before_start is not None:
                await before_start()
            await smolvm.start(spec.name)
            pid = await started_pid(smolvm, spec.name)
            checks = tuple(check(e.host, pid) for e in spec.expose_sockets)
            for c, e in zip(checks, spec.expose_sockets, strict=True):
                if c.owned or (allow_unverifiable and c.ownership is Ownership.UNVERIFIABLE):
                    continue
                raise PortNotOwned(
                    f"exposed socket {e.guest} of machine {spec.name} is not held by its VM "
                    f"process (pid {pid}) on the host: {c.ownership.value}, {c.detail}"
                )
            return SocketsResult(spec, pid, checks)
        except BaseException:
            await _undo(smolvm, spec.name)
            raise

    return Deferred.fromCoroutine(go())


async def _undo(smolvm: Smolvm, name: str) -> None:
    """Best-effort stop-then-delete of a machine this call created; the original error wins.

    ``stop`` first: after a failed, timed-out or cancelled start the VMM may still run with
    the record not ``running``, and ``delete`` alone would leave it behind.
    """
    try:
        await smolvm.remove(name)
    except VmctlError as e:
        log.warn("could not remove {name} during rollback: {err}", name=name, err=e.message)
