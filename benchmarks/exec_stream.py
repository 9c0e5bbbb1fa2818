"""What the daemon's exec broker costs a launcher (a benchmark, not a test).

    .venv/bin/python benchmarks/exec_stream.py [--runs 30] [--mib 256] [--events 5]
        [--rounds 3] [--json F]

Needs root (the fake smolvm runs each "guest" command in a network-less namespace). It starts
the daemon with the fake smolvm (``tests/fakes/smolvm``, a TEST DOUBLE: its VMs are host
processes and its ``exec`` runs the command on the host), creates a socket-mode VM bottle and
measures, in one run, each figure two ways:

- **through the daemon**: the blocking client's ``exec`` two ways, with file descriptors
  (the daemon hands over the command's pipes: the default on a UNIX socket) and framed
  (``fds=False``: every byte through the daemon, as TLS clients have it), and
  ``bottlenetctl bottle exec`` (this venv's console script, what users run, on a byte-compiled
  tree as an installed package is: see ``benchmarks/cli_start.py``);
- **smolvm directly**: the same ``machine exec`` command line the daemon runs, started here
  with the same environment. That is the floor: what a launcher pays without bottlenet.

Figures: the round trip of ``exec -- true`` (p50, p90 of ``--runs``), the throughput of
``head -c MIB`` out of the command (stdout, read to the end) and into it (``cat >/dev/null``
fed from here), and the time from killing a bottle's sidecar VMM to the ``degraded`` event
(``--events`` bottles). Ratios are within this run; the machine is shared and noisy, so the
throughputs are measured ``--rounds`` times and each ratio is the median of the rounds' own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import IO, Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.cli_start import compile_trees  # noqa: E402
from benchmarks.stats import pct  # noqa: E402
from bottlenet.control.blocking import BlockingControlClient  # noqa: E402
from tests.control.daemon_helpers import ENV  # noqa: E402
from tests.control.vmdaemon import VMDaemon, wait_for  # noqa: E402
from tests.fakes import FAKE_SMOLVM  # noqa: E402

CHUNK = 1 << 16


class Count:
    """A sink that counts what it is given."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, data: bytes) -> int:
        self.n += len(data)
        return len(data)

    def flush(self) -> None:
        pass


class Zeros:
    """A source of ``total`` zero bytes with a real fd (the client pumps fds): a pipe fed by
    a thread."""

    def __init__(self, total: int) -> None:
        self.r, self.w = os.pipe()
        self.total = total
        self.thread = threading.Thread(target=self._feed, daemon=True)
        self.thread.start()

    def _feed(self) -> None:
        block = bytes(CHUNK)
        left = self.total
        with os.fdopen(self.w, "wb", buffering=0) as w:
            while left > 0:
                left -= w.write(block[: min(CHUNK, left)])

    def fileno(self) -> int:
        return self.r


def direct(d: VMDaemon, *rest: str) -> tuple[list[str], dict[str, str]]:
    """The daemon's own last ``machine exec`` line (without ``-t``) with ``rest`` as the
    command, and its environment, from the fake's call log."""
    for call in reversed(d.fake.calls()):
        argv = call["argv"]
        if argv[:2] == ["machine", "exec"]:
            cut = argv.index("--")
            head = [a for a in argv[:cut] if a != "-t"]
            # the daemon's PATH too: the fake's `env python3` then finds the same Python
            env = d.fake.environ(PATH=ENV["PATH"], **call["env"])
            return [FAKE_SMOLVM, *head, "--", *rest], env
    raise SystemExit("the daemon made no machine exec call to copy")


def round_trips(d: VMDaemon, runs: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {
        "client": [],
        "client_framed": [],
        "bottlenetctl": [],
        "direct": [],
    }
    ctl = [os.path.join(os.path.dirname(sys.executable), "bottlenetctl"), "--control", d.control]
    compile_trees([])
    with d.client(timeout=60) as c:
        c.exec("b1", ["true"])  # so the fake's log holds an exec line to copy
        argv, env = direct(d, "true")
        for _ in range(runs):
            t0 = time.perf_counter()
            assert c.exec("b1", ["true"]) == 0
            times["client"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert c.exec("b1", ["true"], fds=False) == 0
            times["client_framed"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            r = subprocess.run(
                [*ctl, "bottle", "exec", "b1", "--", "true"],
                env=ENV,
                stdin=subprocess.DEVNULL,
                capture_output=True,
            )
            times["bottlenetctl"].append(time.perf_counter() - t0)
            assert r.returncode == 0, r.stderr
            t0 = time.perf_counter()
            subprocess.run(argv, env=env, check=True, stdin=subprocess.DEVNULL)
            times["direct"].append(time.perf_counter() - t0)
    return times


def out_throughput(d: VMDaemon, mib: int) -> dict[str, float]:
    total = mib << 20
    cmd = ["head", "-c", str(total), "/dev/zero"]
    through: dict[bool, float] = {}
    with d.client(timeout=600) as c:
        for fds in (True, False):
            sink = Count()
            t0 = time.perf_counter()
            assert c.exec("b1", cmd, stdout=sink, fds=fds) == 0  # type: ignore[arg-type]
            through[fds] = time.perf_counter() - t0
            assert sink.n == total, sink.n
    argv, env = direct(d, *cmd)
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE)
    assert p.stdout is not None
    got = 0
    while chunk := p.stdout.read(CHUNK):
        got += len(chunk)
    p.wait()
    floor = time.perf_counter() - t0
    assert got == total, got
    return {
        "fds_mib_s": mib / through[True],
        "framed_mib_s": mib / through[False],
        "direct_mib_s": mib / floor,
    }


def in_throughput(d: VMDaemon, mib: int) -> dict[str, float]:
    total = mib << 20
    cmd = ["sh", "-c", "cat >/dev/null"]
    through: dict[bool, float] = {}
    with d.client(timeout=600) as c:
        for fds in (True, False):
            src: IO[bytes] = Zeros(total)  # type: ignore[assignment]
            t0 = time.perf_counter()
            assert c.exec("b1", cmd, stdin=src, fds=fds) == 0
            through[fds] = time.perf_counter() - t0
            os.close(src.fileno())
    argv, env = direct(d, *cmd)
    if "-i" not in argv:
        argv.insert(argv.index("--"), "-i")
    # the same source, fed straight to smolvm's stdin
    t0 = time.perf_counter()
    src = Zeros(total)  # type: ignore[assignment]
    p = subprocess.Popen(argv, env=env, stdin=src.fileno())
    os.close(src.fileno())
    assert p.wait() == 0
    floor = time.perf_counter() - t0
    return {
        "fds_mib_s": mib / through[True],
        "framed_mib_s": mib / through[False],
        "direct_mib_s": mib / floor,
    }


def rounds(measure: Any, d: VMDaemon, mib: int, n: int) -> dict[str, float]:
    """``measure`` ``n`` times: the median of each rate, and of each path's ratio to smolvm
    directly within a round (a paired figure: a round's paths share the machine's load)."""
    runs = [measure(d, mib) for _ in range(n)]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    for path in ("fds", "framed"):
        out[f"{path}_ratio"] = statistics.median(
            r[f"{path}_mib_s"] / r["direct_mib_s"] for r in runs
        )
    return out


def kill_when_watched(d: VMDaemon, watching: int, pid: int, killed: list[float]) -> None:
    """SIGKILL ``pid`` once the daemon has logged the ``watching``-th watch (the events
    iterator subscribes on its first use)."""
    wait_for(lambda: d.log().count("watches events") >= watching, 60, "the watch")
    killed.append(time.perf_counter())
    os.kill(pid, signal.SIGKILL)


def degraded_latency(d: VMDaemon, n: int) -> list[float]:
    """Seconds from SIGKILL of a sidecar VMM to its ``degraded`` event, per bottle."""
    got: list[float] = []
    for i in range(n):
        name = f"ev{i}"
        d.create_vm_bottle(name)
        pid = d.machine_pid(f"bn-{name}-sidecar")
        killed: list[float] = []
        watching = d.log().count("watches events") + 1
        killer = threading.Thread(target=kill_when_watched, args=(d, watching, pid, killed))
        with BlockingControlClient(d.control, timeout=60) as w:
            killer.start()
            for ev in w.events(name, idle=60):
                if ev.kind == "degraded":
                    got.append(time.perf_counter() - killed[0])
                    break
        killer.join()
        r = d.ctl("bottle", "rm", name)
        assert r.returncode == 0, r.stderr
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--events", type=int, default=5)
    ap.add_argument(
        "--rounds", type=int, default=3, help="throughput rounds (medians are reported)"
    )
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("exec_stream: needs root (the fake's guest runs in a network namespace)")
        return 2
    os.chdir(ROOT)
    d = VMDaemon().start()
    try:
        d.create_vm_bottle("b1")
        trips = round_trips(d, args.runs)
        out = rounds(out_throughput, d, args.mib, args.rounds)
        inp = rounds(in_throughput, d, args.mib, args.rounds)
        lat = degraded_latency(d, args.events)
    finally:
        left = d.cleanup()
    results: dict[str, Any] = {
        "round_trip_s": trips,
        "stdout": out,
        "stdin": inp,
        "degraded_s": lat,
    }
    ms = {k: [v * 1000 for v in vs] for k, vs in trips.items()}
    print(f"exec -- true, {args.runs} runs (ms): p50 / p90; ratio of p50 to smolvm directly")
    for k in ("direct", "client", "client_framed", "bottlenetctl"):
        p50, floor = statistics.median(ms[k]), statistics.median(ms["direct"])
        print(f"  {k:13s} {p50:7.1f} / {pct(ms[k], 90):7.1f}   {p50 / floor:.2f}x")
    print(f"throughput, median of {args.rounds} rounds (ratio: median of each round's)")
    for what, r in (("stdout", out), ("stdin", inp)):
        print(
            f"{what} {args.mib} MiB: smolvm directly {r['direct_mib_s']:.0f} MiB/s; "
            f"fds {r['fds_mib_s']:.0f} MiB/s ({r['fds_ratio']:.2f}x), "
            f"framed {r['framed_mib_s']:.0f} MiB/s ({r['framed_ratio']:.2f}x)"
        )
    if lat:
        print(
            f"degraded event after the sidecar VMM's SIGKILL ({len(lat)} bottles): "
            f"median {statistics.median(lat) * 1000:.0f} ms, max {max(lat) * 1000:.0f} ms"
        )
    if left:
        print(f"left behind: {left}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
