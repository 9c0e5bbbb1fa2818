"""AMP commands of the bottlenet control protocol (protocol version 1).

Rules that keep old clients and daemons talking (see docs/protocol.md):
- names are namespaced (``bottlenet.X``) and never reused;
- commands evolve only by adding ``optional=True`` arguments and response keys;
- a new operation is a new command (old daemons answer ``UNHANDLED``);
- anything without a fixed bound is paginated (offset/limit -> next_offset), so no value can
  pass AMP's 64 KiB limit;
- errors are the typed codes of :mod:`bottlenet.errors`; new codes reach old clients as
  ``UnknownRemoteError``.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Generic

from twisted.protocols import amp

# The protocol versions are defined with the client-side calls (which import no AMP).
from bottlenet.control.calls import SUPPORTED_PROTOCOLS as SUPPORTED_PROTOCOLS
from bottlenet.control.calls import Pace
from bottlenet.control.framing import MAX_VALUE_LENGTH
from bottlenet.control.records import (
    BottleRecord,
    EventRecord,
    ForwardRecord,
    PoolRecord,
    R,
    RecordError,
    StatsRecord,
    decode_records,
    encode_records,
)
from bottlenet.errors import ALL_ERRORS, BottlenetError

PROTOCOL_VERSION = 1
# Server-side cap on page sizes; each page is also trimmed to a byte budget.
MAX_PAGE = 100
FEATURES = (
    "bottles",
    "forwards",
    "stats",
    "vms",
    "egress",
    "verify",
    "exec",
    "events",
    "logs",
    "node",
    # The commands' optional ``capability`` (a scoped peer's, ``control/scope.py``).
    "capability",
)


class InternalError(BottlenetError):
    """Something unexpected failed inside the daemon; details are only in its log."""

    code = "INTERNAL"


class UnsupportedProtocol(BottlenetError):
    """Client and daemon share no protocol version."""

    code = "UNSUPPORTED_PROTOCOL"


CONTROL_ERRORS: tuple[type[BottlenetError], ...] = (
    *ALL_ERRORS,
    InternalError,
    UnsupportedProtocol,
)


class RecordList(amp.Argument, Generic[R]):
    """An AMP argument holding a list of records as one compact JSON value (< 64 KiB)."""

    def __init__(self, record: type[R], optional: bool = False) -> None:
        super().__init__(optional=optional)
        self.record = record

    def toString(self, inObject: list[R]) -> bytes:
        data = encode_records(list(inObject))
        if len(data) > MAX_VALUE_LENGTH:
            raise amp.TooLong(False, True, data, None)
        return data

    def fromString(self, inString: bytes) -> list[R]:
        return decode_records(inString, self.record)


class Record(amp.Argument, Generic[R]):
    """An AMP argument holding one record as compact JSON."""

    def __init__(self, record: type[R], optional: bool = False) -> None:
        super().__init__(optional=optional)
        self.record = record
        self._list = RecordList(record)

    def toString(self, inObject: R) -> bytes:
        return self._list.toString([inObject])[1:-1]

    def fromString(self, inString: bytes) -> R:
        items = self._list.fromString(b"[" + inString + b"]")
        if len(items) != 1:
            raise RecordError("expected exactly one record")
        return items[0]


ERROR_BY_CODE: dict[str, type[BottlenetError]] = {e.code: e for e in CONTROL_ERRORS}

_INT_RE = re.compile(rb"-?(?:0|[1-9][0-9]{0,18})")


class StrictInteger(amp.Argument):
    """``amp.Integer``'s encoding with a strict decoder.

    ``int()`` accepts blanks, ``+``, ``_`` separators and unbounded digit strings; we accept
    only a canonical decimal that fits in 64 bits.
    """

    def fromString(self, inString: bytes) -> int:
        if not _INT_RE.fullmatch(inString):
            raise ValueError("not a canonical decimal integer")
        return int(inString)

    def toString(self, inObject: int) -> bytes:
        return b"%d" % (inObject,)


_FLOAT_RE = re.compile(rb"-?(?:0|[1-9][0-9]{0,14})(?:\.[0-9]{1,17})?(?:[eE][-+]?[0-9]{1,3})?")


class StrictFloat(amp.Argument):
    """A finite decimal (``amp.Float`` takes ``nan``, ``inf`` and blanks)."""

    def fromString(self, inString: bytes) -> float:
        if not _FLOAT_RE.fullmatch(inString):
            raise ValueError("not a finite decimal number")
        value = float(inString)
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("not a finite decimal number")
        return value

    def toString(self, inObject: float) -> bytes:
        return repr(float(inObject)).encode("ascii")


class StrictBoolean(amp.Boolean):
    def fromString(self, inString: bytes) -> bool:
        if inString == b"True":
            return True
        if inString == b"False":
            return False
        raise ValueError("not a boolean")


class StrictListOf(amp.ListOf):
    """``amp.ListOf``'s encoding; the stock decoder silently drops a truncated tail."""

    def fromString(self, inString: bytes) -> list[Any]:
        out = []
        pos = 0
        while pos < len(inString):
            if pos + 2 > len(inString):
                raise ValueError("truncated list")
            size = int.from_bytes(inString[pos : pos + 2], "big")
            end = pos + 2 + size
            if end > len(inString):
                raise ValueError("truncated list")
            out.append(self.elementType.fromString(inString[pos + 2 : end]))
            pos = end
        return out


def _page_arguments() -> list[tuple[bytes, amp.Argument]]:
    return [
        (b"offset", StrictInteger(optional=True)),
        (b"limit", StrictInteger(optional=True)),
    ]


def _page_response(key: bytes, arg: amp.Argument) -> list[tuple[bytes, amp.Argument]]:
    return [
        (key, arg),
        (b"total", StrictInteger()),
        (b"next_offset", StrictInteger(optional=True)),
    ]


def _capability() -> tuple[bytes, amp.Argument]:
    """A scoped peer's capability for the bottles it names (``control/scope.py``): optional,
    ignored for a peer with full control."""
    return (b"capability", amp.Unicode(optional=True))


class ControlCommand(amp.Command):
    """Base of every bottlenet command: maps every typed error code both ways.

    ``pace`` is the client-side policy (as amp's ``requiresAnswer``): whether a call waits on
    smolvm, so clients give it the VM timeout (:func:`bottlenet.control.calls.is_slow`).
    """

    commandName = b"bottlenet.ControlCommand"
    errors = {cls: cls.code.encode("ascii") for cls in CONTROL_ERRORS}
    pace: ClassVar[Pace] = Pace.QUICK


class Hello(ControlCommand):
    """First call on a connection: negotiate the protocol version, learn features."""

    commandName = b"bottlenet.Hello"
    arguments = [
        (b"client_version", amp.Unicode()),
        (b"protocols", StrictListOf(StrictInteger())),
    ]
    response = [
        (b"server_version", amp.Unicode()),
        (b"protocol", StrictInteger()),
        (b"features", StrictListOf(amp.Unicode())),
        (b"smolvm_available", StrictBoolean()),
        (b"smolvm_version", amp.Unicode(optional=True)),
        # Which binary, and where it came from (--smolvm, PATH or the bottlenet[vm] wheel).
        (b"smolvm_source", amp.Unicode(optional=True)),
        # False for a smolvm outside the tested versions (vmctl.smolvm.TESTED_VERSIONS).
        (b"smolvm_tested", StrictBoolean(optional=True)),
        # The versions bottlenet is tested with ("1.32.2", ...), for that message.
        (b"smolvm_tested_versions", StrictListOf(amp.Unicode(), optional=True)),
        # smolvm's privilege model for this daemon: "per-VM uids" or "one uid", as seen at
        # the last VM start, else as expected from the daemon's uid; the basis says which.
        (b"vm_uids", amp.Unicode(optional=True)),
        (b"vm_uids_basis", amp.Unicode(optional=True)),
        # bottlenet's guest kit: "ready: kit ...", "building", or why not and the fallback.
        (b"guest_kit", amp.Unicode(optional=True)),
        # The ready kit's program at its fixed guest path (a guest command is it plus one
        # of its subcommands); absent while no kit is ready.
        (b"guest_kit_argv", StrictListOf(amp.Unicode(), optional=True)),
    ]


class Ping(ControlCommand):
    """Liveness check; answers an empty box."""

    commandName = b"bottlenet.Ping"
    arguments = []
    response = []


class CreateBottle(ControlCommand):
    """Create a bottle: forward-only, or with VMs when ``spec`` (a JSON bottle spec) is given.

    The alias (forward-only bottles) is drawn from the pool when omitted; a VM bottle has none.
    """

    commandName = b"bottlenet.CreateBottle"
    pace = Pace.VM_WITH_SPEC
    arguments = [
        (b"name", amp.Unicode()),
        (b"alias", amp.Unicode(optional=True)),
        (b"spec", amp.Unicode(optional=True)),
        # Its owner label, and a lease: reaped unless renewed (``RenewLease``) in time.
        (b"owner", amp.Unicode(optional=True)),
        (b"lease_seconds", StrictFloat(optional=True)),
        _capability(),
        # Added later: whether it may take a warm pool's member of its spec: "auto" (the
        # default), "off" or "only" (``bottles/pooled.py``).
        (b"pool", amp.Unicode(optional=True)),
    ]
    response = [(b"bottle", Record(BottleRecord))]


class DestroyBottle(ControlCommand):
    commandName = b"bottlenet.DestroyBottle"
    pace = Pace.VM
    arguments = [(b"name", amp.Unicode()), _capability()]
    response = []


class ListBottles(ControlCommand):
    commandName = b"bottlenet.ListBottles"
    arguments = [*_page_arguments(), _capability()]
    response = _page_response(b"bottles", RecordList(BottleRecord))


class BottleStatus(ControlCommand):
    commandName = b"bottlenet.BottleStatus"
    arguments = [(b"name", amp.Unicode()), _capability()]
    response = [(b"bottle", Record(BottleRecord))]


class AddForward(ControlCommand):
    """Add a forward; answers the real agent endpoint (port 0 = kernel-chosen)."""

    commandName = b"bottlenet.AddForward"
    arguments = [
        (b"bottle", amp.Unicode()),
        (b"label", amp.Unicode()),
        (b"target", amp.Unicode()),
        (b"port", StrictInteger(optional=True)),
        _capability(),
    ]
    response = [
        (b"forward", Record(ForwardRecord)),
        (b"host", amp.Unicode(optional=True)),
        (b"port", StrictInteger(optional=True)),
        (b"path", amp.Unicode(optional=True)),
    ]


class RemoveForward(ControlCommand):
    commandName = b"bottlenet.RemoveForward"
    arguments = [
        (b"bottle", amp.Unicode()),
        (b"label", amp.Unicode()),
        _capability(),
    ]
    response = []


class ListForwards(ControlCommand):
    commandName = b"bottlenet.ListForwards"
    arguments = [(b"bottle", amp.Unicode(optional=True)), *_page_arguments(), _capability()]
    response = _page_response(b"forwards", RecordList(ForwardRecord))


class VerifyBottle(ControlCommand):
    """Run the isolation probe in the bottle's agent VM again (ISOLATION_FAILED on a leak)."""

    commandName = b"bottlenet.VerifyBottle"
    pace = Pace.VM
    arguments = [(b"name", amp.Unicode()), _capability()]
    response = [
        (b"bottle", Record(BottleRecord)),
        (b"result", amp.Unicode()),
    ]


class SetEgressPolicy(ControlCommand):
    """Replace a VM bottle's egress allow-list (recorded only once the sidecar reloaded it)."""

    commandName = b"bottlenet.SetEgressPolicy"
    pace = Pace.VM
    arguments = [
        (b"bottle", amp.Unicode()),
        (b"allow_hosts", StrictListOf(amp.Unicode())),
        _capability(),
    ]
    response = [(b"allow_hosts", StrictListOf(amp.Unicode()))]


class Stats(ControlCommand):
    commandName = b"bottlenet.Stats"
    arguments = [(b"bottle", amp.Unicode(optional=True)), *_page_arguments(), _capability()]
    response = _page_response(b"stats", RecordList(StatsRecord))


class Exec(ControlCommand):
    """Run a command in a VM bottle's agent VM; the answer switches the connection.

    After the answer the connection carries only the frames of
    :mod:`bottlenet.control.stream` (stdin, resize; stdout, stderr, exit), never AMP again.
    ``stdin`` forwards the client's input (``-i``); ``tty`` gives the command a terminal of
    ``rows`` x ``cols`` (``-t``). It must be the only command in flight on its connection.
    ``fds`` asks for the command's stdio as file descriptors (granted, ``fds`` in the answer,
    on a UNIX socket without a terminal); ``time_limit`` ends the command after that many
    seconds (exit code 124).
    """

    commandName = b"bottlenet.Exec"
    pace = Pace.VM
    arguments = [
        (b"bottle", amp.Unicode()),
        (b"argv", StrictListOf(amp.Unicode())),
        (b"env", StrictListOf(amp.Unicode(), optional=True)),
        (b"user", amp.Unicode(optional=True)),
        (b"workdir", amp.Unicode(optional=True)),
        (b"stdin", StrictBoolean(optional=True)),
        (b"tty", StrictBoolean(optional=True)),
        (b"rows", StrictInteger(optional=True)),
        (b"cols", StrictInteger(optional=True)),
        (b"fds", StrictBoolean(optional=True)),
        (b"time_limit", StrictInteger(optional=True)),
        _capability(),
    ]
    response = [(b"tty", StrictBoolean()), (b"fds", StrictBoolean(optional=True))]


class Logs(ControlCommand):
    """The workload's output (its last ``tail`` lines; ``follow`` keeps printing): the answer
    switches the connection to exec frames, as ``Exec`` does (STDOUT, STDERR, EXIT)."""

    commandName = b"bottlenet.Logs"
    pace = Pace.VM
    arguments = [
        (b"bottle", amp.Unicode()),
        (b"tail", StrictInteger(optional=True)),
        (b"follow", StrictBoolean(optional=True)),
        _capability(),
    ]
    response = []


class Watch(ControlCommand):
    """Subscribe this connection to bottle events: the daemon then calls ``Event`` on it.

    Each connection has a bounded backlog of unanswered events; a watcher that stops
    answering is disconnected, never buffered without limit.
    """

    commandName = b"bottlenet.Watch"
    arguments = [(b"bottle", amp.Unicode(optional=True)), _capability()]
    response = [(b"seq", StrictInteger())]


class Leftovers(ControlCommand):
    """What a bottle that no longer exists left on the host (its machines in smolvm's own
    listing, its directory, per-VM uid reservations and processes no machine holds): one line
    each, none when the teardown was complete. ``bottlenetctl selftest`` asks it last."""

    commandName = b"bottlenet.Leftovers"
    pace = Pace.VM
    arguments = [(b"name", amp.Unicode())]
    response = [(b"leftovers", StrictListOf(amp.Unicode()))]


class Event(ControlCommand):
    """Daemon to client: one bottle event (answered with an empty box)."""

    commandName = b"bottlenet.Event"
    arguments = [(b"event", Record(EventRecord))]
    response = []


class RenewLease(ControlCommand):
    """Extend a bottle's lease to ``seconds`` from now (a bottle created with one)."""

    commandName = b"bottlenet.RenewLease"
    arguments = [(b"name", amp.Unicode()), (b"seconds", StrictFloat()), _capability()]
    response = [(b"bottle", Record(BottleRecord))]


class NodeInfo(ControlCommand):
    """This node for a placer: identity, labels, whether VM bottles can run, capacity, health,
    draining (``bottlenet.node.info``)."""

    commandName = b"bottlenet.NodeInfo"
    arguments = [_capability()]
    response = [
        (b"server_version", amp.Unicode()),
        (b"protocol", StrictInteger()),
        (b"host", amp.Unicode()),
        (b"labels", StrictListOf(amp.Unicode())),  # "KEY=VALUE", sorted by key
        (b"privilege", amp.Unicode()),
        (b"smolvm", amp.Unicode(optional=True)),
        # False when ``smolvm`` is outside the tested versions (vmctl.smolvm.TESTED_VERSIONS).
        (b"smolvm_tested", StrictBoolean(optional=True)),
        (b"vm_possible", StrictBoolean()),
        (b"vm_why_not", amp.Unicode(optional=True)),
        (b"kvm", amp.Unicode()),
        (b"max_bottles", StrictInteger()),
        (b"bottles", StrictInteger()),
        (b"vm_bottles", StrictInteger()),
        (b"connections_used", StrictInteger()),
        (b"connections_total", StrictInteger()),
        (b"health", amp.Unicode()),
        (b"health_reasons", StrictListOf(amp.Unicode())),
        (b"draining", StrictBoolean()),
        # Added later (absent from an older daemon): per-VM uids left, and in words.
        (b"vm_uids_left", StrictInteger(optional=True)),
        (b"vm_uids", amp.Unicode(optional=True)),
        # Added later: the warm pools (their members count against max_bottles, not bottles).
        (b"pools", RecordList(PoolRecord, optional=True)),
    ]


class EnsurePool(ControlCommand):
    """Keep ``size`` bottles of the spec (JSON) booted, gated and bridged for the creates of
    that spec to take (``node/pools.py``); a pool's new size (0: none kept). Durable."""

    commandName = b"bottlenet.EnsurePool"
    arguments = [(b"spec", amp.Unicode()), (b"size", StrictInteger())]
    response = [(b"pool", Record(PoolRecord))]


class ListPools(ControlCommand):
    """The warm pools: spec hash, size, ready, filling, failed."""

    commandName = b"bottlenet.ListPools"
    arguments = []
    response = [(b"pools", RecordList(PoolRecord))]


class RemovePool(ControlCommand):
    """Forget the pool of a spec hash; its waiting members are destroyed (how many)."""

    commandName = b"bottlenet.RemovePool"
    arguments = [(b"spec_hash", amp.Unicode())]
    response = [(b"destroyed", StrictInteger())]


class Drain(ControlCommand):
    """Refuse new bottles (``DRAINING``) from now on, durably; with ``wait``, answer once the
    node holds no bottle or ``timeout`` seconds passed (``empty`` says which)."""

    commandName = b"bottlenet.Drain"
    pace = Pace.WAIT
    arguments = [
        (b"wait", StrictBoolean(optional=True)),
        (b"timeout", StrictFloat(optional=True)),
    ]
    response = [
        (b"draining", StrictBoolean()),
        (b"held", StrictInteger()),
        (b"empty", StrictBoolean()),
    ]


class Undrain(ControlCommand):
    """Take new bottles again."""

    commandName = b"bottlenet.Undrain"
    arguments = []
    response = [(b"draining", StrictBoolean())]


ALL_COMMANDS: tuple[type[ControlCommand], ...] = (
    Hello,
    Ping,
    CreateBottle,
    DestroyBottle,
    ListBottles,
    BottleStatus,
    AddForward,
    RemoveForward,
    ListForwards,
    Stats,
    VerifyBottle,
    SetEgressPolicy,
    Exec,
    Logs,
    Watch,
    NodeInfo,
    Drain,
    Undrain,
    RenewLease,
    Leftovers,
    EnsurePool,
    ListPools,
    RemovePool,
)
#: Commands the daemon calls on its clients (the client answers them).
PUSHED_COMMANDS: tuple[type[ControlCommand], ...] = (Event,)
MUTATING_COMMANDS: frozenset[type[ControlCommand]] = frozenset(
    {
        CreateBottle,
        DestroyBottle,
        AddForward,
        RemoveForward,
        VerifyBottle,
        SetEgressPolicy,
        Drain,
        Undrain,
        RenewLease,
        EnsurePool,
        RemovePool,
    }
)


def short_name(command: type[amp.Command]) -> str:
    """A command's name without ``bottlenet.``, as a :class:`~.calls.Call` names it."""
    return command.commandName.decode("ascii").removeprefix("bottlenet.")


#: Every command by its short name.
BY_NAME: dict[str, type[ControlCommand]] = {
    short_name(c): c for c in (*ALL_COMMANDS, *PUSHED_COMMANDS)
}
