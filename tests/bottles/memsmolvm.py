"""An in-memory stand-in for ``vmctl.smolvm.Smolvm`` and a rig that drives the bottles layer.

``MemorySmolvm`` is a TEST DOUBLE of vmctl's typed smolvm API (not of the CLI: that is
``tests/fakes/smolvm``): machines live in a dict, every call answers with an already-fired
Deferred and is recorded, and a test injects failures per (call, machine). It checks specs
with vmctl's own ``validate_spec`` so a spec smolvm would refuse still fails here.

``Rig`` builds the real ``VMLifecycle``, ``BottleRegistry``, ``ForwardTable``, ``StateStore``
and ``Recovery`` on a ``Clock`` reactor (procmon's test style: ``twisted.runner.test.
test_procmon``): listeners are real sockets bound on loopback aliases and in the state dir, the
reactor only records readers, and ``rig.run(coro)`` advances the clock until the coroutine is
done, so every create, rollback and recovery runs synchronously in a few milliseconds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar, cast

from attrs import define, evolve, field
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from bottlenet.bottles.lifecycle import VMLifecycle, VMOptions
from bottlenet.bottles.recovery import Recovery
from bottlenet.bottles.registry import BottleRegistry
from bottlenet.bottles.store import StateStore
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import AliasPool
from bottlenet.forward.table import ForwardTable
from vmctl.errors import AlreadyExists, NotFound, VmctlError
from vmctl.ports import Ownership, PortCheck
from vmctl.smolvm import ExecResult, Machine, Smolvm, SmolvmVersion
from vmctl.spec import MachineSpec, validate_spec

T = TypeVar("T")

POOL = "127.79.0.0/24"
#: What the probe's argv starts with (``ProbePlan.argv``).
PROBE_ARGV = ["/bin/sh", "-s", "--"]
PROBE_PASS = b"RESULT PASS\n"


@define
class MemMachine:
    spec: MachineSpec
    state: str = "stopped"
    pid: int | None = None

    def record(self) -> Machine:
        return Machine(self.spec.name, self.state, pid=self.pid, labels=dict(self.spec.labels))


ExecHandler = Callable[[str, Sequence[str], bytes | None], ExecResult | None]


@define
class MemorySmolvm:
    """The subset of :class:`vmctl.smolvm.Smolvm` the bottles layer calls, in memory."""

    version_text: str = "1.9.2"
    machines: dict[str, MemMachine] = field(factory=dict)
    #: Every call: (method, machine name or "").
    calls: list[tuple[str, str]] = field(factory=list)
    #: (method, machine) -> the VmctlError that call raises (once per entry, or always).
    faults: dict[tuple[str, str], VmctlError] = field(factory=dict)
    #: Decides an exec's result (None: the default: probe passes, everything else exits 0).
    on_exec: ExecHandler | None = None
    #: The pid a started machine gets: a live process (ours), so pid watches hold.
    pid: int = field(factory=os.getpid)
    execs: list[tuple[str, list[str]]] = field(factory=list)

    @property
    def known_version(self) -> SmolvmVersion:
        return SmolvmVersion.parse(f"smolvm {self.version_text}\n".encode())

    def version(self) -> Deferred[SmolvmVersion]:
        return succeed(self.known_version)

    def fail_on(self, method: str, machine: str, error: VmctlError) -> None:
        self.faults[(method, machine)] = error

    def _call(self, method: str, name: str) -> Failure | None:
        self.calls.append((method, name))
        error = self.faults.get((method, name))
        return Failure(error) if error is not None else None

    def create(self, spec: MachineSpec) -> Deferred[None]:
        failure = self._call("create", spec.name)
        if failure is not None:
            return fail(failure)
        try:
            validate_spec(spec, check_paths=False)
        except VmctlError as e:
            return fail(e)
        if spec.name in self.machines:
            return fail(AlreadyExists(f"machine {spec.name} already exists"))
        self.machines[spec.name] = MemMachine(spec)
        return succeed(None)

    def _machine(self, name: str) -> MemMachine:
        try:
            return self.machines[name]
        except KeyError:
            raise NotFound(f"machine {name} not found") from None

    def start(self, name: str) -> Deferred[int | None]:
        failure = self._call("start", name)
        if failure is not None:
            return fail(failure)
        try:
            m = self._machine(name)
        except VmctlError as e:
            return fail(e)
        m.state, m.pid = "running", self.pid
        return succeed(m.pid)

    def stop(self, name: str) -> Deferred[None]:
        failure = self._call("stop", name)
        if failure is not None:
            return fail(failure)
        try:
            m = self._machine(name)
        except VmctlError as e:
            return fail(e)
        m.state, m.pid = "stopped", None
        return succeed(None)

    def delete(self, name: str) -> Deferred[None]:
        failure = self._call("delete", name)
        if failure is not None:
            return fail(failure)
        if self.machines.pop(name, None) is None:
            return fail(NotFound(f"machine {name} not found"))
        return succeed(None)

    def status(self, name: str) -> Deferred[Machine]:
        failure = self._call("status", name)
        if failure is not None:
            return fail(failure)
        try:
            return succeed(self._machine(name).record())
        except VmctlError as e:
            return fail(e)

    def list(self, labels: Mapping[str, str] | None = None) -> Deferred[list[Machine]]:
        failure = self._call("list", "")
        if failure is not None:
            return fail(failure)
        want = dict(labels or {})
        found = [
            m.record()
            for m in self.machines.values()
            if all(dict(m.spec.labels).get(k) == v for k, v in want.items())
        ]
        return succeed(found)

    def exec(
        self,
        name: str,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
        detach: bool = False,
        timeout: float | None = None,
    ) -> Deferred[ExecResult]:
        failure = self._call("exec", name)
        if failure is not None:
            return fail(failure)
        try:
            m = self._machine(name)
        except VmctlError as e:
            return fail(e)
        if m.state != "running":
            return fail(NotFound(f"machine {name} is not running"))
        self.execs.append((name, list(argv)))
        result = self.on_exec(name, argv, stdin) if self.on_exec is not None else None
        if result is None:
            out = PROBE_PASS if list(argv[:3]) == PROBE_ARGV else b""
            result = ExecResult(0, out, b"", 0.0)
        return succeed(result)

    def names(self) -> list[str]:
        return sorted(self.machines)


def exits(code: int, stdout: bytes = b"") -> ExecResult:
    return ExecResult(code, stdout, b"", 0.0)


class FDClock(Clock):
    """A Clock that is also enough of an ``IReactorFDSet`` for real listening ports: it
    records readers and writers and never polls them (no byte flows in these tests)."""

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
        self.vms = VMLifecycle(
            self.clock,
            cast(Smolvm, self.smolvm),
            self.table,
            self.aliases,
            state_dir=state_dir,
            options=self.options,
            check_port=owned,
        )
        self.vms.iptables_argv = lambda alias: ["/bin/true"]
        self.registry = BottleRegistry(
            self.clock,
            self.table,
            self.aliases,
            state_dir=state_dir,
            max_bottles=max_bottles,
            store=self.store,
            instance_id=self.instance_id,
            vms=self.vms,
        )

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` to its end on the clock; its exception is raised here."""
        d = Deferred.fromCoroutine(coro)
        for _ in range(1000):
            if d.called:
                break
            self.clock.advance(0)
        results: list[Any] = []
        d.addBoth(results.append)
        assert results, "the operation never finished (it waits on something the rig lacks)"
        result = results[0]
        if isinstance(result, Failure):
            result.raiseException()
        return cast(T, result)

    def recover(self) -> Recovery:
        """Recovery of the state file as it is on disk, with this rig's parts."""
        recovery = Recovery(self.registry, self.vms, self.store.load(), self.state_dir)
        self.run(recovery.run())
        return recovery

    def close(self) -> None:
        """Stop every listener and watch (the sockets are real)."""
        self.vms.unwatch_all()
        self.run(_stop(self.table))

    def state(self) -> dict[str, Any]:
        return dict(StateStore(self.state_dir).load().bottles)


async def _stop(table: ForwardTable) -> None:
    for info in table.list():
        await table.remove(info.spec.bottle, info.spec.label)
