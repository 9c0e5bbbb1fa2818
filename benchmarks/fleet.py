"""Bottles across nodes placed by Ray (a benchmark, not a test; docs/performance.md, "Fleet").

    .venv/bin/python benchmarks/fleet.py [--bottles 30] [--lease 6] [--json F]
                                         [--vm-boot B [--vm-bottles 9]]

As root, with the ``ray`` extra and redis-server: the multi-node tier's cluster
(``tests/fleet/netns.py``: three bottle nodes in namespaces of their own, each with its raylet
and bottlenet daemon on the fake smolvm, a TEST DOUBLE; the head with Redis; the trainer).
The trainer asks for ``--bottles`` forward-only bottles under a ``--lease`` s lease, twice: the
first pool of the trainer ("cold": its Ray processes on the nodes start with it) and, once that
is closed and Ray sees every ``bottle`` free again, a second one ("warm"). The run reports,
for each:

* bottles placed per second across the nodes (the whole pool: request to the last ready);
* p50/p99 seconds from the pool's request to each bottle ready;
* bottles per node;

and then:

* seconds from asking to an empty Ray actor's first answer on each bottle node, all at once
  (a Ray worker process started alone: the floor of a cold pool, whose hosts start so);

* Ray worker processes on each node with the first pool placed (not Ray's own two agents of
  every node), their memory (proportional set size, PSS) and that memory per bottle of the
  node; their PSS once that pool is closed, and what the second pool's bottles added to it,
  per bottle;
* seconds from a node's loss (its link down) to its last bottle reaped by its daemon, against
  the bound lease + grace .. 2 x lease + grace;
* orphans left once the pool is closed and the lost node has reaped: bottles on any daemon,
  fake-smolvm VM processes (goal 0).

With ``--vm-boot B`` the nodes' fakes boot a VM in B seconds (``slow-start``) and every daemon
runs its launch gate (the fake's isolating ``exec-netns`` stand-in, which needs root, instead
of the tier's ``--unsafe-skip-isolation-probe``: a plain create pays for the gate, a pool's
member passed it ahead). Before the node's loss the trainer places ``--vm-bottles`` VM bottles
(socket mode, the bridge, a workload) twice: with ``pool="off"`` (every one booted for it),
then, once ``pool ensure`` has a pool of that spec full on every node (its share of the
bottles each), with ``pool="auto"``; each pool's bottles/s, request-to-ready p50 and p99, and
how many bottles were a pool's members.

The machine is shared and busy: absolute seconds vary from run to run; quote one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

from benchmarks.stats import pct  # noqa: E402
from bottlenet.control.records import BottleRecord  # noqa: E402
from tests.bottles.harness import spec_doc  # noqa: E402
from tests.fleet.netns import (  # noqa: E402
    RAY_UID,
    NetCluster,
    Node,
    unprivileged_python_works,
    wait_until,
)

GRACE = 3.0
CAPACITY = (14, 14, 14)


def pss_mib(pid: int) -> float:
    """A process's proportional set size (its share of pages it shares), MiB; 0 once gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def workers_pss(cluster: NetCluster) -> dict[str, tuple[int, float]]:
    """Each node's Ray worker processes (not the node's two agents) and their PSS, MiB."""
    out = {}
    for n in cluster.nodes:
        agents = set(n.ns.pids("Agent"))
        workers = [pid for pid in n.ns.pids("ray::") if pid not in agents]
        out[n.label] = (len(workers), sum(pss_mib(pid) for pid in workers))
    return out


def timed_pool(
    driver: Any, labels: dict[str, str], pool_id: str, bottles: int, lease: float, **request: Any
) -> dict[str, Any]:
    """One pool of ``bottles`` (``request``: the driver's ``spec`` and ``pool``): its
    figures and where its bottles went."""
    placed = driver.call(
        "timed_pool", id=pool_id, count=bottles, lease=lease, timeout=900, **request
    )
    ready = placed["ready"]
    per_node: dict[str, int] = {}
    for b in placed["bottles"]:
        per_node[labels[b["node_id"]]] = per_node.get(labels[b["node_id"]], 0) + 1
    return {
        "placed_per_second": round(bottles / max(ready), 2),
        "ready_first_seconds": round(min(ready), 2),
        "ready_p50_seconds": round(pct(ready, 50), 2),
        "ready_p99_seconds": round(pct(ready, 99), 2),
        "per_node": dict(sorted(per_node.items())),
    }


def vm_records(node: Node) -> list[BottleRecord]:
    """The node's VM bottles (a pool's waiting members are not listed)."""
    with node.client() as c:
        return [b for b in c.all_bottles() if b.sidecar_vm is not None]


def vm_pools(
    cluster: NetCluster, driver: Any, labels: dict[str, str], bottles: int, lease: float
) -> dict[str, Any]:
    """``bottles`` VM bottles placed without a warm pool, then with one full on every node;
    every VM bottle and pool gone afterwards."""
    spec = json.dumps(
        spec_doc(cluster.root, egress=False, bridge=None, workload=("/bin/sleep", "600"))
    )
    share = -(-bottles // len(cluster.nodes))
    out: dict[str, Any] = {"vm_boot_seconds": cluster.vm_boot, "pool_size_per_node": share}

    def all_gone() -> bool:
        return not any(vm_records(n) for n in cluster.nodes)

    out["without_pool"] = timed_pool(
        driver, labels, "vm-off", bottles, lease, spec=spec, pool="off"
    )
    driver.call("close", id="vm-off", timeout=600)
    wait_until("the VM bottles destroyed", all_gone, 300)
    keys = {}
    began = time.monotonic()
    for n in cluster.nodes:
        with n.client() as c:
            keys[n.label] = c.ensure_pool(spec, share).spec_hash

    def full() -> bool:
        for n in cluster.nodes:
            with n.client() as c:
                ready = {p.spec_hash: p.ready for p in c.list_pools()}
            if ready.get(keys[n.label], 0) < share:
                return False
        return True

    wait_until("every node's pool full", full, 900)
    out["pools_full_seconds"] = round(time.monotonic() - began, 1)
    out["with_pool"] = timed_pool(driver, labels, "vm-auto", bottles, lease, spec=spec)
    out["with_pool"]["pool_members_taken"] = sum(
        1 for n in cluster.nodes for b in vm_records(n) if (b.sidecar_vm or "").startswith("bn-p-")
    )
    driver.call("close", id="vm-auto", timeout=600)
    for n in cluster.nodes:
        with n.client() as c:
            c.remove_pool(keys[n.label])
    wait_until("the VM bottles destroyed", all_gone, 300)
    wait_until(
        "no pool member left", lambda: not any(n.fake.live_pids() for n in cluster.nodes), 300
    )
    out["plain_over_pooled_p50"] = round(
        out["without_pool"]["ready_p50_seconds"] / out["with_pool"]["ready_p50_seconds"], 1
    )
    return out


def run(bottles: int, lease: float, vm_boot: float | None, vm_bottles: int) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="bnb-", dir="/tmp")
    uid = None if unprivileged_python_works() else RAY_UID
    cluster = NetCluster(root, CAPACITY, ray_uid=uid, lease_grace=GRACE, vm_boot=vm_boot)
    out: dict[str, Any] = {"bottles": bottles, "lease": lease, "grace": GRACE, "nodes": 3}
    try:
        started = time.monotonic()
        cluster.start()
        out["cluster_start_seconds"] = round(time.monotonic() - started, 1)
        driver = cluster.driver()
        labels = {k: v["bottlenet-node"] for k, v in driver.call("nodes").items()}
        out["cold"] = timed_pool(driver, labels, "cold", bottles, lease)
        with_pool = workers_pss(cluster)
        driver.call("close", id="cold", timeout=600)
        wait_until(
            "the cold pool destroyed and every bottle free again",
            lambda: (
                not any(n.names() for n in cluster.nodes) and driver.call("free") == sum(CAPACITY)
            ),
            120,
        )
        idle = workers_pss(cluster)
        out["warm"] = timed_pool(driver, labels, "bench", bottles, lease)
        per_node = out["warm"]["per_node"]
        warm = workers_pss(cluster)
        out["node_memory"] = {}
        for n in cluster.nodes:
            held, (workers, pss) = out["cold"]["per_node"].get(n.label, 0), with_pool[n.label]
            grew = warm[n.label][1] - idle[n.label][1]
            out["node_memory"][n.label] = {
                "bottles": held,
                "ray_workers": workers,
                "workers_pss_mib": round(pss, 1),
                "pss_mib_per_bottle": round(pss / held, 2) if held else 0.0,
                "workers_pss_mib_no_bottle": round(idle[n.label][1], 1),
                "pss_kib_per_bottle_added": round(grew * 1024 / per_node[n.label], 1)
                if per_node.get(n.label)
                else 0.0,
            }
        # a cold pool's floor: a Ray worker process started on each node, nothing else
        started_alone = driver.call("worker_start", timeout=300)
        out["ray_worker_start_seconds"] = [round(s, 2) for s in started_alone]
        if vm_boot is not None:
            out["vm"] = vm_pools(cluster, driver, labels, vm_bottles, lease)
        lost = max(cluster.nodes, key=lambda n: per_node.get(n.label, 0))
        out["lost_node_bottles"] = len(lost.names())
        lost_at = time.monotonic()
        cluster.partition(lost)
        wait_until("the lost node reaps", lambda: lost.names() == set(), 300)
        out["loss_to_last_reaped_seconds"] = round(time.monotonic() - lost_at, 1)
        driver.call("close", id="bench", timeout=600)
        driver.close()
        out["orphans"] = sum(len(n.names()) for n in cluster.nodes) + sum(
            len(n.fake.live_pids()) for n in cluster.nodes
        )
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bottles", type=int, default=30)
    parser.add_argument("--lease", type=float, default=6.0)
    parser.add_argument(
        "--vm-boot", type=float, help="also VM bottles, without and with warm pools: B seconds"
    )
    parser.add_argument("--vm-bottles", type=int, default=9)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if args.vm_boot is not None and os.geteuid() != 0:
        sys.exit("fleet.py --vm-boot: run as root (the fake's exec-netns stand-in needs it)")
    figures = run(args.bottles, args.lease, args.vm_boot, args.vm_bottles)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
