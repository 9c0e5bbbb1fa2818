"""The multi-node tier: three bottle nodes, each a network, PID and mount namespace with its
own address on a test bridge, its own raylet (as an unprivileged uid) and its own bottlenet
daemon (fake smolvm, a TEST DOUBLE); the Ray head (with Redis, so it can restart) and the
trainer in namespaces of their own; token auth on; no route off the bridge
(``tests/fleet/netns.py``). 33 bottles (30 forward-only, 3 VM) under a 6 s lease, then each
failure of docs/fleet.md in turn. The tests run in order on one cluster.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.bottles.harness import spec_doc
from tests.control.daemon_helpers import REPO
from tests.fleet.netns import (
    OTHER_UID,
    RAY_UID,
    SITE,
    SYSTEM_PYTHON,
    Driver,
    NetCluster,
    Node,
    unprivileged_python_works,
    wait_until,
)

LEASE = 6.0
GRACE = 3.0
CAPACITY = (20, 20, 20)
FORWARD = 30

if shutil.which("redis-server") is None or shutil.which("nsenter") is None:
    pytest.skip("the multi-node tier needs redis-server and nsenter", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the multi-node tier makes namespaces: it needs root", allow_module_level=True)


class Tier:
    """The cluster, its trainer and what the tests learn on the way."""

    def __init__(self, cluster: NetCluster, driver: Driver) -> None:
        self.c = cluster
        self.d = driver
        self.labels: dict[str, str] = {}
        self.pools: dict[str, list[dict[str, str]]] = {}
        self.figures: dict[str, Any] = {}

    def node(self, label: str) -> Node:
        return next(n for n in self.c.nodes if n.label == label)

    def label_of(self, node_id: str) -> str:
        return self.labels[node_id]

    def held(self) -> dict[str, set[str]]:
        return {n.label: n.names() for n in self.c.nodes}

    def records(self, node: Node) -> list[Any]:
        with node.client() as c:
            return list(c.all_bottles())

    def all_answer(self, pool: str) -> bool:
        return all(set(v) <= {"ok"} for v in self.status_by_node(pool).values())

    def status_by_node(self, pool: str) -> dict[str, list[str]]:
        """Each node's results of the trainer's status call on every bottle of ``pool``."""
        out: dict[str, list[str]] = {}
        for r in self.d.call("status", id=pool, timeout=30):
            out.setdefault(self.label_of(r["node_id"]), []).append(r.get("error", "ok"))
        return out


@pytest.fixture(scope="module")
def tier() -> Iterator[Tier]:
    why = unprivileged_python_works()
    root = tempfile.mkdtemp(prefix="bnm-", dir="/tmp")
    cluster = NetCluster(root, CAPACITY, ray_uid=None if why else RAY_UID, lease_grace=GRACE)
    driver = None
    try:
        cluster.start()
        driver = cluster.driver()
        t = Tier(cluster, driver)
        t.labels = {k: v["bottlenet-node"] for k, v in driver.call("nodes").items()}
        t.figures["ray_uid"] = cluster.ray_uid
        yield t
        driver.close()  # closes every pool, some after their nodes were lost
        driver = None
        assert t.held() == {n.label: set() for n in cluster.nodes}, "bottles left behind"
        assert gcs_check_failures(root) == [], "the head's GCS aborted as the pools closed"
    finally:
        if driver is not None:
            driver.close()
        namespaces = cluster.namespace_ids()
        cluster.stop()
        wait_until(
            "no process left in the cluster's namespaces",
            lambda: cluster.processes_in(namespaces) == [],
            60,
        )
        shutil.rmtree(root, ignore_errors=True)


def gcs_check_failures(root: str) -> list[str]:
    """The head's GCS log lines of a failed internal check (the GCS aborts on one: Ray 2.56
    to 2.60 did when a pool's reservation, whose bundles sat on lost nodes, was removed)."""
    found = []
    for log in glob.glob(os.path.join(root, "ray-head", "session_*", "logs", "gcs_server*")):
        with open(log, errors="replace") as fh:
            found += [line.strip()[:300] for line in fh if "Check failed" in line]
    return found


def vm_spec(tier: Tier) -> str:
    return json.dumps(spec_doc(tier.c.root, egress=False))


def test_placement_never_exceeds_a_nodes_bottle_resource(tier: Tier) -> None:
    """30 forward-only bottles and a VM bottle on each node: every bottle sits on its host's
    node, no node holds more than its ``bottle`` resource, and the 30 are spread (at most
    11/10/9)."""
    for n in tier.c.nodes:  # first: the VM bottles' nodes are chosen by their labels
        vm = tier.d.call(
            "pool", id=f"vm-{n.label}", count=1, lease=LEASE, spec=vm_spec(tier),
            selector={"bottlenet-node": n.label}, prefix="vm",
        )  # fmt: skip
        tier.pools[f"vm-{n.label}"] = vm["bottles"]
    result = tier.d.call("pool", id="main", count=FORWARD, lease=LEASE, timeout=600)
    tier.pools["main"] = result["bottles"]
    tier.figures["pool_seconds"] = result["seconds"]
    held = tier.held()
    for n in tier.c.nodes:
        assert len(held[n.label]) <= n.bottles, (n.label, len(held[n.label]))
    spread = [sum(1 for b in result["bottles"] if tier.label_of(b["node_id"]) == n.label)
              for n in tier.c.nodes]  # fmt: skip
    assert max(spread) - min(spread) <= 2 and sum(spread) == FORWARD, spread
    assert sum(len(v) for v in held.values()) == FORWARD + len(tier.c.nodes)
    for pool in tier.pools.values():
        for b in pool:  # the node's name ends in the actor's name space's tag (scoped uid)
            node_names = {_TAG.sub("", n) for n in held[tier.label_of(b["node_id"])]}
            assert b["name"] in node_names
    for n in tier.c.nodes:
        for record in tier.records(n):
            assert record.lease_seconds == LEASE
            assert record.owner and record.owner.startswith("ray-job-")


def test_a_drained_node_gets_no_new_bottle_while_its_bottles_work(tier: Tier) -> None:
    """The node with the most room drained (Ray would pick it): 4 new bottles all land
    elsewhere (its DRAINING refusals placed again), and every bottle it holds still answers,
    its VM bottle still execs."""
    held = tier.held()
    drained = max(tier.c.nodes, key=lambda n: n.bottles - len(held[n.label]))
    with drained.client() as c:
        c.drain()
    try:
        more = tier.d.call("pool", id="more", count=4, lease=LEASE, timeout=300)
        tier.figures["drain_refusals"] = more["refusals"]
        assert {tier.label_of(b["node_id"]) for b in more["bottles"]} <= {
            n.label for n in tier.c.nodes if n is not drained
        }
        assert drained.names() == held[drained.label]
        by_node = tier.status_by_node("main")
        assert set(by_node.get(drained.label, [])) <= {"ok"}
        [(code, out)] = [
            r["ok"]
            for r in tier.d.call(
                "exec", id=f"vm-{drained.label}", argv=["echo", "drained-but-working"]
            )
        ]
        assert (code, out) == (0, "drained-but-working\n")
    finally:
        with drained.client() as c:
            c.undrain()
    tier.d.call("close", id="more")


def test_a_restarted_daemon_restores_its_bottles_and_the_actors_carry_on(tier: Tier) -> None:
    """SIGKILL one node's daemon and start it again: the same bottles, their leases renewed
    by the same actors after the restart, status and exec through the actors work."""
    n1 = tier.node("n1")
    before = n1.names()
    killed_at = time.time()
    n1.kill_daemon()
    tier.c.start_daemon(n1)
    wait_until("n1's daemon restores every bottle", lambda: n1.names() == before, 60)
    wait_until(
        "n1's leases renewed after the restart",
        lambda: all(r.lease_expires_at > killed_at + LEASE for r in tier.records(n1)),
        4 * LEASE,
    )
    assert n1.names() == before
    assert set(tier.status_by_node("main").get("n1", [])) <= {"ok"}
    [(code, _)] = [r["ok"] for r in tier.d.call("exec", id="vm-n1", argv=["true"])]
    assert code == 0


def test_a_head_restart_reaps_nothing(tier: Tier) -> None:
    """The Ray head's namespace killed and a new head started on the same Redis: no bottle
    is reaped, every lease is renewed past the moment a reap would have come, the actors
    answer the trainer."""
    before = tier.held()
    killed_at = time.time()
    tier.c.kill_head()
    tier.c.start_head()
    tier.figures["head_outage_seconds"] = time.time() - killed_at
    every = [r for n in tier.c.nodes for r in tier.records(n)]
    wait_until(
        "every lease renewed past lease + grace after the head went",
        lambda: all(
            r.lease_expires_at > killed_at + LEASE + GRACE
            for n in tier.c.nodes
            for r in tier.records(n)
        ),
        120,
    )
    assert tier.held() == before
    assert len(every) == sum(len(v) for v in before.values())
    wait_until(
        "the actors answer the trainer again",
        lambda: tier.all_answer("main"),
        120,
    )


def _gone_without_a_trace(node: Node) -> None:
    """No bottle, VM, socket, alias or uid reservation left on ``node``."""
    assert node.names() == set()
    bottles_dir = os.path.join(node.root, "state", "bottles")
    assert not os.path.isdir(bottles_dir) or os.listdir(bottles_dir) == []
    assert node.fake.live_pids() == []
    assert node.fake.state()["machines"] == {}
    aliases = node.ns.sh("ip -4 -o addr show dev lo")
    assert [line for line in aliases.splitlines() if "127.0.0.1/" not in line] == []
    uids = os.path.join(node.fake.path, ".cache", "smolvm", "uids")
    assert not os.path.isdir(uids) or [e for e in os.listdir(uids) if e.isdigit()] == []


def _lose(tier: Tier, node: Node, how: str) -> None:
    others = {n.label: n.names() for n in tier.c.nodes if n is not node}
    lost_at = time.monotonic()
    if how == "partition":
        tier.c.partition(node)
    else:
        tier.c.kill_raylet(node)
    wait_until(
        f"the trainer sees {node.label}'s actors fail",
        lambda: "ok" not in tier.status_by_node("main").get(node.label, []),
        120,
    )
    tier.figures[f"{how}_seen_seconds"] = time.monotonic() - lost_at
    tier.figures[f"{how}_reaped_seconds"] = (
        lost_at
        and wait_until(
            f"{node.label} reaps its leased bottles",
            lambda: node.names() == set(),
            3 * (LEASE + GRACE) + 60,
        )
        + (time.monotonic() - lost_at) * 0
    )
    _gone_without_a_trace(node)
    assert {n.label: n.names() for n in tier.c.nodes if n is not node} == others


def test_a_partitioned_node_fails_its_actors_and_reaps_its_bottles(tier: Tier) -> None:
    """n2's link down: the trainer sees its actors fail; n2 reaps every leased bottle once
    lease and grace run out (its actors stop renewing without their owner), leaving nothing;
    the other nodes keep theirs."""
    n2 = tier.node("n2")
    _lose(tier, n2, "partition")
    tier.c.partition(n2, up=True)
    tier.c.stop_ray(n2)


def test_a_killed_raylet_fails_its_actors_and_its_node_reaps(tier: Tier) -> None:
    """n3's raylet SIGKILLed: its workers go with it, the trainer sees the actor error, and
    n3 reaps its leased bottles, leaving nothing."""
    _lose(tier, tier.node("n3"), "raylet")
    tier.c.stop_ray(tier.node("n3"))


#: A scoped name space's tag at the end of a node's bottle name (docs/protocol.md).
_TAG = re.compile(r"-[0-9a-f]{12}$")


def _ctl(
    uid: int, node: Node, *args: str, capability: str | None = None
) -> subprocess.CompletedProcess[str]:
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", SYSTEM_PYTHON,
            "-m", "bottlenet.cli", "--control", node.control, "--json", *args]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "PYTHONPATH": f"{SITE}:{REPO}"}
    if capability is not None:
        env["BOTTLENET_CAPABILITY"] = capability
    return subprocess.run(argv, env=env, capture_output=True, text=True, cwd="/", timeout=120)


def test_a_scoped_uid_cannot_see_or_touch_another_owners_bottle(tier: Tier) -> None:
    """On n1, another scoped uid sees none of Ray's bottles and gets NOT_FOUND for each
    (status, rm); Ray's uid gets NOT_FOUND for that uid's bottle; both stay."""
    if tier.c.ray_uid is None:
        pytest.skip("Ray runs as root here (the system python cannot import this tree)")
    n1 = tier.node("n1")
    ray_bottle = next(iter(n1.names()))
    listed = _ctl(OTHER_UID, n1, "bottle", "ls")
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stdout
    for args in (("bottle", "status", ray_bottle), ("bottle", "rm", ray_bottle)):
        done = _ctl(OTHER_UID, n1, *args)
        assert done.returncode != 0 and "NOT_FOUND" in done.stderr, done.stderr
    made = _ctl(OTHER_UID, n1, "bottle", "create", "other-1")
    assert made.returncode == 0, made.stderr
    capability = json.loads(made.stdout)["capability"]  # its later calls present it
    done = _ctl(RAY_UID, n1, "bottle", "status", "other-1")
    assert done.returncode != 0 and "NOT_FOUND" in done.stderr
    names = n1.names()  # the node's names: a scoped bottle's ends in its name space's tag
    assert ray_bottle in names and any(n.startswith("other-1-") for n in names), names
    assert _ctl(OTHER_UID, n1, "bottle", "rm", "other-1", capability=capability).returncode == 0
