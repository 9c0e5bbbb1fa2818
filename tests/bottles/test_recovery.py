"""Recovery and the registry's VM operations, driven directly (unit seam, no daemon).

A restart is two rigs on one state directory sharing one in-memory smolvm (test double):
the machines survive, the first rig's listeners are closed, the second rig recovers. The
same restart through daemon processes and the fake smolvm executable (kill -9, bytes through
the restored sockets) stays in ``test_daemon_restart.py``.
"""

from __future__ import annotations

import copy
import ipaddress
import os
from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet.defer import Deferred, fail
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure

from bottlenet.bottles.bottle import VMBottle
from bottlenet.bottles.host import VMOptions
from bottlenet.bottles.model import LABEL_OWNER, Bottle, Source
from bottlenet.bottles.recovery import Recovery
from bottlenet.bottles.registry import RESYNC_INTERVAL
from bottlenet.bottles.spec import BottleSpec, parse_bottle_spec
from bottlenet.bottles.states import Lifecycle
from bottlenet.bottles.store import State, StateStore
from bottlenet.errors import (
    AlreadyExists,
    BindRefused,
    BottlenetError,
    Busy,
    Degraded,
    InvalidArgument,
    IsolationFailed,
    ResourceExhausted,
    Unavailable,
)
from bottlenet.forward.spec import TCPListen, UNIXListen, parse_target
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import MemMachine, Rig, exits, leak
from vmctl.errors import SmolvmFailed as VmSmolvmFailed
from vmctl.errors import SmolvmUnavailable
from vmctl.errors import Unavailable as VmUnavailable
from vmctl.ports import Ownership, PortCheck
from vmctl.smolvm import Machine
from vmctl.spec import MachineSpec

Rigs = Callable[..., Rig]


def spec(tmp: str, name: str = "r1", **kw: Any) -> BottleSpec:
    kw.setdefault("mode", "socket")
    # Raw-port sidecars (the TCP opt-in): these seams pin the raw-port re-checks too; the
    # default exposed-socket sidecar is covered end to end through the fake smolvm.
    kw.setdefault("listen", "tcp")
    return parse_bottle_spec(name, spec_doc(tmp, **kw))


def restart(rigs: Rigs, before: Rig, **kw: Any) -> Rig:
    """The daemon stops (listeners and watches go, machines stay) and starts again."""
    before.close()
    return rigs(smolvm=before.smolvm, **kw)


def endpoints(rig: Rig, bottle: str) -> list[str]:
    return [f.bound.describe() for f in rig.table.list(bottle)]


def vm_with_plain(rigs: Rigs, tmp: str) -> Rig:
    rig = rigs()
    rig.run(rig.registry.create_bottle("r1", spec=spec(tmp)))
    rig.run(rig.registry.create_bottle("plain", ipaddress.IPv4Address("127.79.0.5")))
    raw = rig.registry.get_bottle("r1").require_vms().raw_ports[0]
    rig.run(rig.registry.add_forward("plain", "web", parse_target(f"127.0.0.1:{raw}")))
    return rig


def test_restart_restores_vm_and_forward_only_bottles(rigs: Rigs, tmp: str) -> None:
    first = vm_with_plain(rigs, tmp)
    before = {n: endpoints(first, n) for n in ("r1", "plain")}
    bottle = first.registry.get_bottle("r1")
    owner = (LABEL_OWNER, first.instance_id)
    for name, labels in (
        ("orphan", (owner,)),
        ("foreign", ((LABEL_OWNER, "someoneelse"),)),
        ("unlabelled", ()),
    ):
        first.smolvm.machines[name] = MemMachine(MachineSpec(name, labels=labels))

    rig = restart(rigs, first)
    rig.recover()
    assert {n: endpoints(rig, n) for n in ("r1", "plain")} == before
    assert all(isinstance(f.bound, UNIXListen) for f in rig.table.list("r1"))
    again = rig.registry.get_bottle("r1")
    assert again == bottle and again.require_vms().env == bottle.require_vms().env
    assert rig.registry.get_bottle("plain").alias == "127.79.0.5"
    assert rig.smolvm.names() == ["bn-r1-agent", "bn-r1-sidecar", "foreign", "unlabelled"]
    assert sorted(rig.state()) == ["plain", "r1"]
    assert not rig.registry.recovering
    assert "r1" in rig.watched()  # the sidecar is watched again


def test_state_records_round_trip_through_recovery(rigs: Rigs, tmp: str) -> None:
    first = vm_with_plain(rigs, tmp)
    records = first.state()
    rig = restart(rigs, first)
    rig.recover()
    assert rig.state() == records  # nothing lost, nothing changed: same ports, same paths


def test_sidecar_gone_is_torn_down(rigs: Rigs, tmp: str) -> None:
    first = rigs()
    first.run(first.registry.create_bottle("r1", spec=spec(tmp)))
    first.smolvm.machines["bn-r1-sidecar"].state = "stopped"
    rig = restart(rigs, first)
    rig.recover()
    assert rig.registry.list_bottles() == []
    assert rig.smolvm.machines == {} and rig.table.list() == [] and rig.state() == {}
    assert not os.path.exists(os.path.join(rig.state_dir, "bottles", "r1"))


@pytest.mark.parametrize(("floor", "kept"), [(None, True), ((), True), (("10.0.0.0/8",), False)])
def test_a_sidecar_whose_listing_shows_no_whole_floor_is_torn_down(
    rigs: Rigs, tmp: str, floor: tuple[str, ...] | None, kept: bool
) -> None:
    """Where ``ls --json`` reports ``block_private`` (1.37), recovery checks it: the floor
    whole is kept, a re-opened range tears the bottle down; a 1.32 record (silent) is kept."""
    first = rigs()
    first.run(first.registry.create_bottle("r1", spec=spec(tmp)))
    first.smolvm.machines["bn-r1-sidecar"].floor = floor
    rig = restart(rigs, first)
    rig.recover()
    assert [b.name for b in rig.registry.list_bottles()] == (["r1"] if kept else [])


def test_a_137_record_without_block_private_means_no_floor() -> None:
    """1.37 shows ``block_private`` only on machines created with it: a 1.37 record (it has
    ``port_mappings``) without the key has no floor; a 1.32 record says nothing."""
    base = {"name": "m", "state": "running"}
    assert Machine.from_json({**base, "port_mappings": []}).floor_whole is False  # type: ignore[union-attr]
    assert Machine.from_json({**base, "port_mappings": [], "block_private": []}).floor_whole is True  # type: ignore[union-attr]
    assert Machine.from_json(base).floor_whole is None  # type: ignore[union-attr]


def test_raw_port_taken_over_is_torn_down(rigs: Rigs, tmp: str) -> None:
    first = rigs()
    first.run(first.registry.create_bottle("r1", spec=spec(tmp)))
    rig = restart(rigs, first)
    rig.use(check_port=lambda port, pid: PortCheck(port, pid, Ownership.FOREIGN, "x"))
    rig.recover()
    assert rig.registry.list_bottles() == [] and rig.smolvm.machines == {}


def test_unverifiable_ports_are_kept_only_when_allowed(rigs: Rigs, tmp: str) -> None:
    first = rigs()
    first.run(first.registry.create_bottle("r1", spec=spec(tmp)))
    rig = restart(rigs, first, options=VMOptions(instance_id="", allow_unverifiable_ports=True))
    rig.use(check_port=lambda port, pid: PortCheck(port, pid, Ownership.UNVERIFIABLE, "x"))
    rig.recover()
    assert [b.name for b in rig.registry.list_bottles()] == ["r1"]


def test_endpoint_that_cannot_be_rebound_tears_the_bottle_down(rigs: Rigs, tmp: str) -> None:
    first = rigs(options=VMOptions(instance_id="", skip_probe=True))
    first.run(first.registry.create_bottle("r1", spec=spec(tmp)))
    rig = restart(rigs, first)
    original = rig.table.add
    calls: list[Any] = []

    def add(forward: Any) -> Deferred[Any]:
        calls.append(forward)
        return fail(BindRefused("in use")) if len(calls) == 2 else original(forward)

    rig.table.add = add  # type: ignore[method-assign]
    rig.recover()
    assert len(calls) == 2 and isinstance(calls[0].listen, UNIXListen)
    assert rig.registry.list_bottles() == [] and rig.table.list() == []
    assert rig.smolvm.machines == {} and rig.aliases.alias_of("r1") is None


def test_teardown_failure_at_recovery_keeps_the_bottle_degraded(rigs: Rigs, tmp: str) -> None:
    """A bottle recovery cannot tear down is kept, degraded, and refuses an Exec."""
    first = rigs()
    first.run(first.registry.create_bottle("r1", spec=spec(tmp)))
    first.smolvm.machines["bn-r1-sidecar"].state = "stopped"
    rig = restart(rigs, first)
    rig.smolvm.fail_on("stop", "bn-r1-agent", VmUnavailable("injected"))
    rig.smolvm.fail_on("delete", "bn-r1-agent", VmUnavailable("injected"))
    rig.recover()
    (kept,) = rig.registry.list_bottles()
    assert kept.state == "degraded" and rig.state()["r1"]["state"] == "degraded"
    assert rig.table.list() == [] and "r1" not in rig.watched()
    # adopted idle in its kept state (its machine says so too): an Exec is DEGRADED
    assert rig.registry.state_of("r1") is Lifecycle.DEGRADED
    with pytest.raises(Degraded):
        rig.registry.exec_target("r1")


def test_without_a_listing_the_sidecar_pid_decides(rigs: Rigs, tmp: str) -> None:
    first = rigs()
    first.run(first.registry.create_bottle("r1", spec=spec(tmp)))
    rig = restart(rigs, first)
    rig.smolvm.fail_on("list", "", VmSmolvmFailed("injected"))
    rig.recover()  # our own pid stands in for the VMM: alive
    assert [b.name for b in rig.registry.list_bottles()] == ["r1"]
    assert len(rig.table.list("r1")) == 2


def test_malformed_and_shadowed_records(rigs: Rigs, tmp: str) -> None:
    first = vm_with_plain(rigs, tmp)
    first.close()
    # Edit the stored state as a whole (snapshot + journal) and write it back as a snapshot.
    store = StateStore(first.state_dir)
    state = store.load()
    bottles = dict(state.bottles)
    bottles["bad"] = {"kind": "forward", "alias": 7, "created_at": 1, "forwards": []}
    bottles["Bad Name"] = dict(bottles["plain"])
    store.save(State(state.instance_id, bottles))
    store.close()
    rig = rigs(smolvm=first.smolvm)
    rig.run(
        rig.registry.create_bottle(
            "plain", ipaddress.IPv4Address("127.79.0.9"), source=Source.CONFIG
        )
    )
    rig.recover()
    assert [b.name for b in rig.registry.list_bottles()] == ["plain", "r1"]
    assert rig.registry.get_bottle("plain").source == Source.CONFIG  # the config's wins
    assert sorted(rig.state()) == ["r1"]  # dropped and shadowed records are not kept


def test_forward_that_cannot_be_rebound_is_left_out(rigs: Rigs, tmp: str) -> None:
    first = vm_with_plain(rigs, tmp)
    rig = restart(rigs, first)
    original = rig.table.add

    def add(forward: Any) -> Deferred[Any]:
        if forward.label == "web":
            return fail(BindRefused("in use"))
        return original(forward)

    rig.table.add = add  # type: ignore[method-assign]
    rig.recover()
    assert rig.registry.get_bottle("plain").forwards == ()
    assert rig.state()["plain"]["forwards"] == []
    assert rig.table.list("plain") == []


# -- the registry's operations on VM bottles ----------------------------------------------


def test_sidecar_exit_degrades_the_bottle(rigs: Rigs, tmp: str) -> None:
    rig = rigs()
    rig.run(rig.registry.create_bottle("r1", spec=spec(tmp)))
    rig.registry.owner("r1", VMBottle).sidecar_exited()
    rig.clock.advance(0)
    b = rig.registry.get_bottle("r1")
    assert (b.state, b.detail) == ("degraded", "sidecar VM process exited")
    assert rig.table.list("r1") == [] and "r1" not in rig.watched()
    assert rig.state()["r1"]["state"] == "degraded"
    rig.run(rig.registry.destroy_bottle("r1"))
    assert rig.smolvm.machines == {} and rig.state() == {}


def test_verify_records_the_verdict(rigs: Rigs, tmp: str) -> None:
    rig = rigs()
    rig.run(rig.registry.create_bottle("r1", spec=spec(tmp)))
    b, verdict = rig.run(rig.registry.verify_bottle("r1"))
    assert verdict.passed and b.require_vms().probe == "PASS"
    rig.smolvm.on_exec = leak
    with pytest.raises(IsolationFailed, match="reachable"):
        rig.run(rig.registry.verify_bottle("r1"))
    assert rig.registry.get_bottle("r1").require_vms().probe == "FAIL"
    assert rig.state()["r1"]["probe"] == "FAIL"


def test_failed_reload_keeps_the_previous_policy(rigs: Rigs, tmp: str) -> None:
    rig = rigs()
    rig.run(rig.registry.create_bottle("r1", spec=spec(tmp)))
    hosts = ("example.org", "*.pypi.org")
    assert rig.run(rig.registry.set_egress_policy("r1", hosts)) == hosts
    assert rig.state()["r1"]["policy"] == list(hosts)
    reloads: list[int] = []

    def reload_fails_once(name: str, argv: Any, stdin: bytes | None) -> Any:
        if argv[0] == "/bin/true" and not reloads:
            reloads.append(1)
            return exits(1)
        return None

    rig.smolvm.on_exec = reload_fails_once
    with pytest.raises(BottlenetError, match="reload") as info:
        rig.run(rig.registry.set_egress_policy("r1", ("evil.example",)))
    assert info.value.code == "SMOLVM_FAILED"
    assert rig.registry.get_bottle("r1").require_vms().policy == hosts
    assert rig.state()["r1"]["policy"] == list(hosts)
    writes = [argv for name, argv in rig.smolvm.execs if argv[0] == "/bin/sh" and "-c" in argv]
    assert len(writes) == 4  # create, first policy, the failed one, the previous put back


def test_failed_teardown_leaves_a_degraded_bottle_to_destroy_again(rigs: Rigs, tmp: str) -> None:
    rig = rigs()
    rig.run(rig.registry.create_bottle("r1", spec=spec(tmp)))
    rig.smolvm.fail_on("delete", "bn-r1-sidecar", VmUnavailable("injected"))
    with pytest.raises(BottlenetError) as info:
        rig.run(rig.registry.destroy_bottle("r1"))
    assert info.value.code == "UNAVAILABLE"
    b = rig.registry.get_bottle("r1")
    assert (b.state, b.detail) == ("degraded", "teardown incomplete: UNAVAILABLE")
    assert rig.state()["r1"]["detail"] == "teardown incomplete: UNAVAILABLE"
    del rig.smolvm.faults[("delete", "bn-r1-sidecar")]
    rig.run(rig.registry.destroy_bottle("r1"))
    assert rig.smolvm.machines == {} and rig.state() == {} and rig.registry.list_bottles() == []


def test_names_limits_and_kinds(rigs: Rigs, tmp: str) -> None:
    rig = rigs(max_bottles=2)
    rig.run(rig.registry.create_bottle("r1", spec=spec(tmp)))
    with pytest.raises(AlreadyExists):
        rig.run(rig.registry.create_bottle("r1"))
    with pytest.raises(InvalidArgument, match="has VMs"):
        rig.run(rig.registry.add_forward("r1", "x", parse_target("127.0.0.1:1")))
    with pytest.raises(InvalidArgument, match="not r2"):
        rig.run(rig.registry.create_bottle("r2", spec=spec(tmp, name="r1")))
    rig.run(rig.registry.create_bottle("p1"))
    with pytest.raises(InvalidArgument, match="forward-only"):
        rig.run(rig.registry.verify_bottle("p1"))
    with pytest.raises(ResourceExhausted):
        rig.run(rig.registry.create_bottle("p2"))
    assert sorted(rig.state()) == ["p1", "r1"]


def test_forward_only_bottle_keeps_its_forwards_with_real_ports(rigs: Rigs, tmp: str) -> None:
    rig = rigs()
    rig.run(rig.registry.create_bottle("p1"))
    info = rig.run(rig.registry.add_forward("p1", "web", parse_target("127.0.0.1:9")))
    assert isinstance(info.bound, TCPListen) and info.bound.port != 0
    record = rig.state()["p1"]
    assert record["forwards"] == [
        {"label": "web", "target": "127.0.0.1:9", "port": info.bound.port}
    ]
    again = Bottle.from_state("p1", record, unix_root=rig.state_dir)
    assert again == rig.registry.get_bottle("p1")
    rig.run(rig.registry.remove_forward("p1", "web"))
    assert rig.state()["p1"]["forwards"] == [] and rig.table.list() == []
    rig.run(rig.registry.create_bottle("c1", source=Source.CONFIG))
    assert sorted(rig.state()) == ["p1"]  # config bottles are made again at start, not kept


# -- issue 13 item 9: recovery robustness ---------------------------------------------------


def test_a_file_or_symlink_in_bottles_is_left_alone_and_recovery_completes(
    rigs: Rigs, tmp: str
) -> None:
    """A regular file aborted recovery with a traceback (NotADirectoryError) and skipped its
    final save; a symlinked entry was followed and the sockets behind it unlinked."""
    import socket

    first = vm_with_plain(rigs, tmp)
    rig = restart(rigs, first)
    bottles = os.path.join(rig.state_dir, "bottles")
    with open(os.path.join(bottles, "junkfile"), "w") as f:
        f.write("junk")
    elsewhere = os.path.join(tmp, "elsewhere")
    os.mkdir(elsewhere)
    victim = os.path.join(elsewhere, "someone.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(victim)
    s.close()
    os.symlink(elsewhere, os.path.join(bottles, "evil"))
    rig.recover()
    assert sorted(b.name for b in rig.registry.list_bottles()) == ["plain", "r1"]
    assert not rig.registry.recovering
    assert os.path.exists(os.path.join(bottles, "junkfile"))
    assert os.path.islink(os.path.join(bottles, "evil")) and os.path.exists(victim)
    assert sorted(rig.state()) == ["plain", "r1"]  # the final save ran


def _stored(state_dir: str) -> dict[str, Any]:
    """The stored bottle records as a restarted daemon reads them (snapshot + journal)."""
    store = StateStore(state_dir)
    bottles = copy.deepcopy(dict(store.load().bottles))
    store.close()
    return bottles


def _store(state_dir: str, bottles: dict[str, Any]) -> None:
    """Write ``bottles`` back as the whole stored state (a snapshot), keeping the instance id."""
    store = StateStore(state_dir)
    store.save(State(store.load().instance_id, bottles))
    store.close()


@pytest.mark.parametrize("port", [True, "7006", 7007.9, None])
def test_a_persisted_port_is_an_integer_never_coerced(rigs: Rigs, tmp: str, port: Any) -> None:
    """``int()`` turned ``true`` into port 1 (bound as root), ``"7006"`` and ``7007.9`` too."""
    first = vm_with_plain(rigs, tmp)
    first.close()
    bottles = _stored(first.state_dir)
    bottles["plain"]["forwards"][0]["port"] = port
    _store(first.state_dir, bottles)
    rig = rigs(smolvm=first.smolvm)
    rig.recover()
    assert [b.name for b in rig.registry.list_bottles()] == ["r1"]
    assert rig.table.list("plain") == []


def test_teardown_at_recovery_deletes_only_machines_labelled_ours(rigs: Rigs, tmp: str) -> None:
    """The state file names the machines; recovery deletes one only when smolvm lists it with
    our owner label and this bottle's label (a rewritten state file cannot aim it elsewhere)."""
    first = rigs()
    first.run(first.registry.create_bottle("r1", spec=spec(tmp)))
    first.close()
    first.smolvm.machines["foreign"] = MemMachine(
        MachineSpec("foreign", labels=((LABEL_OWNER, "someoneelse"),)), state="running"
    )
    first.smolvm.machines["bn-r1-sidecar"].state = "stopped"  # the bottle is dead
    bottles = _stored(first.state_dir)
    bottles["r1"]["agent_vm"] = "foreign"
    _store(first.state_dir, bottles)
    rig = rigs(smolvm=first.smolvm)
    rig.recover()
    assert rig.registry.list_bottles() == []
    assert "foreign" in rig.smolvm.machines  # not ours: left alone
    assert "bn-r1-sidecar" not in rig.smolvm.machines  # ours and dead: deleted


def test_bottles_outside_a_changed_alias_pool_are_named_not_torn_down(rigs: Rigs, tmp: str) -> None:
    """``--alias-pool`` changed: the daemon refuses to start (tap) instead of recovery
    tearing the alias-mode VM bottles down and dropping the forward-only ones."""
    from bottlenet.bottles.recovery import aliases_outside
    from bottlenet.forward.spec import AliasPool

    first = vm_with_plain(rigs, tmp)
    state = first.store.load()
    assert aliases_outside(state, AliasPool.parse("127.79.0.0/16")) == []
    assert aliases_outside(state, AliasPool.parse("127.88.0.0/16")) == ["'plain' ('127.79.0.5')"]


def test_a_failed_recovery_never_reports_ready_and_stops_the_daemon(rigs: Rigs) -> None:
    """Recovery that raised still sent READY=1 (the state half-applied, its save skipped)."""
    from bottlenet.bottles.recovery import RecoveryService

    rig = rigs()
    recovery = Recovery(rig.registry, rig.host, rig.store.load(), rig.state_dir)

    async def broken() -> None:
        raise RuntimeError("injected")

    recovery.run = broken  # type: ignore[method-assign]
    fatal: list[str] = []
    service = RecoveryService(recovery, on_fatal=fatal.append)
    outcome: list[object] = []
    service.ready.addBoth(outcome.append)
    service.startService()
    rig.run(_settle())
    assert len(outcome) == 1 and isinstance(outcome[0], Failure)
    assert fatal == ["recovery failed; the state file was left as it was"]
    assert not rig.registry.recovering


async def _settle() -> None:
    pass


def test_t6_no_orphan_sweep_when_a_record_was_unreadable(rigs: Rigs, tmp: str) -> None:
    """T6: a VM bottle whose record cannot be read is not a reason to delete its machines
    as orphans: the sweep runs only on a state known good."""
    first = rigs()
    first.run(first.registry.create_bottle("r1", spec=spec(tmp)))
    first.close()
    bottles = _stored(first.state_dir)
    bottles["r1"]["alias"] = 7  # damaged: the record is dropped
    _store(first.state_dir, bottles)
    rig = rigs(smolvm=first.smolvm)
    rig.recover()
    assert rig.registry.list_bottles() == []
    assert {"bn-r1-agent", "bn-r1-sidecar"} <= set(rig.smolvm.names())


# -- the lifecycle machine, through the registry --------------------------------------------


def test_a_degrade_during_an_operation_outlasts_it(rigs: Rigs, tmp: str) -> None:
    """A sidecar that dies while verify runs leaves the bottle degraded once verify ends."""
    rig = rigs()
    rig.run(rig.registry.create_bottle("r1", spec=spec(tmp)))
    held = rig.smolvm.hold("exec", "bn-r1-agent")
    verify = rig.start(rig.registry.verify_bottle("r1"))
    assert rig.registry.state_of("r1") is Lifecycle.BUSY
    rig.registry.owner("r1", VMBottle).sidecar_exited()
    rig.clock.advance(0)
    assert rig.registry.state_of("r1") is Lifecycle.BUSY  # the operation still holds it
    with pytest.raises(Degraded):
        rig.registry.exec_target("r1")
    with pytest.raises(Busy):
        rig.run(rig.registry.destroy_bottle("r1"))
    held.callback(None)
    rig.result(verify)
    assert rig.registry.state_of("r1") is Lifecycle.DEGRADED
    assert rig.registry.get_bottle("r1").state == "degraded"
    assert rig.state()["r1"]["state"] == "degraded"


def test_a_degrade_that_fails_in_a_watch_callback_is_logged(rigs: Rigs, tmp: str) -> None:
    """Nobody awaits a watch's degrade: its failure is logged with the bottle, not dropped."""
    rig = rigs()
    rig.run(rig.registry.create_bottle("r1", spec=spec(tmp)))

    def broken(bottle: str) -> Deferred[None]:
        return fail(OSError("remove failed"))

    rig.table.remove_bottle = broken  # type: ignore[method-assign]
    with capturedLogs() as events:
        rig.registry.owner("r1", VMBottle).sidecar_exited()
        rig.clock.advance(0)
    failures = [e for e in events if "log_failure" in e]
    assert [(e["log_format"], e["bottle"]) for e in failures] == [
        ("bottle {bottle}: degrading it failed", "r1")
    ]
    assert isinstance(failures[0]["log_failure"].value, OSError)


def test_a_degraded_bottle_stays_degraded_and_says_so_once(rigs: Rigs, tmp: str) -> None:
    """A second failure and a late workload exit change nothing: one DEGRADED, first detail kept."""
    rig = rigs()
    rig.run(rig.registry.create_bottle("r1", spec=spec(tmp, workload=("/agent", "run"))))
    events: list[tuple[str, str | None]] = []
    rig.registry.events.subscribe(lambda e: events.append((e.kind, e.state)))
    rig.registry.owner("r1", VMBottle).sidecar_exited()
    rig.registry.owner("r1", VMBottle).degrade_later("bridge gave up")
    rig.clock.advance(0)
    rig.registry.owner("r1", VMBottle).workload_ended(
        3
    )  # its waiter, reporting after the sidecar died
    assert events == [("degraded", "degraded")]
    b = rig.registry.get_bottle("r1")
    assert (b.state, b.detail) == ("degraded", "sidecar VM process exited")
    assert rig.registry.state_of("r1") is Lifecycle.DEGRADED
    assert rig.state()["r1"]["state"] == "degraded"


def test_a_destroy_made_durable_by_the_timer_frees_the_name(
    rigs: Rigs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A destroy the resync timer completes removes the bottle's machine: the name is free."""
    rig = rigs()
    rig.run(rig.registry.create_bottle("fo1", ipaddress.IPv4Address("127.79.0.7")))

    def enospc(doc: dict[str, Any]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rig.store, "_append", enospc)
    with pytest.raises(Unavailable, match="destroy is done"):
        rig.run(rig.registry.destroy_bottle("fo1"))
    assert rig.registry.state_of("fo1") is Lifecycle.READY  # listed, idle, until durable
    monkeypatch.undo()
    rig.clock.advance(RESYNC_INTERVAL)
    assert rig.registry.state_of("fo1") is None and not rig.registry.has_bottle("fo1")
    again = rig.run(rig.registry.create_bottle("fo1"))
    assert rig.registry.state_of("fo1") is Lifecycle.READY and again.name == "fo1"


def test_a_degrade_during_a_policy_push_is_not_overwritten(rigs: Rigs, tmp: str) -> None:
    """The pushed policy's record keeps the degrade that happened while the push ran."""
    rig = rigs()
    rig.run(rig.registry.create_bottle("r1", spec=spec(tmp)))
    held = rig.smolvm.hold("exec", "bn-r1-sidecar")
    push = rig.start(rig.registry.set_egress_policy("r1", ("example.com",)))
    rig.registry.owner("r1", VMBottle).sidecar_exited()
    rig.clock.advance(0)
    held.callback(None)
    assert rig.result(push) == ("example.com",)
    b = rig.registry.get_bottle("r1")
    assert (b.state, b.require_vms().policy) == ("degraded", ("example.com",))
    assert rig.registry.state_of("r1") is Lifecycle.DEGRADED
    assert rig.state()["r1"]["state"] == "degraded"


def test_a_daemon_without_smolvm_and_no_vm_bottles_says_why_it_reconciles_nothing(
    rigs: Rigs,
) -> None:
    """No VM bottle recorded and no smolvm: one info line naming why, no error."""
    rig = rigs()
    rig.smolvm.fail_on("list", "", SmolvmUnavailable("smolvm not found: /opt/none/smolvm"))
    with capturedLogs() as events:
        rig.recover()
    said = [(e["log_level"].name, formatEvent(e)) for e in events if "log_format" in e]
    assert ("info", "no machines to reconcile: smolvm not found: /opt/none/smolvm") in said
    assert [line for level, line in said if level in ("error", "critical")] == []


def test_a_vm_bottle_recorded_and_no_smolvm_is_an_error(rigs: Rigs, tmp: str) -> None:
    """With a VM bottle to bring back, a smolvm that cannot list is an error, not a shrug."""
    first = rigs()
    first.run(first.registry.create_bottle("r1", spec=spec(tmp)))
    rig = restart(rigs, first)
    rig.smolvm.fail_on("list", "", SmolvmUnavailable("smolvm not found: /opt/none/smolvm"))
    with capturedLogs() as events:
        rig.recover()
    said = [(e["log_level"].name, formatEvent(e)) for e in events if "log_format" in e]
    assert ("error", "cannot list smolvm machines: smolvm not found: /opt/none/smolvm") in said
    assert not [line for _, line in said if line.startswith("no machines to reconcile")]
