"""Control-plane cost against the number of bottles (a benchmark, not a test).

    .venv/bin/python benchmarks/control_plane.py [--at 1,100,1000,10000] [--window 100]

Starts the daemon (``python -m twisted bottlenet``, forward-only bottles only), then with the
blocking client creates forward-only bottles one after another, each with one forward
(``CreateBottle`` + ``AddForward``, port 0, target 127.0.0.1:9: nothing ever connects). For
each size N in ``--at`` it times the ``--window`` creations that take the daemon from N-1 to
N-1+window bottles, so "at 10,000" is bottles 10,000 to 10,099. At the end: every page of
``ListBottles`` and of ``Stats``, the daemon's RSS per bottle, and recovery after ``kill -9``
(time until the restarted daemon logs "recovery done" and answers, with every bottle back).
Prints a markdown table; ``--json`` writes the figures. Loopback and a temp dir only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.stats import pct  # noqa: E402
from bottlenet.control.blocking import BlockingControlClient  # noqa: E402

RECOVERED = re.compile(rb"recovery done: (\d+) bottle")


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Daemon:
    def __init__(self, work: str, max_bottles: int) -> None:
        self.work = work
        self.control = os.path.join(work, "c.sock")
        self.args = [
            sys.executable,
            "-m",
            "twisted",
            "bottlenet",
            "--log-format=text",
            "--state-dir",
            os.path.join(work, "state"),
            "--control",
            f"unix:{self.control}",
            "--max-bottles",
            str(max_bottles),
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.log = ""

    def start(self) -> float:
        """Start; returns seconds until it logged "recovery done" and answers a ping."""
        t0 = time.monotonic()
        env = dict(os.environ, PYTHONPATH=ROOT)
        env.pop("XDG_RUNTIME_DIR", None)
        self.starts += 1
        self.log = os.path.join(self.work, f"daemon-{self.starts}.log")
        with open(self.log, "wb") as out:  # a file, never a pipe that could fill and block it
            self.proc = subprocess.Popen(self.args, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.wait_for(RECOVERED, 600)
        with BlockingControlClient(self.control) as c:
            c.ping()
        return time.monotonic() - t0

    def wait_for(self, pattern: re.Pattern[bytes], timeout: float) -> re.Match[bytes]:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log, "rb") as f:
                seen = f.read()
            m = pattern.search(seen)
            if m:
                return m
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"control_plane: no {pattern.pattern!r}:\n{seen[-2000:]!r}")
            time.sleep(0.05)

    def kill(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--at", default="1,100,1000,10000")
    p.add_argument("--window", type=int, default=100)
    p.add_argument("--json")
    args = p.parse_args()
    sizes = [int(x) for x in args.at.split(",")]
    total = max(sizes) - 1 + args.window
    work = tempfile.mkdtemp(prefix="bottlenet-cp-")
    daemon = Daemon(work, max_bottles=total + 10)
    daemon.start()
    assert daemon.proc is not None
    rss0 = rss_kib(daemon.proc.pid)
    create: dict[int, list[float]] = {n: [] for n in sizes}
    forward: dict[int, list[float]] = {n: [] for n in sizes}
    windows = {n: range(n - 1, n - 1 + args.window) for n in sizes}
    started = time.monotonic()
    with BlockingControlClient(daemon.control, timeout=60) as c:
        for i in range(total):
            name = f"b{i:05d}"
            t0 = time.perf_counter()
            c.create_bottle(name)
            t1 = time.perf_counter()
            c.add_forward(name, "web", "127.0.0.1:9", 0)
            t2 = time.perf_counter()
            for n, window in windows.items():
                if i in window:
                    create[n].append(1e3 * (t1 - t0))
                    forward[n].append(1e3 * (t2 - t1))
                    if i == window[-1]:
                        print(
                            f"at {n}: CreateBottle p50 {pct(create[n], 50):.2f} ms,"
                            f" AddForward p50 {pct(forward[n], 50):.2f} ms",
                            file=sys.stderr,
                            flush=True,
                        )
        fill_s = time.monotonic() - started
        rss1 = rss_kib(daemon.proc.pid)
        t0 = time.perf_counter()
        pages = 0
        offset: int | None = 0
        names = 0
        while offset is not None:
            page = c.list_bottles(offset)
            names += len(page.items)
            pages += 1
            offset = page.next_offset
        list_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        stats = sum(1 for _ in c.all_stats())
        stats_s = time.perf_counter() - t0
    assert names == total and stats == total, (names, stats, total)
    daemon.kill(signal.SIGKILL)
    recovery_s = daemon.start()
    with BlockingControlClient(daemon.control, timeout=60) as c:
        recovered = sum(1 for _ in c.all_forwards())
    daemon.kill(signal.SIGTERM)
    shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {
        "bottles": total,
        "fill_s": fill_s,
        "window": args.window,
        "create_ms": {n: (pct(v, 50), pct(v, 99)) for n, v in create.items()},
        "add_forward_ms": {n: (pct(v, 50), pct(v, 99)) for n, v in forward.items()},
        "list_bottles": {"pages": pages, "seconds": list_s},
        "stats": {"records": stats, "seconds": stats_s},
        "rss_kib": {"empty": rss0, "full": rss1, "per_bottle": (rss1 - rss0) / total},
        "recovery": {"seconds": recovery_s, "forwards": recovered},
    }
    first = sizes[0]
    print(f"{total} forward-only bottles, one forward each; window {args.window} ops per size.\n")
    print("| bottles | CreateBottle p50 / p99 ms | AddForward p50 / p99 ms | p50 vs at 1 |")
    print("|---:|---:|---:|---:|")
    for n in sizes:
        c50, c99 = result["create_ms"][n]
        f50, f99 = result["add_forward_ms"][n]
        r_c = c50 / result["create_ms"][first][0]
        r_f = f50 / result["add_forward_ms"][first][0]
        print(
            f"| {n:,} | {c50:.2f} / {c99:.2f} | {f50:.2f} / {f99:.2f} | {r_c:.2f}x / {r_f:.2f}x |"
        )
    print()
    print(
        f"ListBottles, all {pages} pages of {total:,}: {list_s * 1e3:.0f} ms;"
        f" Stats, all pages of {stats:,}: {stats_s * 1e3:.0f} ms;"
        f" daemon RSS {rss0:,} KiB empty, {rss1:,} KiB full ="
        f" {result['rss_kib']['per_bottle']:.1f} KiB per bottle;"
        f" restart after kill -9: {recovery_s:.1f} s to 'recovery done' + ping,"
        f" {recovered:,} forwards back."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
