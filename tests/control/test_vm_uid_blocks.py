"""Per-VM uids across daemons and over a data dir's life, with real daemons on the fake smolvm
in ``uid-drop`` mode (as root: each fake "VMM" really runs as its uid).

Two daemons with two data dirs on one host (security-4 N2): the fake's registries both start
at 2000000, as two fresh real smolvm data dirs do, and the daemons still hand out disjoint
uids (a block each from the one host ledger): one daemon's destroy ends none of the other's
VMMs. A data dir whose recorded block the ledger gives to another refuses to start. A data dir
whose block is used up (N8) goes on creating, and NodeInfo says how many uids are left."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.bottles.test_vm_e2e import _echo_as
from tests.control.vmdaemon import VMDaemon, wait_for
from tests.fakes import process_alive
from vmctl.residue import process_facts
from vmctl.uidranges import Block
from vmctl.uids import FIRST_VM_UID, LAST_RESERVED, RETIRED, registered_vm_uid

from .daemon_helpers import ENV, REPO, daemon_argv

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-VM uids are root's")


def uid_daemon() -> VMDaemon:
    d = VMDaemon()
    d.fake.set_faults("exec-netns", "uid-drop", version="1.32.2")
    return d


def agent_uid(d: VMDaemon, bottle: str) -> int:
    uid = registered_vm_uid(d.fake.vm_dir(f"bn-{bottle}-agent"))
    assert uid is not None
    return uid


def registry(d: VMDaemon) -> Path:
    return Path(d.fake.path, ".cache", "smolvm", "uids")


def node_info(d: VMDaemon) -> dict[str, object]:
    r = d.ctl("--json", "node", "info")
    assert r.returncode == 0, r
    info: dict[str, object] = json.loads(r.stdout)
    return info


def test_two_daemons_on_one_host_hand_out_disjoint_uids() -> None:
    """N2: A's and B's data dirs are fresh (both would start at 2000000); each daemon's VMs
    run under a block of its own, B's agent uid is refused at A's endpoint, and A's destroy
    leaves B's VMMs running."""
    a, b = uid_daemon(), uid_daemon()
    try:
        a.start()
        b.start()
        a.create_vm_bottle("a1")
        b.create_vm_bottle("b1")
        ua, ub = agent_uid(a, "a1"), agent_uid(b, "b1")
        assert Block((ua - FIRST_VM_UID) // 65_536) != Block((ub - FIRST_VM_UID) // 65_536)
        assert min(ua, ub) > FIRST_VM_UID + 65_535  # never smolvm's own block
        b_vmms = [b.machine_pid(m) for m in ("bn-b1-agent", "bn-b1-sidecar")]
        endpoint = os.path.join(a.state, "bottles", "a1", "egress.sock")
        assert _echo_as(ub, [endpoint]) == []  # B's agent VMM uid: no bytes back at A's
        r = a.ctl("bottle", "rm", "a1")
        assert r.returncode == 0, r
        assert all(process_alive(p) for p in b_vmms)
        assert b.ctl("bottle", "status", "b1").stdout.count(b"ready") >= 1
    finally:
        assert not a.cleanup()
        assert not b.cleanup()


def test_a_data_dir_whose_block_the_ledger_gives_to_another_refuses_to_start() -> None:
    """N2: B's data dir recorded block k, but the ledger says k is A's (a copied data dir, or
    a second ledger): B exits at start with one line naming A's registry; nothing runs."""
    a, b = uid_daemon(), uid_daemon()
    try:
        a.start()
        a.create_vm_bottle("a1")
        mine = (agent_uid(a, "a1") - FIRST_VM_UID) // 65_536
        registry(b).mkdir(parents=True)
        (registry(b) / ".uid-blocks").write_text(json.dumps({"blocks": [mine]}))
        argv = daemon_argv(
            b.state, f"unix:{b.control}", "--smolvm", b.fake.binary,
            "--smolvm-data-dir", b.fake.path, "--uid-ledger", b.fake.uid_ledger,
        )  # fmt: skip
        done = subprocess.run(argv, env=ENV, cwd=REPO, capture_output=True, timeout=120)
        assert done.returncode == 1, done
        lines = done.stderr.decode().strip().splitlines()
        assert lines[-1] == (
            f"bottlenet: error: --smolvm-data-dir {b.fake.path}: "
            f"{os.path.realpath(registry(b))}: its uids {Block(mine).first}-{Block(mine).last} "
            f"are given to another smolvm data dir, {os.path.realpath(registry(a))} "
            f"({b.fake.uid_ledger}/{mine}); one data dir per block"
        ), lines
        assert not os.path.exists(b.control)
    finally:
        assert not a.cleanup()
        assert not b.cleanup()


def test_a_data_dir_with_seventy_thousand_cycles_behind_it_still_creates() -> None:
    """N8: 70,000 create/destroy cycles (140,000 uids, more than a block) stood in for by
    the registry they leave: the mark at the block's end, every other uid of it retired.
    Creates go on (the sweep frees what nothing holds), real cycles reuse uids, a restart
    changes nothing, and NodeInfo shows the uids left."""
    d = uid_daemon()
    try:
        d.start()
        fresh = node_info(d)
        assert (fresh["vm_uids_left"], fresh["vm_uids"]) == (
            65_536,
            "65536 VM uids left (no block claimed yet: the first VM claims one)",
        )
        d.create_vm_bottle("first")
        assert d.ctl("bottle", "rm", "first").returncode == 0
        info = node_info(d)
        left = info["vm_uids_left"]
        assert isinstance(left, int) and 0 < left < 65_536, info
        block = Block(json.loads((registry(d) / ".uid-blocks").read_text())["blocks"][-1])
        (registry(d) / LAST_RESERVED).write_text(str(block.last))
        with open(registry(d) / RETIRED, "a") as log:
            for uid in range(block.first, block.last + 1):
                log.write(json.dumps({"uid": uid, "vm": "history", "volumes": []}) + "\n")
        d.stop()
        d.start()
        assert node_info(d)["vm_uids_left"] == 0  # nothing proven yet: no sweep has run
        seen = []
        for cycle in range(3):
            d.create_vm_bottle(f"c{cycle}")
            seen.append(agent_uid(d, f"c{cycle}"))
            assert d.ctl("bottle", "rm", f"c{cycle}").returncode == 0
        assert all(uid in block for uid in seen) and len(set(seen)) == 3
        info = node_info(d)
        assert isinstance(info["vm_uids_left"], int) and info["vm_uids_left"] > 60_000, info
        assert info["health"] == "ok" and f"uids {block.first}-{block.last}" in str(info["vm_uids"])
        assert json.loads((registry(d) / ".uid-blocks").read_text())["blocks"] == [block.index]
        table = d.ctl("node", "info").stdout.decode()
        row = rf"VM uids\s+{info['vm_uids_left']} VM uids left \(uids {block.first}-{block.last};"
        assert re.search(row, table), table
    finally:
        assert not d.cleanup()


def test_a_destroy_spares_a_process_of_the_uid_that_is_not_the_machines() -> None:
    """N2, second line of defence: a process running as the agent's uid that started before
    the reservation and names none of the data dir's VMs is left alone by the destroy (and
    named in the log); the VMMs themselves end."""
    d = uid_daemon()
    try:
        d.start()
        d.create_vm_bottle("x1")
        block = Block(json.loads((registry(d) / ".uid-blocks").read_text())["blocks"][-1])
        # The next bottle's two uids: its sidecar and its agent reserve them at once (issue
        # 38), in either order, so a foreign process runs as each.
        last = int((registry(d) / LAST_RESERVED).read_text())
        foreign = {
            uid: subprocess.Popen(
                ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "300"],
                start_new_session=True,
            )
            for uid in (last + 1, last + 2)
        }
        try:
            for uid, proc in foreign.items():
                wait_until_running(proc.pid, uid)
            d.create_vm_bottle("x2")
            nxt = agent_uid(d, "x2")
            assert nxt in foreign and nxt in block
            vmm = d.machine_pid("bn-x2-agent")
            assert d.ctl("bottle", "rm", "x2").returncode == 0
            wait_for(lambda: not process_alive(vmm), 30, "the agent VMM to end")
            assert foreign[nxt].poll() is None
            assert f"is also run by pid(s) {foreign[nxt].pid}" in d.log()
        finally:
            for proc in foreign.values():
                proc.kill()
                proc.wait()
    finally:
        assert not d.cleanup()


def wait_until_running(pid: int, uid: int) -> None:
    wait_for(lambda: (f := process_facts(pid)) is not None and uid in f.uids, 30, "setpriv")
