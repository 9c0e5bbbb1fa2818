"""A failure at every step of create rolls back everything done so far (unit seam).

The real ``VMHost``, ``BottleRegistry``, ``ForwardTable`` (real listening sockets) and
``StateStore`` run on a clock with the in-memory smolvm API (``tests/bottles/memsmolvm.py``,
a test double), so each case takes milliseconds. Each step is failed twice over: by a fault
the smolvm double injects where it can, and by wrapping the lifecycle's own step function so
it fails right *after* doing its work (so that step's own undo is exercised too). The same
path through the fake smolvm executable is kept end to end in ``test_vm_e2e.py``.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
from twisted.internet.defer import Deferred, fail
from twisted.logger import Logger, formatEvent

from bottlenet.bottles import workload as guest_workload
from bottlenet.bottles.creation import Creation
from bottlenet.bottles.host import VMOptions
from bottlenet.bottles.spec import BottleSpec, parse_bottle_spec
from bottlenet.errors import BindRefused, BottlenetError, BridgeFailed, SmolvmFailed
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import Rig, exits, leak
from vmctl.errors import KvmUnavailable
from vmctl.errors import SmolvmFailed as VmSmolvmFailed
from vmctl.ports import Ownership, PortCheck
from vmctl.smolvm import ExecResult

STEPS = (
    "step_allocate",
    "step_sidecar",
    "step_sidecar_ready",
    "step_bind",
    "step_egress",
    "step_agent",
)


def spec(tmp: str, name: str = "rb", **kw: Any) -> BottleSpec:
    kw.setdefault("mode", "socket")
    # Raw-port sidecars (the TCP opt-in): these seams pin the raw-port re-checks too; the
    # default exposed-socket sidecar is covered end to end through the fake smolvm.
    kw.setdefault("listen", "tcp")
    return parse_bottle_spec(name, spec_doc(tmp, **kw))


def create_fails(rig: Rig, code: str, bottle_spec: BottleSpec) -> BottlenetError:
    with pytest.raises(BottlenetError) as info:
        rig.run(rig.registry.create_bottle("rb", spec=bottle_spec))
    assert info.value.code == code, str(info.value)
    assert_nothing_left(rig)
    return info.value


def assert_nothing_left(rig: Rig) -> None:
    assert rig.smolvm.machines == {}
    assert rig.table.list() == []
    assert rig.clock.readers == set()  # no listener left polling
    assert not os.path.exists(os.path.join(rig.state_dir, "bottles", "rb"))
    assert rig.state() == {}
    assert rig.registry.list_bottles() == []
    assert rig.aliases.alias_of("rb") is None
    assert rig.registry.state_of("rb") is None  # no machine left: nothing in flight
    assert rig.watched() == frozenset()


def fail_after(monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    """Every create's ``step`` raises once it has done its work (its undo registered)."""
    original: Callable[..., Awaitable[None]] = getattr(Creation, step)

    async def wrapped(*args: Any) -> None:
        await original(*args)
        raise SmolvmFailed(f"injected after {step}")

    monkeypatch.setattr(Creation, step, wrapped)


def create_again(rig: Rig, bottle_spec: BottleSpec) -> None:
    """After a rollback the same name can be created (and destroyed) again."""
    b = rig.run(rig.registry.create_bottle("rb", spec=bottle_spec))
    assert b.state == "ready" and rig.state()["rb"]["kind"] == "vm"
    rig.run(rig.registry.destroy_bottle("rb"))
    assert_nothing_left(rig)


@pytest.mark.parametrize("step", STEPS)
def test_failure_after_each_step_socket_mode(
    rigs: Callable[..., Rig], tmp: str, step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = rigs()
    fail_after(monkeypatch, step)
    create_fails(rig, "SMOLVM_FAILED", spec(tmp))
    monkeypatch.undo()
    create_again(rig, spec(tmp))


def test_alias_mode_fails_closed_before_any_machine(rigs: Callable[..., Rig], tmp: str) -> None:
    """No smolvm mechanism confines a guest to one loopback alias: refused, nothing made."""
    rig = rigs()
    error = create_fails(rig, "ISOLATION_UNAVAILABLE", spec(tmp, mode="alias"))
    assert "alias" in error.message
    assert not [c for c in rig.smolvm.calls if c[0] in ("create", "start")]


def test_an_alias_for_a_vm_bottle_is_refused_before_any_machine(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """An alias belongs to forward-only bottles: with a VM spec it is INVALID_ARGUMENT."""
    rig = rigs()
    bottle_spec = spec(tmp)
    with pytest.raises(BottlenetError) as info:
        rig.run(
            rig.registry.create_bottle("rb", ipaddress.IPv4Address("127.77.0.9"), spec=bottle_spec)
        )
    assert info.value.code == "INVALID_ARGUMENT" and "--alias" in info.value.message
    assert_nothing_left(rig)
    assert not [c for c in rig.smolvm.calls if c[0] in ("create", "start")]


def test_sidecar_start_fails(
    rigs: Callable[..., Rig], tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error says the bottle was torn down, and the log gives the reason, not the code
    alone (issue 30: journald showed only ``KVM_UNAVAILABLE``)."""
    rig = rigs()
    events: list[dict[str, Any]] = []
    monkeypatch.setattr(Creation, "log", Logger(observer=events.append))
    rig.smolvm.fail_on("start", "bn-rb-sidecar", KvmUnavailable("injected: no KVM"))
    error = create_fails(rig, "KVM_UNAVAILABLE", spec(tmp))
    assert error.message == "injected: no KVM; bottle torn down"
    assert ("delete", "bn-rb-sidecar") in rig.smolvm.calls
    said = [formatEvent(e) for e in events]
    assert "bottle rb: create failed (KVM_UNAVAILABLE: injected: no KVM); rolling back" in said[0]


def test_a_failed_undo_is_no_torn_down_bottle(rigs: Callable[..., Rig], tmp: str) -> None:
    """An undo that fails turns "bottle torn down" into "teardown incomplete"."""
    rig = rigs()
    rig.smolvm.fail_on("start", "bn-rb-agent", KvmUnavailable("injected: no KVM"))
    rig.smolvm.fail_on("delete", "bn-rb-sidecar", VmSmolvmFailed("injected: stuck"))
    with pytest.raises(BottlenetError) as info:
        rig.run(rig.registry.create_bottle("rb", spec=spec(tmp)))
    assert info.value.message == ("injected: no KVM; teardown incomplete: see the daemon's log")


def test_raw_port_not_owned(rigs: Callable[..., Rig], tmp: str) -> None:
    rig = rigs()
    rig.use(check_port=lambda port, pid: PortCheck(port, pid, Ownership.FOREIGN, "injected"))
    error = create_fails(rig, "SMOLVM_FAILED", spec(tmp))
    assert "not held by its VM process" in error.message


def test_second_bind_refused(rigs: Callable[..., Rig], tmp: str) -> None:
    rig = rigs()
    original = rig.table.add
    calls = []

    def add(forward: Any) -> Deferred[Any]:
        calls.append(forward)
        if len(calls) == 2:
            return fail(BindRefused("cannot listen: injected"))
        return original(forward)

    rig.table.add = add  # type: ignore[method-assign]
    create_fails(rig, "BIND_REFUSED", spec(tmp))
    assert len(calls) == 2


def test_egress_reload_fails(rigs: Callable[..., Rig], tmp: str) -> None:
    rig = rigs()
    rig.smolvm.on_exec = lambda name, argv, stdin: exits(1) if argv[0] == "/bin/false" else None
    error = create_fails(rig, "SMOLVM_FAILED", spec(tmp, reload=("/bin/false",)))
    assert "reload" in error.message


def test_agent_start_fails(rigs: Callable[..., Rig], tmp: str) -> None:
    rig = rigs()
    rig.smolvm.fail_on("start", "bn-rb-agent", KvmUnavailable("injected: no KVM"))
    create_fails(rig, "KVM_UNAVAILABLE", spec(tmp))
    assert ("delete", "bn-rb-agent") in rig.smolvm.calls


def test_probe_fails(rigs: Callable[..., Rig], tmp: str) -> None:
    rig = rigs()
    rig.smolvm.on_exec = leak
    error = create_fails(rig, "ISOLATION_FAILED", spec(tmp))
    assert "leak: tcp:1.1.1.1:443" in error.message and "is reachable" in error.message


def test_workload_fails(rigs: Callable[..., Rig], tmp: str) -> None:
    rig = rigs(options=VMOptions(instance_id="", skip_probe=True))

    missing = ("/nonexistent/agent",)

    def workload(name: str, argv: Sequence[str], stdin: bytes | None) -> ExecResult | None:
        # the guest has no such command: bottlenet's prepare step says so (`command -v`)
        prepare = guest_workload.prepare_argv(missing, name)
        return exits(guest_workload.PREPARE_NOT_FOUND) if list(argv) == prepare else None

    rig.smolvm.on_exec = workload
    error = create_fails(rig, "SMOLVM_FAILED", spec(tmp, workload=missing))
    assert "workload" in error.message and "not found" in error.message
    assert not any(argv == guest_workload.wrap(missing, name) for name, argv in rig.smolvm.execs)


def test_workload_dir_cannot_be_made(rigs: Callable[..., Rig], tmp: str) -> None:
    """The workload's user cannot make its log directory: the create fails and rolls back
    (the detached wrapper would have started, written no exit code, and its waiter would have
    waited forever)."""
    rig = rigs(options=VMOptions(instance_id="", skip_probe=True))

    def workload(name: str, argv: Sequence[str], stdin: bytes | None) -> ExecResult | None:
        prepare = guest_workload.prepare_argv(("/agent",), name)
        return exits(guest_workload.PREPARE_NO_DIR) if list(argv) == prepare else None

    rig.smolvm.on_exec = workload
    error = create_fails(rig, "SMOLVM_FAILED", spec(tmp, workload=("/agent",)))
    assert "cannot create" in error.message and guest_workload.guest_dir("bn-rb-agent") in (
        error.message
    )
    assert not any(argv[:3] == guest_workload.wrap((), name)[:3] for name, argv in rig.smolvm.execs)


def test_workload_start_fails(rigs: Callable[..., Rig], tmp: str) -> None:
    rig = rigs(options=VMOptions(instance_id="", skip_probe=True))

    def workload(name: str, argv: Sequence[str], stdin: bytes | None) -> ExecResult | None:
        return exits(125) if list(argv) == guest_workload.wrap(("/agent",), name) else None

    rig.smolvm.on_exec = workload
    error = create_fails(rig, "SMOLVM_FAILED", spec(tmp, workload=("/agent",)))
    assert "starting the workload" in error.message and "exit 125" in error.message


def test_state_write_fails(rigs: Callable[..., Rig], tmp: str) -> None:
    rig = rigs()

    def broken(*args: object) -> None:
        raise OSError(28, "No space left on device")

    # A change writes one record (put); a full snapshot (save) is written by compaction.
    rig.store.put = broken  # type: ignore[method-assign]
    rig.store.save = broken  # type: ignore[method-assign]
    create_fails(rig, "UNAVAILABLE", spec(tmp))


class _Keeper:
    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


class _BridgesThatCannotProve:
    """The bridge starts (a keeper), then its proof fails: what a guest without the bottle's
    sockets mounted gives."""

    def __init__(self) -> None:
        self.kept: list[_Keeper] = []

    async def start(self, *args: Any, **kw: Any) -> _Keeper:
        self.kept.append(_Keeper())
        return self.kept[-1]

    async def prove(self, *args: Any, **kw: Any) -> None:
        raise BridgeFailed("the bridge does not reach 127.0.0.1:3128")


def test_a_create_that_fails_after_its_bridge_started_stops_the_bridge(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """The bridge's proof fails: the rollback stops the keeper the create started (it would
    restart a bridge into a deleted VM), and nothing of the bottle is left."""
    rig = rigs()
    bridges = _BridgesThatCannotProve()
    rig.use(bridges=bridges)
    create_fails(rig, "BRIDGE_FAILED", spec(tmp, bridge="bottlenet"))
    assert [k.stopped for k in bridges.kept] == [True]
