"""The per-VM uid rules (smolvm as root), without root: a fake uid map in the in-memory smolvm.

Which uid a bottle's endpoints are granted to, at create and after a restart, comes from what
the daemon reserved (kept in the bottle's record) and smolvm's root-owned registry, never from
the VM dir's ``.vm-uid`` (the agent VMM's own file): security-3 R1, tests-3 P08/P10. The
chown itself needs root and is pinned end to end by ``test_vm_e2e.py::SidecarSocketTests``;
here a recording ``VmmAccess`` stands in for it, so a non-root run still pins the rules.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from bottlenet.bottles.host import VMOptions
from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.bottles.vmmaccess import VmmAccess
from bottlenet.errors import BottlenetError
from bottlenet.forward.spec import HeldSocket, UNIXTarget
from bottlenet.forward.targets import OwnSockets, unix_target_problem
from tests.bottles.harness import spec_doc
from tests.bottles.memsmolvm import FIFO, MemorySmolvm, Rig
from tests.bottles.test_recovery import _store, _stored
from tests.bottles.test_rollback import assert_nothing_left, spec
from vmctl.smolvm import VmUids

AGENT = "bn-rb-agent"
SIDECAR = "bn-rb-sidecar"


class RecordingAccess(VmmAccess):
    """``per-VM uids`` as the daemon sees them, the chowns recorded instead of made."""

    def __init__(self, state_dir: str) -> None:
        super().__init__(state_dir, VmUids.PER_VM)
        self.granted: list[int] = []
        self.handed: list[int] = []

    def hand_sidecar_dir(self, path: str, uid: int) -> None:
        self.handed.append(uid)

    def grant_endpoints(self, paths: Iterable[str], uid: int) -> None:
        self.granted.append(uid)


def per_vm(rigs: Callable[..., Rig], tmp: str, smolvm: MemorySmolvm | None = None) -> Rig:
    """A rig whose daemon runs under per-VM uids, its VM dirs under ``tmp/vms``."""
    smolvm = smolvm or MemorySmolvm(vm_root=os.path.join(tmp, "vms"))
    rig = rigs(smolvm=smolvm, options=VMOptions(instance_id="", vm_uids=VmUids.PER_VM))
    rig.use(access=RecordingAccess(rig.state_dir))
    return rig


def access(rig: Rig) -> RecordingAccess:
    assert isinstance(rig.host.access, RecordingAccess)
    return rig.host.access


def created(rigs: Callable[..., Rig], tmp: str) -> Rig:
    rig = per_vm(rigs, tmp)
    rig.run(rig.registry.create_bottle("rb", spec=spec(tmp, listen="unix")))
    return rig


def test_the_reserved_uids_are_granted_admitted_and_kept_in_the_record(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """Create: the agent VMM's reserved uid gets the endpoints (and only it besides the
    daemon passes the peer check); both uids are kept in the bottle's record."""
    rig = created(rigs, tmp)
    agent, sidecar = rig.smolvm.uids[AGENT], rig.smolvm.uids[SIDECAR]
    assert agent != sidecar
    assert access(rig).granted == [agent] and access(rig).handed == [sidecar]
    assert rig.table.peers["rb"] == frozenset({os.geteuid(), agent})
    assert rig.state()["rb"]["vm_uids"] == {"agent": agent, "sidecar": sidecar}


def test_a_one_uid_daemon_keeps_its_records_as_they_were(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """Under one uid nothing is reserved and the record has no ``vm_uids``; the endpoints
    admit the daemon's own uid only, from their bind (no grant comes later to set it)."""
    rig = rigs()
    rig.run(rig.registry.create_bottle("rb", spec=spec(tmp, listen="unix")))
    assert "vm_uids" not in rig.state()["rb"]
    assert not any(call[0] == "reserve_uid" for call in rig.smolvm.calls)
    assert rig.table.peers["rb"] == frozenset({os.geteuid()})


def test_a_raw_port_sidecar_gets_a_reserved_uid_too(rigs: Callable[..., Rig], tmp: str) -> None:
    """R2: smolvm never picks a VMM uid itself (it would take the lowest free: a reused one)."""
    rig = per_vm(rigs, tmp)
    rig.run(rig.registry.create_bottle("rb", spec=spec(tmp, listen="tcp")))
    assert ("reserve_uid", SIDECAR) in rig.smolvm.calls
    assert rig.state()["rb"]["vm_uids"]["sidecar"] == rig.smolvm.uids[SIDECAR]


@pytest.mark.parametrize("forged", ["65534", "", "2000000000000000000000", "garbage"])
def test_a_started_uid_other_than_the_reserved_one_fails_the_create(
    rigs: Callable[..., Rig], tmp: str, forged: str
) -> None:
    """P08: ``.vm-uid`` after ``machine start`` names another uid (or none): ISOLATION_FAILED
    naming the reserved uid, before the gate ran, and nothing left."""
    rig = per_vm(rigs, tmp)
    rig.smolvm.started_as[AGENT] = forged
    with pytest.raises(BottlenetError) as info:
        rig.run(rig.registry.create_bottle("rb", spec=spec(tmp, listen="unix")))
    assert info.value.code == "ISOLATION_FAILED", str(info.value)
    assert "not the uid 2000001 reserved for it" in info.value.message
    assert not any(name == AGENT for name, _ in rig.smolvm.execs)  # no gate, no workload
    assert_nothing_left(rig)


def test_a_fifo_at_vm_uid_fails_the_create_without_blocking(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """R1: a quick VMM that makes its ``.vm-uid`` a FIFO right after start: read through
    ``open_regular`` (a thread here, so a blocking open would hang the test, not pass)."""
    rig = per_vm(rigs, tmp)
    rig.smolvm.started_as[AGENT] = FIFO
    done = threading.Event()
    errors: list[BottlenetError] = []

    def create() -> None:
        try:
            rig.run(rig.registry.create_bottle("rb", spec=spec(tmp, listen="unix")))
        except BottlenetError as e:
            errors.append(e)
        done.set()

    worker = threading.Thread(target=create, daemon=True)
    worker.start()
    if not done.wait(30):  # a blocked open: unblock it so the thread can end, then fail
        fd = os.open(os.path.join(rig.smolvm.vm_dir(AGENT), ".vm-uid"), os.O_WRONLY)
        os.close(fd)
        pytest.fail("opening the .vm-uid FIFO blocked")
    assert [e.code for e in errors] == ["ISOLATION_FAILED"]
    assert "not a readable regular file" in errors[0].message
    assert_nothing_left(rig)


def test_a_restart_grants_the_reserved_uid_whatever_vm_uid_says(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """R1/P10: the agent VMM rewrote its ``.vm-uid`` (or made it a FIFO): the restarted
    daemon grants the uid it reserved (from the record, checked against the registry)."""
    first = created(rigs, tmp)
    agent = first.smolvm.uids[AGENT]
    first.close()
    vm_uid = os.path.join(first.smolvm.vm_dir(AGENT), ".vm-uid")
    os.unlink(vm_uid)
    os.mkfifo(vm_uid)  # never opened: a blocking read would hang here
    rig = per_vm(rigs, tmp, smolvm=first.smolvm)
    rig.recover()
    assert [b.name for b in rig.registry.list_bottles()] == ["rb"]
    assert access(rig).granted == [agent]
    assert rig.table.peers["rb"] == frozenset({os.geteuid(), agent})


def test_a_registry_that_disagrees_with_the_record_fails_the_bottle(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """R1: the record says one uid, smolvm's registry another: nothing is granted, the
    bottle is torn down at recovery (ISOLATION_FAILED), not re-granted."""
    first = created(rigs, tmp)
    first.close()
    first.smolvm.uids[AGENT] = 65534
    rig = per_vm(rigs, tmp, smolvm=first.smolvm)
    rig.recover()
    assert rig.registry.list_bottles() == []
    assert access(rig).granted == []
    assert AGENT not in rig.smolvm.machines


def test_an_old_record_without_uids_takes_them_from_the_registry(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """Migration: a record from before ``vm_uids`` loads; the uids come from smolvm's
    registry (never ``.vm-uid``), are granted, and are written into the record."""
    first = created(rigs, tmp)
    agent, sidecar = first.smolvm.uids[AGENT], first.smolvm.uids[SIDECAR]
    first.close()
    bottles = _stored(first.state_dir)
    del bottles["rb"]["vm_uids"]
    _store(first.state_dir, bottles)
    with open(os.path.join(first.smolvm.vm_dir(AGENT), ".vm-uid"), "w") as fh:
        fh.write("65534")
    rig = per_vm(rigs, tmp, smolvm=first.smolvm)
    rig.recover()
    assert access(rig).granted == [agent]
    assert rig.state()["rb"]["vm_uids"] == {"agent": agent, "sidecar": sidecar}


def test_an_old_record_whose_agent_has_no_registry_entry_fails(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """Migration without an entry to read: no grant to a guessed uid; torn down."""
    first = created(rigs, tmp)
    first.close()
    bottles = _stored(first.state_dir)
    del bottles["rb"]["vm_uids"]
    _store(first.state_dir, bottles)
    del first.smolvm.uids[AGENT]
    rig = per_vm(rigs, tmp, smolvm=first.smolvm)
    rig.recover()
    assert rig.registry.list_bottles() == []
    assert access(rig).granted == []


def test_the_endpoints_relay_only_to_the_socket_file_the_sidecar_vm_holds(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """R2: each endpoint's target is pinned to the exposed socket the sidecar's VM holds
    (device, inode, owner), at create and again at restart; a socket bound at the same path
    by anyone else (a leftover of a deleted bottle's sidecar uid did that) is refused."""
    smolvm = MemorySmolvm(vm_root=os.path.join(tmp, "vms"), bind_exposed=True)
    first = per_vm(rigs, tmp, smolvm=smolvm)
    first.run(first.registry.create_bottle("rb", spec=spec(tmp, listen="unix")))
    info = first.table.list("rb")[0]
    target = info.spec.target
    assert isinstance(target, UNIXTarget)
    assert target.held == HeldSocket.at(target.path) is not None
    root = os.path.dirname(target.path)
    assert unix_target_problem(target.path, root, OwnSockets(), target.held) is None
    first.close()
    rig = per_vm(rigs, tmp, smolvm=smolvm)
    rig.recover()
    info = rig.table.list("rb")[0]
    assert isinstance(info.spec.target, UNIXTarget) and info.spec.target.held == target.held
    os.unlink(target.path)
    impostor = socket.socket(socket.AF_UNIX)
    impostor.bind(target.path)
    impostor.close()
    problem = unix_target_problem(target.path, root, OwnSockets(), target.held)
    assert problem == "is no longer the socket its sidecar holds"


def test_a_grant_never_goes_through_a_name_that_is_not_a_socket(tmp_path: Path) -> None:
    """P07: a symlink (to a 0600 file) or a plain file at an endpoint path is left as it is;
    the real socket next to it is granted (0660, the uid as its group). Runs without root:
    the uid granted is the test's own gid."""
    secret = tmp_path / "secret"
    secret.write_text("x")
    secret.chmod(0o600)
    (tmp_path / "link.sock").symlink_to(secret)
    plain = tmp_path / "plain.sock"
    plain.write_text("")
    plain.chmod(0o600)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "real.sock"))
    sock.close()
    access = VmmAccess(str(tmp_path), VmUids.PER_VM)
    paths = [str(tmp_path / n) for n in ("link.sock", "plain.sock", "real.sock")]
    access.grant_endpoints(paths, os.getgid())
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(plain.stat().st_mode) == 0o600
    real = os.lstat(tmp_path / "real.sock")
    assert (stat.S_IMODE(real.st_mode), real.st_gid) == (0o660, os.getgid())


def test_the_vm_uids_processes_are_ended_once_its_machines_are_deleted(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """R2: destroy ends whatever still runs as both VMM uids, after the machines are gone;
    a create that fails does the same for the uids it reserved."""
    rig = created(rigs, tmp)
    agent, sidecar = rig.smolvm.uids[AGENT], rig.smolvm.uids[SIDECAR]
    rig.run(rig.registry.destroy_bottle("rb"))
    calls = rig.smolvm.calls
    ended = [c for c in calls if c[0] == "end_uid"]
    assert ended == [("end_uid", str(agent)), ("end_uid", str(sidecar))]
    assert calls.index(ended[0]) > calls.index(("delete", SIDECAR))
    before = len(calls)
    rig.smolvm.started_as[AGENT] = "65534"  # the next create fails after both starts
    with pytest.raises(BottlenetError):
        rig.run(rig.registry.create_bottle("rb", spec=spec(tmp, listen="unix")))
    again = [c for c in rig.smolvm.calls[before:] if c[0] == "end_uid"]
    assert sorted(again) == sorted(("end_uid", str(u)) for u in (agent + 2, sidecar + 2))


def test_destroyed_uids_are_retired_and_a_failed_creates_are_given_back(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """N8: a destroy retires both uids once their processes are ended (they come back only
    when nothing of theirs is left); a failed create asks for its uids to be looked at at
    once (``prove``), so a create that failed costs no uid."""
    rig = created(rigs, tmp)
    agent, sidecar = rig.smolvm.uids[AGENT], rig.smolvm.uids[SIDECAR]
    rig.run(rig.registry.destroy_bottle("rb"))
    calls = rig.smolvm.calls
    assert [c for c in calls if c[0] == "retire_uid"] == [
        ("retire_uid", str(agent)),
        ("retire_uid", str(sidecar)),
    ]
    assert calls.index(("end_uid", str(agent))) < calls.index(("retire_uid", str(agent)))
    before = len(calls)
    rig.smolvm.started_as[AGENT] = "65534"  # the next create fails after both starts
    with pytest.raises(BottlenetError):
        rig.run(rig.registry.create_bottle("rb", spec=spec(tmp, listen="unix")))
    given = [c for c in rig.smolvm.calls[before:] if c[0] == "retire_uid"]
    assert sorted(given) == sorted(("retire_uid", f"{u} prove") for u in (agent + 2, sidecar + 2))


def test_the_agents_writable_volumes_are_recorded_with_its_uid(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """Where the agent VMM may leave files (its read-write volumes, not its read-only ones)
    goes with its reservation: the uid is given out again only once none are left there."""
    rw, ro = Path(tmp, "rw"), Path(tmp, "ro")
    rw.mkdir(mode=0o777)
    ro.mkdir()
    os.chmod(tmp, 0o711)  # the VMM uid passes to its volumes
    os.chmod(rw, 0o777)  # and may write this one itself: nothing to grant
    smolvm = MemorySmolvm(vm_root=os.path.join(tmp, "vms"))
    options = VMOptions(instance_id="", vm_uids=VmUids.PER_VM, skip_probe=True)
    rig = rigs(smolvm=smolvm, options=options)  # no guest here to answer the volume check
    rig.use(access=RecordingAccess(rig.state_dir))
    doc = spec_doc(tmp, listen="unix")
    doc["agent"]["volumes"] = [f"{rw}:/work:rw", f"{ro}:/ref:ro"]
    rig.run(rig.registry.create_bottle("rb", spec=parse_bottle_spec("rb", doc)))
    assert rig.smolvm.uid_volumes[rig.smolvm.uids[AGENT]] == (str(rw),)
    assert rig.smolvm.uid_volumes[rig.smolvm.uids[SIDECAR]] == ()


def test_the_node_learns_how_many_uids_are_left(rigs: Callable[..., Rig], tmp: str) -> None:
    """After each reservation and retirement the lifecycle tells how many uids are left
    (what NodeInfo and the metrics report)."""
    rig = per_vm(rigs, tmp)
    told: list[int] = []
    rig.host.uid_reports.listeners.append(lambda supply: told.append(supply.left))
    rig.run(rig.registry.create_bottle("rb", spec=spec(tmp, listen="unix")))
    assert told == [65_535, 65_534]
    rig.run(rig.registry.destroy_bottle("rb"))
    assert told[-1] == 65_534
