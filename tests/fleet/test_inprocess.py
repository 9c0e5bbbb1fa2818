"""The fleet library on an in-process Ray cluster (``ray.cluster_utils.Cluster``: a head and
three raylets on this machine, no namespaces), each raylet with a bottlenet daemon of its own
(fake smolvm, a TEST DOUBLE): placement (spread or packed, one host process per node however
many bottles), refusals retried elsewhere, the bound, the timeout, all-or-nothing batches,
teardown and the owner going away. Partitions, lost raylets, daemon restarts and lease reaping
run in the multi-node tier (``test_multinode.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from unittest import mock

import pytest
import ray
from ray.cluster_utils import Cluster

from bottlenet.fleet import (
    BottleLost,
    BottlePool,
    BottleRequest,
    PlacementFailed,
    PlacementTimeout,
    Strategy,
    place,
    start_hosts,
)
from bottlenet.fleet.owner import JobOwner
from tests.bottles.harness import spec_doc
from tests.control.daemon_helpers import ENV, REPO
from tests.fleet.daemons import NodeDaemon, quiet_ray

#: Ray's ``bottle`` resource of each node; node 2's daemon holds fewer (``--max-bottles``),
#: so Ray offers it bottles its daemon refuses with RESOURCE_EXHAUSTED.
RESOURCES = (3, 3, 3)
DAEMON_LIMITS = (None, None, 1)
SMALL_STORE = 80 * 1024 * 1024
#: A short lease (renewed every second) and a 1 s grace on every daemon: lost bottles go fast.
LEASE = 3.0
LEASED = BottleRequest(lease_seconds=LEASE)


class Fleet:
    """The cluster and the daemons of this module's tests."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.daemons = [
            NodeDaemon(
                os.path.join(root, f"n{i}"),
                i,
                extra=(
                    "--lease-grace",
                    "1",
                    "--label",
                    f"bottlenet-node=n{i}",
                    *(() if limit is None else ("--max-bottles", str(limit))),
                ),
            )
            for i, limit in enumerate(DAEMON_LIMITS)
        ]
        self.cluster = Cluster()
        self.by_node: dict[str, NodeDaemon] = {}

    def start(self) -> None:
        for d in self.daemons:
            d.start()
        with quiet_ray(self.root):
            self.cluster.add_node(
                num_cpus=1,
                resources={"bottle": 0},
                include_dashboard=False,
                temp_dir=os.path.join(self.root, "ray"),
                object_store_memory=SMALL_STORE,
            )
        for d, count in zip(self.daemons, RESOURCES, strict=True):
            node = self.cluster.add_node(
                num_cpus=0,
                resources={"bottle": count},
                labels={"bottlenet-node": f"n{d.index}"},
                env_vars={"BOTTLENET_CONTROL": d.control},
                object_store_memory=SMALL_STORE,
            )
            self.by_node[node.node_id] = d
        ray.init(address=self.cluster.address)

    def stop(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()
        for d in self.daemons:
            d.stop()
            d.fake.cleanup()

    def held(self) -> dict[int, set[str]]:
        """Each daemon's bottle names."""
        return {d.index: d.names() for d in self.daemons}

    def empty(self) -> dict[int, set[str]]:
        return {d.index: set() for d in self.daemons}


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll ``check`` until it holds (Ray's resource view and the daemons settle on their
    own time: no fixed sleep, a deadline)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.1)


def all_bottles_free() -> bool:
    return ray.available_resources().get("bottle", 0) == sum(RESOURCES)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    root = tempfile.mkdtemp(prefix="bnf-", dir="/tmp")
    f = Fleet(root)
    # Ray's Cluster writes the head's address to <RAY_TMPDIR or /tmp>/ray/ray_current_cluster
    # and fails where that directory does not exist (a fresh machine): keep it in ours.
    with mock.patch.dict(os.environ, {"RAY_TMPDIR": root}):
        try:
            f.start()
            yield f
        finally:
            f.stop()
            shutil.rmtree(root, ignore_errors=True)


def test_pool_fills_every_daemon_retrying_refusals_then_destroys_all(fleet: Fleet) -> None:
    """7 bottles where Ray offers 9 and node 2's daemon holds 1: the refusals (its
    RESOURCE_EXHAUSTED) are placed again elsewhere; each bottle sits on its host's node's
    daemon; leaving the pool destroys all 7 and frees every ``bottle`` resource."""
    with BottlePool(7, LEASED, progress=False) as pool:
        held = fleet.held()
        assert {i: len(n) for i, n in held.items()} == {0: 3, 1: 3, 2: 1}
        for b in pool:
            assert b.name in held[fleet.by_node[b.node_id].index]
        assert pool[0].status().name == pool[0].name
        first = pool[0]
    assert fleet.held() == fleet.empty()
    wait_for("every bottle resource free", all_bottles_free)
    with pytest.raises(BottleLost):
        first.status(timeout=30)


def test_every_node_refusing_is_a_typed_error_and_leaves_nothing(fleet: Fleet) -> None:
    """Node 2's daemon full, nodes 0 and 1 without a daemon: one refusal from each node (none
    asked twice), then PlacementFailed naming them all; nothing is left on any daemon."""
    on_n2 = BottleRequest(lease_seconds=LEASE, label_selector={"bottlenet-node": "n2"})
    with BottlePool(1, on_n2, progress=False) as full:
        assert fleet.by_node[full[0].node_id].index == 2
        fleet.daemons[0].stop()
        fleet.daemons[1].stop()
        try:
            with pytest.raises(PlacementFailed) as caught:
                place(LEASED, max_attempts=5, timeout=120)
        finally:
            fleet.daemons[0].start()
            fleet.daemons[1].start()
    refusals = caught.value.refusals
    assert sorted(r.code for r in refusals) == ["RESOURCE_EXHAUSTED", "UNREACHABLE", "UNREACHABLE"]
    assert {fleet.by_node[r.node_id].index for r in refusals} == {0, 1, 2}
    assert caught.value.code == "PLACEMENT_FAILED"
    assert fleet.held() == fleet.empty()
    wait_for("every bottle resource free", all_bottles_free)


def test_the_attempt_bound_holds(fleet: Fleet) -> None:
    """With one attempt allowed, a refusal is final: PlacementFailed after exactly one."""
    on_n2 = BottleRequest(lease_seconds=LEASE, label_selector={"bottlenet-node": "n2"})
    with BottlePool(1, on_n2, progress=False):
        with pytest.raises(PlacementFailed) as caught:
            place(on_n2, max_attempts=1, timeout=120)
    assert [r.code for r in caught.value.refusals] == ["RESOURCE_EXHAUSTED"]
    assert fleet.held() == fleet.empty()


def test_no_node_with_the_labels_times_out_typed_and_frees_its_attempt(fleet: Fleet) -> None:
    """A label no node has: Ray keeps the reservation pending; the deadline ends it with
    PlacementTimeout, and the pending reservation is gone (every resource free again)."""
    nowhere = BottleRequest(label_selector={"bottlenet-node": "nowhere"})
    with pytest.raises(PlacementTimeout) as caught:
        BottlePool(2, nowhere, timeout=2, progress=False).open()
    assert "found no node" in str(caught.value)
    assert fleet.held() == fleet.empty()
    wait_for("every bottle resource free", all_bottles_free)


def test_a_pool_larger_than_its_nodes_reserves_nothing(fleet: Fleet) -> None:
    """4 bottles only on node 0 (3 ``bottle``): Ray reserves all of a pool or none, so the
    pool times out having made no bottle, and its reservation is gone."""
    on_n0 = BottleRequest(label_selector={"bottlenet-node": "n0"})
    with pytest.raises(PlacementTimeout):
        BottlePool(4, on_n0, timeout=5, progress=False).open()
    assert fleet.held() == fleet.empty()
    wait_for("every bottle resource free", all_bottles_free)


def test_a_pool_failing_half_way_destroys_what_it_made(fleet: Fleet) -> None:
    """2 bottles only on node 2, whose daemon holds 1: one is made, the other refused with
    no second attempt allowed; the one made (or still being made) is destroyed before the
    error (a pool is all or nothing)."""
    on_n2 = BottleRequest(lease_seconds=LEASE, label_selector={"bottlenet-node": "n2"})
    with pytest.raises(PlacementFailed) as caught:
        BottlePool(2, on_n2, max_attempts=1, progress=False).open()
    assert [r.code for r in caught.value.refusals] == ["RESOURCE_EXHAUSTED"]
    assert fleet.held() == fleet.empty()
    wait_for("every bottle resource free", all_bottles_free)


def test_a_pool_spreads_by_default_and_packs_when_asked(fleet: Fleet) -> None:
    """4 bottles on nodes 0 and 1 (3 ``bottle`` each): spread 2 and 2 (the default);
    packed 3 and 1."""
    for strategy, counts in ((None, [2, 2]), (Strategy.PACK, [1, 3])):
        either = BottleRequest(
            lease_seconds=LEASE,
            label_selector={"bottlenet-node": "in(n0,n1)"},
            **({} if strategy is None else {"strategy": strategy}),
        )
        with BottlePool(4, either, progress=False):
            assert sorted(len(names) for names in fleet.held().values() if names) == counts
        wait_for("every bottle resource free", all_bottles_free)


def _descends_from_us(pid: int) -> bool:
    """Whether ``pid`` is a descendant of this process (this cluster's raylets and workers
    are; another test's cluster on the machine is not)."""
    while pid > 1:
        with open(f"/proc/{pid}/status") as f:
            pid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
        if pid == os.getpid():
            return True
    return False


def _host_processes() -> list[int]:
    """This cluster's Ray worker processes that are bottle hosts (Ray titles an actor's
    process ``ray::<class>``)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::NodeHost") and _descends_from_us(int(entry)):
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def test_bottles_share_their_nodes_host_process(fleet: Fleet) -> None:
    """``start_hosts(wait=False)`` starts one host per bottle node and returns at once; 6
    bottles on nodes 0 and 1 use those hosts (a node's bottles share one), and no host
    process starts for them."""
    assert start_hosts(wait=False) == len(fleet.daemons)
    wait_for("a host on every node", lambda: len(_host_processes()) == len(fleet.daemons))
    hosts = sorted(_host_processes())
    either = BottleRequest(lease_seconds=LEASE, label_selector={"bottlenet-node": "in(n0,n1)"})
    with BottlePool(6, either, progress=False) as pool:
        by_node = {b.node_id: b.host for b in pool}
        assert len(by_node) == 2
        assert all(b.host == by_node[b.node_id] for b in pool)
        assert sorted(_host_processes()) == hosts
    assert fleet.held() == fleet.empty()


def test_a_pool_is_placed_before_its_owner_has_started(fleet: Fleet) -> None:
    """The hosts start beside the owner actor, not after it: with the owner's start held
    back, a pool's bottles are made on their nodes; the pool is handed over once the owner
    answers, and closes as any other."""
    gate = os.path.join(fleet.root, "owner-may-start")

    class HeldOwner(JobOwner):
        def __init__(self, gate: str) -> None:
            deadline = time.monotonic() + 120
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.05)
            super().__init__("ray-job-held")

    owner = ray.remote(HeldOwner).options(num_cpus=0).remote(gate)
    unleased = BottleRequest(lease_seconds=None, label_selector={"bottlenet-node": "in(n0,n1)"})
    opened: list[BottlePool] = []
    with mock.patch("bottlenet.fleet.placement.job_owner", return_value=owner):
        placing = threading.Thread(
            target=lambda: opened.append(BottlePool(2, unleased, progress=False).open())
        )
        placing.start()
        try:
            wait_for("both bottles made", lambda: sum(map(len, fleet.held().values())) == 2)
            assert opened == [], "the pool was handed over before its owner answered"
        finally:
            with open(gate, "w"):
                pass
            placing.join(120)
    [pool] = opened
    assert {b.name for b in pool} <= set().union(*fleet.held().values())
    pool.close()
    assert fleet.held() == fleet.empty()
    ray.kill(owner)  # its hosts see it gone and end
    wait_for("every bottle resource free", all_bottles_free)


def test_vm_bottle_exec_logs_status_and_progress(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """A VM bottle (fake smolvm) through its host: exec returns the code and output, logs
    the workload's output, status the record; the progress bar counts the pool."""
    spec = json.dumps(
        spec_doc(fleet.root, egress=False, workload=("/bin/echo", "from-the-workload"))
    )
    request = BottleRequest(spec=spec, lease_seconds=LEASE)
    with BottlePool(1, request, progress=True) as pool:
        b = pool[0]
        result = b.exec(["/bin/sh", "-c", "echo out; echo err >&2; exit 3"])
        assert (result.exit_code, result.stdout, result.stderr) == (3, b"out\n", b"err\n")
        assert b.status().agent_vm == f"bn-{b.name}-agent"
        wait_for("the workload's output", lambda: b"from-the-workload" in b.logs())
    assert "1/1" in capsys.readouterr().err
    assert fleet.held() == fleet.empty()


def test_a_killed_host_is_bottle_lost_and_its_node_reaps_the_bottle(fleet: Fleet) -> None:
    """``ray.kill`` of a bottle's host gives it no chance to destroy: the trainer sees
    BottleLost, and the bottle's node reaps it once its lease and grace run out (nothing
    renews it); the next bottle there gets a new host."""
    b = place(LEASED)
    ray.kill(b.host, no_restart=True)
    with pytest.raises(BottleLost):
        b.exec(["true"], timeout=30)
    daemon = fleet.by_node[b.node_id]
    with daemon.client() as c:
        assert c.bottle_status(b.name).lease_seconds == LEASE
    wait_for("the lease reaps the bottle", lambda: b.name not in daemon.names(), 60)
    b.destroy()  # the host is dead: nothing to do, no error
    on_that_node = BottleRequest(
        lease_seconds=LEASE, label_selector={"bottlenet-node": f"n{daemon.index}"}
    )
    again = place(on_that_node)
    assert again.host != b.host and again.status().name == again.name
    again.destroy()
    assert fleet.held() == fleet.empty()
    wait_for("every bottle resource free", all_bottles_free)


def test_a_draining_node_refuses_and_the_pool_goes_elsewhere(fleet: Fleet) -> None:
    """Node 0 drained: a bottle that may only go there fails with its DRAINING refusal
    (one attempt allowed); a pool that may use nodes 0 and 1 lands on node 1 only."""
    with fleet.daemons[0].client() as c:
        c.drain()
    try:
        only_n0 = BottleRequest(label_selector={"bottlenet-node": "n0"})
        with pytest.raises(PlacementFailed) as caught:
            place(only_n0, max_attempts=1)
        assert [r.code for r in caught.value.refusals] == ["DRAINING"]
        either = BottleRequest(label_selector={"bottlenet-node": "in(n0,n1)"})
        with BottlePool(3, either, progress=False) as pool:
            assert {fleet.by_node[b.node_id].index for b in pool} == {1}
            assert {r.code for r in pool.refusals} <= {"DRAINING"}
    finally:
        with fleet.daemons[0].client() as c:
            c.undrain()
    assert fleet.held() == fleet.empty()


_ORPHANING_DRIVER = """
import sys, os
import ray
from bottlenet.fleet import BottlePool, BottleRequest
ray.init(address=sys.argv[1])
pool = BottlePool(2, BottleRequest(lease_seconds=3), progress=False).open()
print(" ".join(b.name for b in pool), flush=True)
os._exit(0)  # the trainer dies without closing its pool
"""


def test_the_owner_going_away_destroys_its_bottles(fleet: Fleet) -> None:
    """A trainer that exits without closing its pool: its owner actor dies with it, the
    hosts see their owner gone and destroy its bottles (well before any lease could run
    out: each is renewed while its host lives), then end."""
    out = subprocess.run(
        [sys.executable, "-c", _ORPHANING_DRIVER, fleet.cluster.address],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        timeout=120,
        check=True,
    )
    names = set(out.stdout.decode().split())
    assert len(names) == 2
    assert names <= set().union(*fleet.held().values())
    wait_for("the orphaned bottles destroyed", lambda: fleet.held() == fleet.empty(), 90)
    wait_for("every bottle resource free", all_bottles_free)
