"""Each control call declared once: a typed request value that every client runs.

A :class:`Call` names its command, carries its arguments and converts the answer into the
caller's type. Whether a call is slow (it waits on smolvm, so it gets the VM timeout instead of
the default) follows from :data:`PACE`, the one table of per-command client policy, through
:func:`is_slow`, the one slow-command rule: a caller passes a timeout only to override it. The
async client runs a call as ``call(c) -> Deferred[T]``; the blocking and the light client as
``call(c) -> T`` (as AMP's one ``callRemote``). ``bottlenetctl`` runs every call that way; the
blocking and async clients keep their named methods (``create_bottle`` ...), one-line wrappers
around the builders below, for launchers (``docs/protocol.md``); the light client has none.

This module imports neither AMP nor attrs: ``bottlenetctl``'s light commands read it at start.
``tests/control/test_calls.py`` checks :data:`PACE` against the ``pace`` each Command class of
:mod:`bottlenet.control.commands` declares.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from bottlenet.control.results import (
    AgentEndpoint,
    DrainResult,
    HelloResult,
    NodeInfoRecord,
    Page,
)

if TYPE_CHECKING:
    from bottlenet.control.execsession import ExecSession
    from bottlenet.control.records import BottleRecord, ForwardRecord, PoolRecord, StatsRecord

T = TypeVar("T")

#: Seconds a call may take unless it is slow or the caller says otherwise.
DEFAULT_TIMEOUT = 10.0
#: Seconds a slow call may take (it waits on smolvm: create with a spec, destroy, verify,
#: egress, exec's and logs' start).
VM_TIMEOUT = 300.0
#: The protocol versions the clients speak.
SUPPORTED_PROTOCOLS = (1,)


class Pace(StrEnum):
    """How long a command may keep its caller waiting."""

    QUICK = "quick"  # answered from the daemon's own state
    VM = "vm"  # waits on smolvm
    VM_WITH_SPEC = "vm-with-spec"  # waits on smolvm when it carries a spec (CreateBottle)
    WAIT = "wait"  # with ``wait``, as long as its own ``timeout`` argument says (Drain)


#: Every command by its short name (``bottlenet.`` dropped) -> its pace.
PACE: Mapping[str, Pace] = {
    "Hello": Pace.QUICK,
    "Ping": Pace.QUICK,
    "CreateBottle": Pace.VM_WITH_SPEC,
    "DestroyBottle": Pace.VM,
    "ListBottles": Pace.QUICK,
    "BottleStatus": Pace.QUICK,
    "AddForward": Pace.QUICK,
    "RemoveForward": Pace.QUICK,
    "ListForwards": Pace.QUICK,
    "Stats": Pace.QUICK,
    "VerifyBottle": Pace.VM,
    "SetEgressPolicy": Pace.VM,
    "Exec": Pace.VM,
    "Logs": Pace.VM,
    "Watch": Pace.QUICK,
    "Event": Pace.QUICK,
    "NodeInfo": Pace.QUICK,
    "Drain": Pace.WAIT,
    "Undrain": Pace.QUICK,
    "RenewLease": Pace.QUICK,
    "Leftovers": Pace.VM,
    "EnsurePool": Pace.QUICK,
    "ListPools": Pace.QUICK,
    "RemovePool": Pace.QUICK,
}
#: The commands that take a scoped peer's ``capability`` (``control/scope.py``): every one
#: about bottles. A client made with a capability gives it to each of them.
CAPABILITY_COMMANDS = frozenset(
    {
        "CreateBottle",
        "DestroyBottle",
        "ListBottles",
        "BottleStatus",
        "AddForward",
        "RemoveForward",
        "ListForwards",
        "Stats",
        "VerifyBottle",
        "SetEgressPolicy",
        "Exec",
        "Logs",
        "Watch",
        "NodeInfo",
        "RenewLease",
    }
)
#: The daemon's longest ``Drain`` wait (``node.info.MAX_DRAIN_WAIT``), and a wait's
#: without a ``timeout``.
MAX_WAIT = 7 * 86400.0


def is_slow(command: str, arguments: Mapping[str, Any]) -> bool:
    """The slow-command rule: ``command`` with ``arguments`` gets the VM timeout."""
    pace = PACE[command]
    return pace is Pace.VM or (pace is Pace.VM_WITH_SPEC and bool(arguments.get("spec")))


class Call(NamedTuple, Generic[T]):
    """One request: the command's short name, its arguments (None: left out, as optional)
    and the conversion of its answer (the decoded values by key) into a ``T``."""

    command: str
    arguments: dict[str, Any]
    convert: Callable[[dict[str, Any]], T]

    @property
    def slow(self) -> bool:
        return is_slow(self.command, self.arguments)

    def limit(self, timeout: float, vm_timeout: float) -> float:
        """The seconds this call may take with a client's ``timeout`` and ``vm_timeout``
        (a call that waits: its own wait, and ``timeout`` more for the answer)."""
        if PACE[self.command] is Pace.WAIT and self.arguments.get("wait"):
            wait = self.arguments.get("timeout")
            return min(MAX_WAIT if wait is None else float(wait), MAX_WAIT) + timeout
        return vm_timeout if self.slow else timeout


def presenting(c: Call[T], capability: str | None) -> Call[T]:
    """``c`` with ``capability`` among its arguments, where its command takes one and it has
    none of its own (None: ``c`` as it is)."""
    if capability is None or c.command not in CAPABILITY_COMMANDS:
        return c
    if c.arguments.get("capability") is not None:
        return c
    return c._replace(arguments={**c.arguments, "capability": capability})


def raw(command: str, arguments: Mapping[str, Any]) -> Call[dict[str, Any]]:
    """A call that answers the decoded values themselves (for a caller that names a Command)."""
    return Call(command, dict(arguments), dict)


def _none(answer: dict[str, Any]) -> None:
    return None


def _bottle(answer: dict[str, Any]) -> BottleRecord:
    bottle: BottleRecord = answer["bottle"]
    return bottle


def _verified(answer: dict[str, Any]) -> tuple[BottleRecord, str]:
    return answer["bottle"], answer["result"]


def _hosts(answer: dict[str, Any]) -> tuple[str, ...]:
    return tuple(answer["allow_hosts"])


def _page(key: str) -> Callable[[dict[str, Any]], Page[Any]]:
    return lambda answer: Page.from_answer(answer, key)


def _total(answer: dict[str, Any]) -> int:
    total: int = answer["total"]
    return total


def _seq(answer: dict[str, Any]) -> int:
    return int(answer["seq"])


def _fds(answer: dict[str, Any]) -> bool:
    return bool(answer.get("fds"))


# -- the calls ---------------------------------------------------------------------------


def hello(client_version: str) -> Call[HelloResult]:
    arguments = {"client_version": client_version, "protocols": list(SUPPORTED_PROTOCOLS)}
    return Call("Hello", arguments, HelloResult.from_answer)


def ping() -> Call[None]:
    return Call("Ping", {}, _none)


def create_bottle(
    name: str,
    alias: str | None = None,
    spec: str | None = None,
    owner: str | None = None,
    lease_seconds: float | None = None,
    pool: str | None = None,
) -> Call[BottleRecord]:
    """``spec`` is the bottle spec as JSON text (None: a forward-only bottle); ``owner`` a
    label, ``lease_seconds`` a lease the owner renews (``renew_lease``) or the bottle goes;
    ``pool`` whether it may take a warm pool's member of its spec (``auto``, the default
    when None, ``off`` or ``only``)."""
    arguments = {
        "name": name,
        "alias": alias,
        "spec": spec,
        "owner": owner,
        "lease_seconds": lease_seconds,
        "pool": pool,
    }
    return Call("CreateBottle", arguments, _bottle)


def renew_lease(name: str, seconds: float) -> Call[BottleRecord]:
    """The bottle's lease, ``seconds`` from now."""
    return Call("RenewLease", {"name": name, "seconds": seconds}, _bottle)


def verify_bottle(name: str) -> Call[tuple[BottleRecord, str]]:
    return Call("VerifyBottle", {"name": name}, _verified)


def set_egress_policy(bottle: str, hosts: Sequence[str]) -> Call[tuple[str, ...]]:
    return Call("SetEgressPolicy", {"bottle": bottle, "allow_hosts": list(hosts)}, _hosts)


def destroy_bottle(name: str) -> Call[None]:
    return Call("DestroyBottle", {"name": name}, _none)


def list_bottles(offset: int = 0, limit: int | None = None) -> Call[Page[BottleRecord]]:
    return Call("ListBottles", {"offset": offset, "limit": limit}, _page("bottles"))


def count_bottles() -> Call[int]:
    """How many bottles the daemon has (one short page; only its total is read)."""
    return Call("ListBottles", {"offset": 0, "limit": 1}, _total)


def bottle_status(name: str) -> Call[BottleRecord]:
    return Call("BottleStatus", {"name": name}, _bottle)


def add_forward(bottle: str, label: str, target: str, port: int = 0) -> Call[AgentEndpoint]:
    arguments = {"bottle": bottle, "label": label, "target": target, "port": port}
    return Call("AddForward", arguments, AgentEndpoint.from_answer)


def remove_forward(bottle: str, label: str) -> Call[None]:
    return Call("RemoveForward", {"bottle": bottle, "label": label}, _none)


def list_forwards(
    bottle: str | None = None, offset: int = 0, limit: int | None = None
) -> Call[Page[ForwardRecord]]:
    arguments = {"bottle": bottle, "offset": offset, "limit": limit}
    return Call("ListForwards", arguments, _page("forwards"))


def stats(
    bottle: str | None = None, offset: int = 0, limit: int | None = None
) -> Call[Page[StatsRecord]]:
    return Call("Stats", {"bottle": bottle, "offset": offset, "limit": limit}, _page("stats"))


def watch(bottle: str | None = None) -> Call[int]:
    """Subscribe the connection to bottle events; answers the daemon's current seq."""
    return Call("Watch", {"bottle": bottle}, _seq)


def node_info() -> Call[NodeInfoRecord]:
    """This node for a placer: identity, capacity, health, draining."""
    return Call("NodeInfo", {}, NodeInfoRecord.from_answer)


def drain(wait: bool = False, timeout: float | None = None) -> Call[DrainResult]:
    """Refuse new bottles; with ``wait``, answer once none is held (or ``timeout`` passed)."""
    return Call("Drain", {"wait": wait or None, "timeout": timeout}, DrainResult.from_answer)


def undrain() -> Call[None]:
    return Call("Undrain", {}, _none)


def ensure_pool(spec: str, size: int) -> Call[PoolRecord]:
    """Keep ``size`` bottles of ``spec`` (JSON text) ready for creates of that spec."""
    return Call("EnsurePool", {"spec": spec, "size": size}, _pool)


def list_pools() -> Call[tuple[PoolRecord, ...]]:
    return Call("ListPools", {}, _pools)


def remove_pool(spec_hash: str) -> Call[int]:
    """Forget the pool of ``spec_hash``; how many of its bottles were destroyed."""
    return Call("RemovePool", {"spec_hash": spec_hash}, _destroyed)


def _pool(answer: dict[str, Any]) -> PoolRecord:
    record: PoolRecord = answer["pool"]
    return record


def _pools(answer: dict[str, Any]) -> tuple[PoolRecord, ...]:
    return tuple(answer["pools"])


def _destroyed(answer: dict[str, Any]) -> int:
    return int(answer["destroyed"])


def _lines(answer: dict[str, Any]) -> tuple[str, ...]:
    return tuple(answer["leftovers"])


def leftovers(name: str) -> Call[tuple[str, ...]]:
    return Call("Leftovers", {"name": name}, _lines)


def logs(bottle: str, tail: int | None = None, follow: bool = False) -> Call[bool]:
    """The workload's output; the answer switches the connection to exec frames."""
    return Call("Logs", {"bottle": bottle, "tail": tail, "follow": follow}, _fds)


class ExecRequest(NamedTuple):
    """One exec as a client asks for it: ``argv`` in ``bottle``'s agent VM.

    ``stdin``: forward input; ``tty``: a terminal of ``size`` (rows, cols); ``fds``: on a
    UNIX socket without a terminal, take the command's stdio pipes from the daemon (False:
    frames through the daemon); ``time_limit``: the daemon ends the command after that many
    seconds (exit code 124)."""

    bottle: str
    argv: tuple[str, ...]
    env: tuple[str, ...] = ()
    user: str | None = None
    workdir: str | None = None
    stdin: bool = False
    tty: bool = False
    size: tuple[int, int] | None = None
    fds: bool = True
    time_limit: int | None = None

    def call(self, *, local: bool) -> Call[bool]:
        """The Exec call on a ``local`` (UNIX) socket or not; it answers whether the stdio
        came as file descriptors (they travel only over a UNIX socket, never with a tty)."""
        rows, cols = self.size if self.size is not None else (None, None)
        arguments = {
            "bottle": self.bottle,
            "argv": list(self.argv),
            "env": list(self.env) or None,
            "user": self.user,
            "workdir": self.workdir,
            "stdin": self.stdin,
            "tty": self.tty,
            "rows": rows,
            "cols": cols,
            "fds": (self.fds and local and not self.tty) or None,
            "time_limit": self.time_limit,
        }
        return Call("Exec", arguments, _fds)


class ExecOpener:
    """``open_exec`` written once for the clients that start exec sessions (blocking, light):
    each implements :meth:`start_exec`."""

    def start_exec(self, request: ExecRequest, *, timeout: float | None = None) -> ExecSession:
        raise NotImplementedError

    def open_exec(
        self,
        bottle: str,
        argv: Sequence[str],
        *,
        env: Sequence[str] = (),
        user: str | None = None,
        workdir: str | None = None,
        stdin: bool = False,
        tty: bool = False,
        size: tuple[int, int] | None = None,
        timeout: float | None = None,
        fds: bool = True,
        time_limit: int | None = None,
    ) -> ExecSession:
        """Start ``argv`` in the bottle's agent VM (the fields of :class:`ExecRequest`)."""
        request = ExecRequest(
            bottle, tuple(argv), tuple(env), user, workdir, stdin, tty, size, fds, time_limit
        )
        return self.start_exec(request, timeout=timeout)


def every_item(fetch: Callable[[int], Page[T]]) -> Iterator[T]:
    """Every item of a paged listing, for a blocking client: ``fetch(offset)`` is one page;
    asks again while ``next_offset`` is not None."""
    offset: int | None = 0
    while offset is not None:
        page = fetch(offset)
        yield from page.items
        offset = page.next_offset
