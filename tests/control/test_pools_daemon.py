"""Warm pools end to end: a real daemon on the fake smolvm (``tests/fakes/smolvm``, a TEST
DOUBLE whose "VMs" are host processes; ``exec-netns`` needs root) driven by ``bottlenetctl``:
``pool ensure``, ``pool ls --json``, a create that takes a member (its workload started,
its exec named), the pool kept across a SIGKILL of the daemon, ``pool rm``; a scoped peer's
``pool ls`` is refused."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests import netguard

from .vmdaemon import VMDaemon, wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not netguard.active(), reason="exec-netns needs root and the netguard"
)


def pools(d: VMDaemon) -> list[dict[str, Any]]:
    r = d.ctl("pool", "ls", "--json")
    assert r.returncode == 0, r.stderr
    result: list[dict[str, Any]] = json.loads(r.stdout)
    return result


def ready(d: VMDaemon, n: int) -> None:
    wait_for(lambda: [p["ready"] for p in pools(d)] == [n], 120, f"{n} ready in the pool")


def test_a_pool_serves_a_create_survives_a_restart_and_is_removed() -> None:
    """Two members made; ``bottle create --pool only`` takes one (its workload runs, its
    exec sees its own name); the pool fills again; after a SIGKILL and a restart the pool
    and its members are there (no machine made again); ``pool rm`` destroys them."""
    d = VMDaemon()
    try:
        with open(d.spec, "a") as f:
            f.write('workload = ["/bin/sleep", "300"]\n')
        d.start()
        r = d.ctl("pool", "ensure", "--spec", d.spec, "--size", "2")
        assert r.returncode == 0 and b"2 kept" in r.stdout, r.stderr
        ready(d, 2)
        assert d.ctl("bottle", "ls").stdout.count(b"\n") <= 1  # no bottle listed
        r = d.ctl("--json", "bottle", "create", "job", "--spec", d.spec, "--pool", "only")
        assert r.returncode == 0, (r.stderr, d.log()[-2000:])
        assert json.loads(r.stdout)["workload"] == "running"
        r = d.ctl("bottle", "exec", "job", "--", "/bin/sh", "-c", "echo $BOTTLENET_BOTTLE")
        assert r.stdout.strip() == b"job", r.stderr
        ready(d, 2)
        machines = set(d.fake.state()["machines"])
        d.kill()
        d.start()
        ready(d, 2)
        assert set(d.fake.state()["machines"]) == machines
        key = pools(d)[0]["spec_hash"]
        r = d.ctl("pool", "rm", key)
        assert r.returncode == 0 and b"2 waiting" in r.stdout, r.stderr
        wait_for(lambda: len(d.fake.state()["machines"]) == 2, 60, "the members destroyed")
        assert pools(d) == []
        assert d.ctl("bottle", "rm", "job").returncode == 0
    finally:
        survivors = d.cleanup()
    assert not survivors
