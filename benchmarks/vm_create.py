"""How many VM boots a bottle's create waits for, and what its rm costs (a benchmark, not a
test; docs/performance.md, "A VM bottle's create and rm").

    .venv/bin/python benchmarks/vm_create.py [--boots 1.5,4.5] [--stop 1.5] [--rounds 5]

As root (the fake's isolating ``exec-netns`` stand-in needs it; the run enters a network
namespace of its own first, so the launch gate's outside checks go nowhere): a real daemon on
the fake smolvm (``tests/fakes/smolvm``, a TEST DOUBLE whose "VMs" are host processes) whose
VMs take B seconds to boot (``slow-start``) and S seconds to stop (``ignore-term`` with a
``stop_grace`` of S: the TERM is ignored, the KILL comes after S). For each B it creates
``--rounds`` socket-mode VM bottles one after the other and removes each, timing the control
calls as a launcher sees them:

* create-to-ready p50 at each B, and the slope between the two B: the number of boots on the
  create's critical path (2 when the sidecar and the agent boot one after the other, 1 when
  they boot together);
* ``bottle rm`` p50, against one VM's stop through the same fake CLI (the ratio is 1 when the
  two VMs stop together, 2 when one after the other);
* the smolvm calls one create made (from the fake's call log), counted once the daemon's start
  has read the binary's version and features and listed its machines (four calls, once per
  daemon, never in a create); a daemon's first create also learns where smolvm keeps a
  machine's directory (one or two ``data-dir`` calls, never again).

The machine is shared and busy: absolute seconds vary from run to run; quote the slope and the
ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.stats import pct  # noqa: E402
from tests import netguard  # noqa: E402
from tests.control.daemon_helpers import ENV  # noqa: E402
from tests.control.vmdaemon import VMDaemon, wait_for  # noqa: E402
from tests.fakes import FAKE_SMOLVM  # noqa: E402


def one_stop(daemon: VMDaemon, seconds: float) -> float:
    """Seconds one ``machine stop`` of a started fake VM takes (its own create and start are
    not timed)."""
    env = {**ENV, "SMOLVM_DATA_DIR": daemon.fake.path}
    base = [FAKE_SMOLVM, "machine"]
    name = "bench-stop"
    for argv in (["create", "--name", name], ["start", "--name", name]):
        subprocess.run([*base, *argv], env=env, check=True, capture_output=True)
    began = time.monotonic()
    subprocess.run([*base, "stop", "--name", name], env=env, check=True, capture_output=True)
    took = time.monotonic() - began
    subprocess.run([*base, "delete", "-f", "--name", name], env=env, capture_output=True)
    assert took >= seconds * 0.9, f"the fake's stop took {took:.2f} s, under its grace"
    return took


#: What a daemon's start asks smolvm, once (the version, the features, recovery's listing).
START_READS = ({"--version"}, {"create", "--help"}, {"exec", "--help"}, {"ls"})


def start_reads_done(daemon: VMDaemon) -> bool:
    """The daemon's start has made its reads (they run in the background after it answers)."""
    made = [set(c["argv"]) for c in daemon.fake.calls()]
    return all(any(want <= argv for argv in made) for want in START_READS)


def run_boot(boot: float, stop: float, rounds: int) -> dict[str, Any]:
    """Create and remove ``rounds`` VM bottles on a daemon whose VMs boot in ``boot`` s."""
    daemon = VMDaemon()
    daemon.fake.set_faults(
        "exec-netns", "slow-start", "ignore-term", slow_start=boot, stop_grace=stop
    )
    creates: list[float] = []
    removes: list[float] = []
    calls_per_create: list[int] = []
    try:
        daemon.start()
        wait_for(lambda: start_reads_done(daemon), 120, "the daemon's start reads")
        with daemon.client(timeout=600) as c:
            for i in range(rounds):
                before = len(daemon.fake.calls())
                began = time.monotonic()
                r = daemon.ctl("bottle", "create", f"b{i}", "--spec", daemon.spec, timeout=600)
                creates.append(time.monotonic() - began)
                assert r.returncode == 0, (r.stderr, daemon.log()[-3000:])
                calls_per_create.append(len(daemon.fake.calls()) - before)
                began = time.monotonic()
                c.destroy_bottle(f"b{i}")
                removes.append(time.monotonic() - began)
        vm_stop = one_stop(daemon, stop)
    finally:
        survivors = daemon.cleanup()
    assert not survivors, f"fake VM processes left: {survivors}"
    return {
        "boot": boot,
        "create_p50": pct(creates, 50),
        "creates": creates,
        "rm_p50": pct(removes, 50),
        "removes": removes,
        "vm_stop": vm_stop,
        "calls_per_create": calls_per_create,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boots", default="1.5,4.5", help="two boot times B, seconds")
    parser.add_argument("--stop", type=float, default=1.5, help="one VM's stop, seconds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    low, high = (float(b) for b in args.boots.split(","))
    if os.geteuid() != 0:
        sys.exit("vm_create.py: run as root (the fake's exec-netns stand-in needs it)")
    why = netguard.enter()
    if why is not None:
        sys.exit(f"vm_create.py: cannot enter a network namespace of its own: {why}")
    runs = [run_boot(b, args.stop, args.rounds) for b in (low, high)]
    slope = (runs[1]["create_p50"] - runs[0]["create_p50"]) / (high - low)
    print(
        f"{'boot B (s)':>10}  {'create p50 (s)':>14}  {'rm p50 (s)':>10}  {'one VM stop (s)':>15}"
    )
    for r in runs:
        row = (r["boot"], r["create_p50"], r["rm_p50"], r["vm_stop"])
        print("{:>10.2f}  {:>14.2f}  {:>10.2f}  {:>15.2f}".format(*row))
    rm_ratio = max(r["rm_p50"] / r["vm_stop"] for r in runs)
    print(f"boots on the create's critical path (slope of create p50 over B): {slope:.2f}")
    print(f"rm p50 / one VM's stop (the worse of the two runs): {rm_ratio:.2f}")
    first = max(r["calls_per_create"][0] for r in runs)
    later = sorted({n for r in runs for n in r["calls_per_create"][1:]})
    print(f"smolvm calls in one create: {first} in a daemon's first, then {later}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "slope": slope, "rm_ratio": rm_ratio}, f, indent=2)


if __name__ == "__main__":
    main()
