"""The guest kit's cost on the host: its build, its cache hit, its check, its size, and a
command's start through it against the same interpreter run directly and another python3.

    .venv/bin/python benchmarks/kit_cost.py [--runs 30] [--rounds 2] [--other /usr/bin/python3]

The kit is built from this interpreter into a fresh cache (``KitCache.ensure``), found again
by a second cache over the same directory (the check a daemon's start makes), and checked
against its digest (``KitCache.verify``, the check before each mount). Then ``whoami``
(start, print, exit) runs ``--runs`` times per round, the three commands alternating: the
kit's own program line, this interpreter on the kit's ``main.pyc`` with the same flags, and
``--other`` (of the same minor version) on it. Prints each figure's median in wall time and
the kit's ratio to each peer, per round: quote the ratios, the machine's load moves the rest.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from subprocess import DEVNULL
from typing import TypeVar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.stats import pct  # noqa: E402
from bottlenet.kit.build import Kit, KitCache, remove  # noqa: E402
from bottlenet.kit.program import MAIN  # noqa: E402

T = TypeVar("T")


def timed(call: Callable[[], T]) -> tuple[float, T]:
    """Seconds ``call()`` took, and what it returned."""
    t0 = time.perf_counter()
    value = call()
    return time.perf_counter() - t0, value


def starts(kit: Kit, other: str, runs: int) -> dict[str, list[float]]:
    """Milliseconds of ``whoami`` per command, the commands alternating run by run."""
    flags = ["-I", "-S", "-B", "-X", "utf8", os.path.join(kit.root, MAIN), "whoami"]
    commands = {
        "kit": kit.host_program.argv("whoami"),
        "same interpreter": [sys.executable, *flags],
        f"other python3 ({other})": [other, *flags],
    }
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, argv in commands.items():
            seconds, _ = timed(partial(subprocess.run, argv, check=True, stdout=DEVNULL))
            samples[name].append(1e3 * seconds)
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--other", default="/usr/bin/python3")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="bn-kitcost-")
    try:
        build_s, kit = timed(lambda: KitCache(work).ensure())
        hit_s, again = timed(lambda: KitCache(work).ensure())
        verify_s, ok = timed(lambda: KitCache(work).verify(kit))
        assert ok and again.digest == kit.digest and again.built_in == 0.0
        print(f"kit {kit.digest[:12]} ({kit.machine}) from {sys.executable}")
        print("| what | result |\n|---|---|")
        print(f"| first build (find inputs, copy, strip, compile, digest) | {build_s:.2f} s |")
        print(f"| cache hit at a start (inputs found, tree digest checked) | {hit_s:.3f} s |")
        print(f"| check before a mount (the tree digest) | {1e3 * verify_s:.0f} ms |")
        print(f"| size | {kit.size / 2**20:.1f} MiB |")
        for r in range(args.rounds):
            samples = starts(kit, args.other, args.runs)
            medians = {name: pct(v, 50) for name, v in samples.items()}
            base = medians["kit"]
            shown = ", ".join(
                f"{name} {m:.1f} ms" + ("" if name == "kit" else f" (kit {base / m:.2f}x)")
                for name, m in medians.items()
            )
            print(f"round {r + 1}, whoami median of {args.runs}: {shown}")
    finally:
        remove(work)  # the kit's read-only folders too


if __name__ == "__main__":
    main()
