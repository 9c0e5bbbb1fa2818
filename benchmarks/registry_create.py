"""CreateBottle and AddForward against the number of bottles, in process (a benchmark).

    .venv/bin/python benchmarks/registry_create.py [--bottles 1000] [--window 100]

The same measurement as ``control_plane.py``'s, without the AMP round trip and the client
process around it: the daemon's own ``BottleRegistry`` (real reactor, real ``ForwardTable``
listeners on loopback aliases, real state file in a temp dir) creates forward-only bottles one
after another, each with one forward (port 0, target 127.0.0.1:9: nothing connects). Each
operation is timed in this thread's CPU time (``time.thread_time``), which other processes on
a busy machine do not inflate as they do wall time. Prints the p50 over the first ``--window``
bottles and over the last, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from twisted.internet import task  # noqa: E402
from twisted.internet.defer import Deferred  # noqa: E402

from benchmarks.stats import pct  # noqa: E402
from bottlenet.bottles.registry import BottleRegistry  # noqa: E402
from bottlenet.bottles.store import StateStore  # noqa: E402
from bottlenet.forward.aliases import AliasRegistry  # noqa: E402
from bottlenet.forward.spec import AliasPool, parse_target  # noqa: E402
from bottlenet.forward.table import ForwardTable  # noqa: E402


async def fill(reactor: Any, total: int) -> tuple[list[float], list[float]]:
    work = tempfile.mkdtemp(prefix="bn-rc-")
    try:
        aliases = AliasRegistry(AliasPool.parse("127.81.0.0/16"))
        table = ForwardTable(reactor, aliases, state_dir=work)
        store = StateStore(work)
        store.save(store.load())
        registry = BottleRegistry(
            reactor, table, aliases, state_dir=work, max_bottles=total + 1, store=store
        )
        target = parse_target("127.0.0.1:9")
        create: list[float] = []
        forward: list[float] = []
        for i in range(total):
            name = f"b{i:05d}"
            t0 = time.thread_time()
            await registry.create_bottle(name)
            t1 = time.thread_time()
            await registry.add_forward(name, "web", target)
            t2 = time.thread_time()
            create.append(1e3 * (t1 - t0))
            forward.append(1e3 * (t2 - t1))
        for name in [b.name for b in registry.list_bottles()]:
            await registry.destroy_bottle(name)
        store.close()
        return create, forward
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(create: list[float], forward: list[float], window: int) -> None:
    n = len(create)
    first, last = slice(0, window), slice(n - window, n)
    c0, c1 = pct(create[first], 50), pct(create[last], 50)
    f0, f1 = pct(forward[first], 50), pct(forward[last], 50)
    print(f"{n} forward-only bottles, one forward each; p50 CPU ms over {window} ops:")
    print(f"| op | bottles 0-{window - 1} | bottles {n - window}-{n - 1} | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| CreateBottle | {c0:.3f} | {c1:.3f} | {c1 / c0:.2f}x |")
    print(f"| AddForward | {f0:.3f} | {f1:.3f} | {f1 / f0:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--bottles", type=int, default=1000)
    p.add_argument("--window", type=int, default=100)
    args = p.parse_args()

    async def run(reactor: Any) -> None:
        create, forward = await fill(reactor, args.bottles)
        report(create, forward, args.window)

    task.react(lambda reactor: Deferred.fromCoroutine(run(reactor)))


if __name__ == "__main__":
    main()
