"""How long ``bottlenetctl`` takes to answer, against ``python -c pass`` (a benchmark, not a test).

    .venv/bin/python benchmarks/cli_start.py [--runs 20] [--tree DIR]... [--json F]

Starts the real daemon (forward-only, a temp state dir, two bottles) and runs, round-robin so a
busy moment hits every row alike: ``python -c pass`` (the floor: the same interpreter doing
nothing), then ``bottlenetctl --help``, ``--version``, ``status``, ``bottle ls`` and ``ping``
through this venv's ``bottlenetctl`` script (what users run). Each ``--tree DIR`` adds the same
commands as ``python -m bottlenet.cli`` with ``PYTHONPATH=DIR`` (e.g. an older checkout's
files, for before/after figures in one run). Prints the p50 wall time of each and its ratio to
the floor; the machine is shared and noisy, so only ratios within one run mean anything.

Every timed tree is byte-compiled first (``compileall``), as an installed package is: with
``PYTHONDONTWRITEBYTECODE`` set (as in this workplace) an editable checkout would otherwise
compile its sources on every start, and the figures would time the compiler.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.stats import pct  # noqa: E402
from bottlenet.control.blocking import BlockingControlClient  # noqa: E402
from tests.control.daemon_helpers import ENV, start_daemon, stop, wait_ready  # noqa: E402

COMMANDS: list[tuple[str, list[str]]] = [
    ("--help", ["--help"]),
    ("--version", ["--version"]),
    ("status", ["status"]),
    ("bottle ls", ["bottle", "ls"]),
    ("ping", ["ping"]),
]


def rows(control: str, trees: list[str]) -> list[tuple[str, list[str], dict[str, str]]]:
    """(label, argv, env) of every command to time; the floor first."""
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    env["BOTTLENET_CONTROL"] = control
    ctl = os.path.join(os.path.dirname(sys.executable), "bottlenetctl")
    out = [("python -c pass", [sys.executable, "-c", "pass"], env)]
    out += [(f"bottlenetctl {name}", [ctl, *argv], env) for name, argv in COMMANDS]
    for tree in trees:
        tree_env = {**env, "PYTHONPATH": tree}
        tag = os.path.basename(tree.rstrip("/")) or tree
        out += [
            (f"[{tag}] {name}", [sys.executable, "-m", "bottlenet.cli", *argv], tree_env)
            for name, argv in COMMANDS
        ]
    return out


def compile_trees(trees: list[str]) -> None:
    """Byte-compile this checkout's and each tree's ``bottlenet`` (an install has its .pyc)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for tree in [ROOT, *trees]:
        path = os.path.join(tree, "bottlenet")
        subprocess.run([sys.executable, "-m", "compileall", "-q", path], env=env, check=True)


def measure(
    table: list[tuple[str, list[str], dict[str, str]]], runs: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {label: [] for label, _, _ in table}
    for _ in range(runs):
        for label, argv, env in table:
            t0 = time.perf_counter()
            done = subprocess.run(argv, env=env, cwd="/", capture_output=True)
            times[label].append(time.perf_counter() - t0)
            # an older tree has no --version: its usage error (2) is timed all the same
            if done.returncode != 0 and not (label.startswith("[") and done.returncode == 2):
                raise SystemExit(f"{label} failed ({done.returncode}): {done.stderr.decode()}")
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--tree", action="append", default=[], metavar="DIR")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bottlenet-cli-start-")
    control = os.path.join(work, "run", "control.sock")
    proc = start_daemon(os.path.join(work, "state"), f"unix:{control}")
    try:
        wait_ready(control, proc)
        with BlockingControlClient(control) as c:
            c.create_bottle("b1")
            c.create_bottle("b2")
        compile_trees(args.tree)
        times = measure(rows(control, args.tree), args.runs)
    finally:
        stop(proc)
    floor = statistics.median(times["python -c pass"])
    print(f"{args.runs} runs each (ms): p50 / p90; ratio of p50 to python -c pass")
    for label, values in times.items():
        p50 = statistics.median(values)
        print(
            f"  {label:28s} {p50 * 1000:6.1f} / {pct(values, 90) * 1000:6.1f}   {p50 / floor:.1f}x"
        )
    if args.json:
        results: dict[str, Any] = {"seconds": times}
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
