"""A warm pool's hit: a create that takes a ready bottle, end to end and inside bottlenet (a
benchmark, not a test; docs/performance.md, "Warm pools").

    .venv/bin/python benchmarks/pool_hit.py [--boot 4.5] [--size 3] [--rounds 6]

As root (the fake's ``exec-netns`` stand-in needs it; the run enters a network namespace of
its own first): a real daemon on the fake smolvm (``tests/fakes/smolvm``, a TEST DOUBLE whose
"VMs" are host processes) whose VMs take B seconds to boot. It times one plain create (both
VMs booted for it), then ``pool ensure --size N`` of the same spec (with a workload), waits
for N ready, and times ``--rounds`` creates of that spec, each waiting for the pool to be
full again before the next:

* a hit's time end to end, as a launcher's blocking client sees the ``CreateBottle`` answer;
* the part of it spent in bottlenet: that time less the seconds the daemon's smolvm calls of
  the create took (the daemon's own ``/metrics`` histogram, read before and after; the take
  runs its calls one after the other), so the client's round trip counts as bottlenet's;
* the ratio of a plain create to a hit, and that the pool refilled after each.

The machine is shared and busy: quote the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.stats import pct  # noqa: E402
from tests import netguard  # noqa: E402
from tests.control.vmdaemon import VMDaemon  # noqa: E402

_SUM = re.compile(rb"^bottlenet_smolvm_call_duration_seconds_sum\{[^}]*\} ([0-9.e+-]+)$", re.M)


def smolvm_seconds(metrics: str) -> float:
    """The daemon's smolvm calls' seconds so far, every subcommand (``/metrics``)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(metrics)
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return sum(float(v) for v in _SUM.findall(data))


def wait_ready(c: Any, key: str, size: int, timeout: float) -> float:
    """Seconds until the pool ``key`` has ``size`` ready."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        pools = {p.spec_hash: p for p in c.list_pools()}
        if pools[key].ready >= size:
            return time.monotonic() - began
        time.sleep(0.05)
    raise AssertionError(f"the pool did not fill in {timeout} s: {pools[key]}")


def run(boot: float, size: int, rounds: int) -> dict[str, Any]:
    metrics = "/tmp/bn-pool-bench-metrics.sock"
    daemon = VMDaemon("--metrics", f"unix:{metrics}")
    daemon.fake.set_faults("exec-netns", "slow-start", slow_start=boot)
    spec_json = _spec_json(daemon.spec)
    hits: list[float] = []
    inside: list[float] = []
    refills: list[float] = []
    try:
        daemon.start()
        with daemon.client(timeout=600) as c:
            began = time.monotonic()
            c.create_bottle("plain", spec=spec_json, pool="off", timeout=600)
            plain = time.monotonic() - began
            c.destroy_bottle("plain")
            key = c.ensure_pool(spec_json, size).spec_hash
            fill = wait_ready(c, key, size, 600)
            for i in range(rounds):
                before = smolvm_seconds(metrics)
                began = time.monotonic()
                b = c.create_bottle(f"hit{i}", spec=spec_json, pool="only", timeout=600)
                took = time.monotonic() - began
                in_smolvm = smolvm_seconds(metrics) - before
                assert b.workload == "running", b
                hits.append(took)
                inside.append(took - in_smolvm)
                refills.append(wait_ready(c, key, size, 600))
            for i in range(rounds):
                c.destroy_bottle(f"hit{i}")
            c.remove_pool(key)
    finally:
        survivors = daemon.cleanup()
        if os.path.exists(metrics):
            os.unlink(metrics)
    assert not survivors, f"fake VM processes left: {survivors}"
    return {
        "boot": boot,
        "plain_create": plain,
        "fill_seconds": fill,
        "hit_p50": pct(hits, 50),
        "hit_max": max(hits),
        "in_bottlenet_p50": pct(inside, 50),
        "in_bottlenet_max": max(inside),
        "refill_p50": pct(refills, 50),
        "hits": hits,
        "in_bottlenet": inside,
    }


def _spec_json(path: str) -> str:
    """The spec file as the CLI sends it, with a workload (a hit starts it)."""
    import tomllib

    with open(path, "rb") as f:
        doc = tomllib.load(f)
    doc["agent"]["workload"] = ["/bin/sleep", "600"]
    return json.dumps(doc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boot", type=float, default=4.5, help="a VM's boot B, seconds")
    parser.add_argument("--size", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("pool_hit.py: run as root (the fake's exec-netns stand-in needs it)")
    why = netguard.enter()
    if why is not None:
        sys.exit(f"pool_hit.py: cannot enter a network namespace of its own: {why}")
    r = run(args.boot, args.size, args.rounds)
    print(f"boot B {r['boot']:.2f} s; plain create {r['plain_create']:.2f} s")
    print(f"pool of {args.size} filled in {r['fill_seconds']:.2f} s")
    print(f"hit end to end: p50 {r['hit_p50'] * 1000:.0f} ms, max {r['hit_max'] * 1000:.0f} ms")
    print(
        f"of it in bottlenet: p50 {r['in_bottlenet_p50'] * 1000:.1f} ms, "
        f"max {r['in_bottlenet_max'] * 1000:.1f} ms"
    )
    print(f"plain create / hit p50: {r['plain_create'] / r['hit_p50']:.1f}")
    print(f"refill to {args.size} ready after a hit: p50 {r['refill_p50']:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
