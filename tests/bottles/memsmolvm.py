"""An in-memory stand-in for ``vmctl.smolvm.Smolvm`` and a rig that drives the bottles layer.

``MemorySmolvm`` is a TEST DOUBLE of vmctl's typed smolvm API (not of the CLI: that is
``tests/fakes/smolvm``): machines live in a dict, every call answers with an already-fired
Deferred and is recorded, and a test injects failures per (call, machine). It checks specs
with vmctl's own ``validate_spec`` so a spec smolvm would refuse still fails here.

``Rig`` builds the real ``VMHost``, ``BottleRegistry``, ``ForwardTable``, ``StateStore``
and ``Recovery`` on a ``Clock`` reactor (procmon's test style: ``twisted.runner.test.
test_procmon``): listeners are real sockets bound on loopback aliases and in the state dir, the
reactor only records readers, and ``rig.run(coro)`` advances the clock until the coroutine is
done, so every create, rollback and recovery runs synchronously in a few milliseconds.
"""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar, cast

from attrs import define, evolve, field
from twisted.internet.defer import Deferred, fail, maybeDeferred, succeed
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from bottlenet.bottles import workload
from bottlenet.bottles.bottle import VMBottle
from bottlenet.bottles.events import EventBus
from bottlenet.bottles.host import VMOptions, vm_host
from bottlenet.bottles.policy import Policies
from bottlenet.bottles.recovery import Recovery
from bottlenet.bottles.registry import BottleRegistry
from bottlenet.bottles.store import StateStore
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import AliasPool
from bottlenet.forward.table import ForwardTable
from bottlenet.node.info import Node, node_parts
from bottlenet.probe.script import ARGV
from tests.probe.guests import pass_transcript, witness_own_endpoints
from vmctl.errors import AlreadyExists, NotFound, VmctlError
from vmctl.ports import Ownership, PortCheck
from vmctl.smolvm import ExecResult, Features, Machine, Smolvm, SmolvmVersion, UidReservation
from vmctl.spec import DEFAULT_DEVICE_BUDGET, MachineSpec, validate_spec
from vmctl.uids import FIRST_VM_UID, UidEnd, UidSupply

T = TypeVar("T")

POOL = "127.79.0.0/24"
#: The gate's argv (the script itself comes on stdin).
PROBE_ARGV = list(ARGV)


@define
class MemMachine:
    spec: MachineSpec
    state: str = "stopped"
    pid: int | None = None
    #: What a 1.37 record says of ``--block-private`` (None: a 1.32 record, silent on it).
    floor: tuple[str, ...] | None = None
    #: smolvm's ``machine run`` makes ephemeral machines (bottlenet never does).
    ephemeral: bool = False

    def record(self) -> Machine:
        return Machine(
            self.spec.name,
            self.state,
            pid=self.pid,
            labels=dict(self.spec.labels),
            ephemeral=self.ephemeral,
            block_private=self.floor,
            reports_floor=self.floor is not None,
        )


#: ``MemorySmolvm.started_as``: make the ``.vm-uid`` a FIFO.
FIFO = "\0fifo"

ExecHandler = Callable[[str, Sequence[str], bytes | None], ExecResult | None]


@define
class MemorySmolvm:
    """The subset of :class:`vmctl.smolvm.Smolvm` the bottles layer calls, in memory."""

    version_text: str = "1.32.2"
    #: smolvm's virtio device budget per VM (``Smolvm.device_budget``).
    device_budget: int = DEFAULT_DEVICE_BUDGET
    machines: dict[str, MemMachine] = field(factory=dict)
    #: Every call: (method, machine name or "").
    calls: list[tuple[str, str]] = field(factory=list)
    #: (method, machine) -> the VmctlError that call raises (once per entry, or always).
    faults: dict[tuple[str, str], VmctlError] = field(factory=dict)
    #: Decides an exec's result (None: the default: the guest answers the gate, else exit 0).
    on_exec: ExecHandler | None = None
    #: Answers the gate's script when ``on_exec`` does not (the Rig's honest guest).
    guest: Callable[[bytes], ExecResult] | None = None
    #: The pid a started machine gets: a live process (ours), so pid watches hold.
    pid: int = field(factory=os.getpid)
    execs: list[tuple[str, list[str]]] = field(factory=list)
    #: The ``user`` (``-u``) of each exec in ``execs`` (None: smolvm's default user).
    exec_users: list[str | None] = field(factory=list)
    #: What the image's USER is (``uid:gid``), as an exec without ``-u`` reads it.
    image_user: str = "0:0"
    holds: dict[tuple[str, str], Deferred[None]] = field(factory=dict)
    #: smolvm's per-VM uid registry as a map (machine -> uid): the per-VM uid rules run
    #: without root. ``vm_root`` holds each VM's directory (its ``.vm-uid``) when set.
    uids: dict[str, int] = field(factory=dict)
    next_uid: int = 2_000_000
    #: The read-write volumes each reserved uid was given (``reserve_uid``'s ``volumes``).
    uid_volumes: dict[int, tuple[str, ...]] = field(factory=dict)
    vm_root: str = ""
    #: What ``start`` writes to a machine's ``.vm-uid`` instead of its reserved uid (a
    #: smolvm that did not honour the reservation, or a VMM that rewrote its file).
    started_as: dict[str, str] = field(factory=dict)
    #: With ``bind_exposed``, a started machine's "VMM" binds its ``--expose-socket`` host
    #: paths (real sockets, closed at stop), as smolvm's does.
    bind_exposed: bool = False
    exposed: dict[str, list[socket.socket]] = field(factory=dict)

    @property
    def known_version(self) -> SmolvmVersion:
        return SmolvmVersion.parse(f"smolvm {self.version_text}\n".encode())

    def version(self) -> Deferred[SmolvmVersion]:
        return succeed(self.known_version)

    @property
    def features(self) -> Features:
        """Every optional flag of the 1.32 reference (the contract tests pin the real set)."""
        return Features(
            error_format_json=True,
            state_dir=True,
            expose_socket=True,
            user=True,
            exec_timeout=True,
            exec_user=True,
            block_private=True,
        )

    def fail_on(self, method: str, machine: str, error: VmctlError) -> None:
        """``method`` on ``machine`` fails with ``error`` (``*-ROLE``: on every machine of that
        role, e.g. ``*-sidecar``: a warm pool's members have names of their own)."""
        self.faults[(method, machine)] = error

    def hold(self, method: str, machine: str) -> Deferred[None]:
        """Make the next such call wait until the returned Deferred is fired (a slow call)."""
        gate: Deferred[None] = Deferred()
        self.holds[(method, machine)] = gate
        return gate

    def _answer(self, method: str, name: str, body: Callable[[], T]) -> Deferred[T]:
        """Record the call, then the injected fault, else ``body()`` (its VmctlError fails)."""
        self.calls.append((method, name))
        gate = self.holds.pop((method, name), None)
        if gate is not None:
            return gate.addCallback(lambda _: self._result(method, name, body))
        return self._result(method, name, body)

    def _result(self, method: str, name: str, body: Callable[[], T]) -> Deferred[T]:
        error = self.faults.get((method, name))
        if error is None and "-" in name:
            error = self.faults.get((method, "*-" + name.rsplit("-", 1)[1]))
        try:
            if error is not None:
                raise error
            return succeed(body())
        except VmctlError as e:
            return fail(e)

    def _machine(self, name: str) -> MemMachine:
        try:
            return self.machines[name]
        except KeyError:
            raise NotFound(f"machine {name} not found") from None

    def create(self, spec: MachineSpec) -> Deferred[None]:
        def create() -> None:
            validate_spec(spec, self.device_budget, check_paths=False)
            if spec.name in self.machines:
                raise AlreadyExists(f"machine {spec.name} already exists")
            self.machines[spec.name] = MemMachine(spec)

        return self._answer("create", spec.name, create)

    def start(self, name: str) -> Deferred[int | None]:
        def start() -> int | None:
            m = self._machine(name)
            m.state, m.pid = "running", self.pid
            if self.bind_exposed:
                self.exposed[name] = [_bound(e.host) for e in m.spec.expose_sockets]
            if name in self.uids and self.vm_root:  # as smolvm: .vm-uid before the drop
                text = self.started_as.get(name, str(self.uids[name]))
                path = os.path.join(self.vm_dir(name), ".vm-uid")
                if text == FIFO:
                    os.mkfifo(path)  # a quick VMM's FIFO (the file is its uid's)
                else:
                    with open(path, "w") as fh:
                        fh.write(text)
            return m.pid

        return self._answer("start", name, start)

    def stop(self, name: str) -> Deferred[None]:
        def stop() -> None:
            m = self._machine(name)
            m.state, m.pid = "stopped", None
            for sock in self.exposed.pop(name, []):
                sock.close()

        return self._answer("stop", name, stop)

    def delete(self, name: str) -> Deferred[None]:
        def delete() -> None:
            self._machine(name)
            del self.machines[name]
            self.uids.pop(name, None)  # smolvm frees the registry entry

        return self._answer("delete", name, delete)

    def remove(self, name: str) -> Deferred[bool]:
        """Stop, then delete, as :meth:`vmctl.smolvm.Smolvm.remove` does; True if it existed."""

        async def go() -> bool:
            try:
                await self.stop(name)
            except NotFound:
                return False
            except VmctlError:
                pass
            try:
                await self.delete(name)
            except NotFound:
                return False
            return True

        return Deferred.fromCoroutine(go())

    def status(self, name: str) -> Deferred[Machine]:
        return self._answer("status", name, lambda: self._machine(name).record())

    def list(
        self, labels: Mapping[str, str] | None = None, *, include_ephemeral: bool = False
    ) -> Deferred[list[Machine]]:
        """The machines carrying every ``labels`` pair; ephemeral ones only when asked (as
        ``Smolvm.list``)."""
        want = dict(labels or {})

        def listing() -> list[Machine]:
            return [
                m.record()
                for m in self.machines.values()
                if (include_ephemeral or not m.ephemeral)
                and all(dict(m.spec.labels).get(k) == v for k, v in want.items())
            ]

        return self._answer("list", "", listing)

    def exec(
        self,
        name: str,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
        detach: bool = False,
        timeout: float | None = None,
        user: str | None = None,
        session: Sequence[str] = (),
    ) -> Deferred[ExecResult]:
        def run() -> ExecResult:
            if self._machine(name).state != "running":
                raise NotFound(f"machine {name} is not running")
            self.execs.append((name, list(argv)))
            self.exec_users.append(user)
            result = self.on_exec(name, argv, stdin) if self.on_exec is not None else None
            if result is None:
                if list(argv) == PROBE_ARGV and self.guest is not None:
                    return self.guest(stdin or b"")
                if list(argv) == workload.IMAGE_USER_ARGV:  # a root image's USER
                    return ExecResult(0, self.image_user.encode() + b"\n", b"", 0.0)
                result = ExecResult(0, b"", b"", 0.0)
            return result

        return self._answer("exec", name, run)

    def names(self) -> list[str]:
        return sorted(self.machines)

    def vm_dir(self, name: str) -> str:
        path = os.path.join(self.vm_root, name)
        os.makedirs(path, exist_ok=True)
        return path

    def reserve_uid(self, name: str, volumes: Sequence[str] = ()) -> Deferred[UidReservation]:
        """A uid from the map (the entry naming the VM, else the next one: never reused)."""

        def reserve() -> UidReservation:
            self._machine(name)
            if name not in self.uids:
                self.uids[name] = self.next_uid
                self.next_uid += 1
            self.uid_volumes[self.uids[name]] = tuple(volumes)
            return UidReservation(self.uids[name], self.vm_root, self.vm_dir(name))

        return self._answer("reserve_uid", name, reserve)

    def vmm_uid(self, name: str) -> Deferred[int | None]:
        return self._answer("vmm_uid", name, lambda: self.uids.get(name))

    def end_uid(self, uid: int) -> Deferred[UidEnd]:
        """Recorded (as ``("end_uid", "<uid>")``): the processes of a per-VM uid ended."""
        return self._answer("end_uid", str(uid), UidEnd)

    def retire_uid(self, uid: int, prove: bool = False) -> Deferred[bool]:
        """Recorded (as ``("retire_uid", "<uid>")`` or ``"<uid> prove"``); never freed here."""
        return self._answer("retire_uid", f"{uid}{' prove' if prove else ''}", lambda: False)

    def uid_supply(self) -> Deferred[UidSupply]:
        """Counted from the map: every uid handed out is used (the real count is vmctl's)."""
        used = self.next_uid - FIRST_VM_UID
        return succeed(UidSupply(left=65_536 - used, retired=0, held=used, blocks=(1,)))


def _bound(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    sock.listen(8)
    return sock


def exits(code: int, stdout: bytes = b"") -> ExecResult:
    return ExecResult(code, stdout, b"", 0.0)


#: The gate's outside address as the Rig's lifecycle plans it (never dialled: nothing here is).
OUTSIDE = "tcp:1.1.1.1:443"


def leak(name: str, argv: Sequence[str], stdin: bytes | None) -> ExecResult | None:
    """An ``on_exec`` whose isolation probe finds the outside address reachable."""
    if list(argv) == PROBE_ARGV:
        return exits(*pass_transcript(stdin or b"", leaks=(OUTSIDE,)))
    return None


class FDClock(Clock):
    """A Clock that is also enough of an ``IReactorFDSet`` for real listening ports: it
    records readers and writers and polls them only when a test says so (:meth:`poll`)."""

    def __init__(self) -> None:
        super().__init__()
        self.readers: set[Any] = set()
        self.writers: set[Any] = set()

    def addReader(self, reader: Any) -> None:
        self.readers.add(reader)

    def removeReader(self, reader: Any) -> None:
        self.readers.discard(reader)

    def addWriter(self, writer: Any) -> None:
        self.writers.add(writer)

    def removeWriter(self, writer: Any) -> None:
        self.writers.discard(writer)

    def removeAll(self) -> list[Any]:
        gone = list(self.readers | self.writers)
        self.readers.clear()
        self.writers.clear()
        return gone

    def getReaders(self) -> list[Any]:
        return list(self.readers)

    def poll(self, timeout: float) -> int:
        """One turn of a reactor's fd loop: wait up to ``timeout`` for a reader to be
        readable (a pidfd whose process exited), then read each that is; how many were."""
        ready, _, _ = select.select(list(self.readers), [], [], timeout)
        for reader in ready:
            reader.doRead()
        return len(ready)

    def getWriters(self) -> list[Any]:
        return list(self.writers)


def owned(port: int, pid: int) -> PortCheck:
    return PortCheck(port, pid, Ownership.OWNED)


class Rig:
    """The bottles layer, real parts on a clock, with the in-memory smolvm."""

    def __init__(
        self,
        state_dir: str,
        *,
        smolvm: MemorySmolvm | None = None,
        options: VMOptions | None = None,
        instance_id: str = "",
        max_bottles: int = 256,
    ) -> None:
        self.state_dir = state_dir
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        #: Sidecar service targets that never answer, and every target tried.
        self.silent: set[str | int] = set()
        self.probed: list[str | int] = []
        self.clock = FDClock()
        self.smolvm = smolvm or MemorySmolvm()
        self.store = StateStore(state_dir)
        state = self.store.load()
        if not os.path.exists(self.store.path):
            self.store.save(state)
        self.instance_id = instance_id or state.instance_id
        self.aliases = AliasRegistry(AliasPool.parse(POOL))
        self.table = ForwardTable(self.clock, self.aliases, state_dir=state_dir, engine="portable")
        self.options = options or VMOptions(instance_id=self.instance_id)
        self.options = evolve(self.options, instance_id=self.instance_id)
        self.host = vm_host(
            self.clock,
            cast(Smolvm, self.smolvm),
            self.table,
            self.aliases,
            state_dir=state_dir,
            options=self.options,
            check_port=owned,
            check_socket=lambda path, pid: PortCheck(0, pid, Ownership.OWNED),
            service_ready=self.answers,
            blocking=maybeDeferred,  # a Clock has no thread pool: run them in line
        )
        if self.smolvm.guest is None:
            self.smolvm.guest = self.honest_guest
        self.max_bottles = max_bottles
        #: The bottles' events (the wire's feed) and the node's policies the table tells.
        self.events = EventBus()
        self.policies = Policies()
        self.registry = self._registry()

    def _registry(self) -> BottleRegistry:
        return BottleRegistry(
            self.clock,
            self.table,
            self.aliases,
            state_dir=self.state_dir,
            max_bottles=self.max_bottles,
            store=self.store,
            instance_id=self.instance_id,
            host=self.host,
            events=self.events,
            policies=self.policies,
        )

    def use(self, policies: Policies | None = None, **parts: Any) -> None:
        """The host with ``parts`` in place of its own (an injected check, smolvm or access),
        or the node's ``policies``, and a registry over them: only before the first bottle."""
        assert not self.registry.list_bottles(), "parts are swapped only on an empty rig"
        self.host = evolve(self.host, **parts)
        self.policies = policies or self.policies
        self.registry = self._registry()

    async def answers(self, reactor: Any, target: str | int) -> bool:
        """A sidecar service answers unless the test named its socket or port ``silent``
        (the real probe connects: ``bottles/readiness.py``)."""
        self.probed.append(target)
        return target not in self.silent

    def honest_guest(self, script: bytes) -> ExecResult:
        """A guest that is isolated: it reaches its own endpoints (the host's witness sees
        the nonce) and nothing else."""
        witness_own_endpoints(self.table)
        return exits(*pass_transcript(script))

    def start(self, coro: Coroutine[Any, Any, T]) -> Deferred[T]:
        """Start ``coro`` and run the clock until it is done or waits on a held call."""
        d = Deferred.fromCoroutine(coro)
        self.settle(d)
        return d

    def settle(self, d: Deferred[Any] | None = None) -> None:
        """Fire every call that is due now (port closes are ``callLater(0)``), until ``d``
        has its result or nothing is due."""
        for _ in range(1000):
            if d is not None and d.called:
                return
            now = self.clock.seconds()
            if not any(c.getTime() <= now for c in self.clock.getDelayedCalls()):
                return
            self.clock.advance(0)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` to its end on the clock; its exception is raised here."""
        return self.result(self.start(coro))

    def result(self, d: Deferred[T]) -> T:
        """The outcome of ``d`` (settling the clock first); its failure is raised here."""
        self.settle(d)
        results: list[Any] = []
        d.addBoth(results.append)
        assert results, "the operation never finished (it waits on something the rig lacks)"
        result = results[0]
        if isinstance(result, Failure):
            result.raiseException()
        return cast(T, result)

    def recover(self) -> None:
        """Run recovery of the state file as it is on disk, with this rig's parts."""
        self.run(self.recover_later())

    async def recover_later(self) -> None:
        await Recovery(self.registry, self.host, self.store.load(), self.state_dir).run()

    def close(self) -> None:
        """Stop every listener and watch (the sockets are real)."""
        self.registry.stop()
        self.run(_stop(self.table))

    def state(self) -> dict[str, Any]:
        return dict(StateStore(self.state_dir).load().bottles)

    def watched(self) -> frozenset[str]:
        """The bottles whose sidecar VM is watched now (each VM bottle's owner holds its own
        watch; one left behind by a bottle no longer listed still shows in ``clock.readers``)."""
        names = [b.name for b in self.registry.list_bottles() if b.vms is not None]
        return frozenset(n for n in names if self.registry.owner(n, VMBottle).watched)


async def _stop(table: ForwardTable) -> None:
    for info in table.list():
        await table.remove(info.spec.bottle, info.spec.label)


def node_of(rig: Rig, monotonic: Callable[[], float] | None = None, grace: float = 30) -> Node:
    """The node as the daemon builds it over this rig's state, its policies told by the
    rig's table (``monotonic``: the lease policy's clock, by default the rig's)."""
    parts = node_parts(
        rig.clock,
        rig.store,
        StateStore(rig.state_dir).load(),
        rig.events.emit,
        monotonic=monotonic or rig.clock.seconds,
        lease_grace=grace,
    )
    rig.use(policies=parts.policies())
    return Node(
        rig.registry, rig.table.budget, parts, host="n1", labels=(("zone", "a"),), privilege="root"
    )
