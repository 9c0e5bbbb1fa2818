"""What bottlenet's in-guest bridge costs on this host (a benchmark, not a test).

    .venv/bin/python benchmarks/bridge_cost.py [--rounds 5] [--cpu 0] [--guest FILE]...

Runs a UNIX socket server in its own process (echo, and a bulk source), a real bridge process
(``bottlenet/bridge/guest.py``, or each ``--guest FILE``, e.g. an older version from
``git show``) relaying ``127.0.0.1:PORT`` to it, and one client that measures, in
alternating rounds, the median of 64-byte round trips and the rate of a bulk read, through
the bridge and on the socket directly. Keeps the best of each and prints ratios against the
direct socket (targets: round trip <= 1.5x, throughput >= 0.7x). ``--cpu N`` pins every
process to one CPU, as in the real-VM tier's 1-vCPU guest. The machine is shared and noisy:
only ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUEST = os.path.join(ROOT, "bottlenet", "bridge", "guest.py")
sys.path.insert(0, ROOT)

from bottlenet.bridge.script import MODULES  # noqa: E402
from bottlenet.transparent.script import bootstrap  # noqa: E402

SERVER = """
import os, socket, sys, threading
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(sys.argv[1]); srv.listen(64)
print("up", flush=True)
def serve(c):
    with c:
        mode = c.recv(1)
        if mode == b"E":
            while True:
                d = c.recv(65536)
                if not d:
                    return
                c.sendall(d)
        else:
            n = int(c.recv(16).strip())
            chunk = bytes(262144)
            while n > 0:
                c.sendall(chunk[:n]); n -= len(chunk)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_bridge(guest: str, port: int, path: str, pin: list[str]) -> subprocess.Popen[bytes]:
    with open(guest) as fh:
        source = fh.read()
    marker = "BRIDGES = []  # type: "
    start = source.index(marker)
    program = source[:start] + f"BRIDGES = {[[port, path]]!r}" + source[source.index("\n", start) :]
    program = bootstrap(MODULES, program)  # the relay module it imports (older ones: unused)
    proc = subprocess.Popen(
        [*pin, sys.executable, "-I", "-S", "-c", program],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(b"BNB ready"):
        raise SystemExit(f"{guest}: {line!r}")
    return proc


def connector(kind: str, port: int, path: str):  # type: ignore[no-untyped-def]
    def connect() -> socket.socket:
        if kind == "socket":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
        else:
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    return connect


def round_trip(connect, trips: int) -> float:  # type: ignore[no-untyped-def]
    with connect() as s:
        s.sendall(b"E")
        msg, times = b"x" * 64, []
        for _ in range(trips):
            t = time.perf_counter()
            s.sendall(msg)
            got = 0
            while got < len(msg):
                got += len(s.recv(len(msg) - got))
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def bulk(connect, size: int) -> float:  # type: ignore[no-untyped-def]
    with connect() as s:
        s.sendall(b"B" + str(size).encode().ljust(16))
        buf = bytearray(262144)
        total, t = 0, time.perf_counter()
        while n := s.recv_into(buf):
            total += n
    assert total == size, total
    return total / (time.perf_counter() - t)


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process, its ended threads included (0 for none)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--trips", type=int, default=2000)
    ap.add_argument("--bytes", type=int, default=64 * 1024 * 1024)
    ap.add_argument("--cpu", type=int, help="pin every process to this CPU")
    ap.add_argument("--guest", action="append", help="a bridge program (default: this tree's)")
    args = ap.parse_args()
    pin = ["taskset", "-c", str(args.cpu)] if args.cpu is not None else []
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    guests = args.guest or [GUEST]
    work = tempfile.mkdtemp(prefix="bridge-cost-")
    path = os.path.join(work, "svc.sock")
    server = subprocess.Popen(
        [*pin, sys.executable, "-I", "-c", SERVER, path], stdout=subprocess.PIPE
    )
    assert server.stdout is not None
    server.stdout.readline()
    bridges = []
    try:
        for g in guests:
            port = free_port()
            bridges.append((os.path.basename(g), start_bridge(g, port, path, pin), port))
        paths = [("socket", connector("socket", 0, path), None)]
        paths += [(name, connector("tcp", port, path), p.pid) for name, p, port in bridges]
        best = {label: [float("inf"), 0.0] for label, _, _ in paths}
        cpu = {label: [0.0, 0.0] for label, _, _ in paths}  # bridge CPU: round trips, bulk
        for _ in range(args.rounds):
            for label, connect, pid in paths:
                c = cpu_seconds(pid)
                best[label][0] = min(best[label][0], round_trip(connect, args.trips))
                c2 = cpu_seconds(pid)
                best[label][1] = max(best[label][1], bulk(connect, args.bytes))
                cpu[label][0] += c2 - c
                cpu[label][1] += cpu_seconds(pid) - c2
        s_rtt, s_rate = best["socket"]
        for label, (rtt, rate) in best.items():
            per_trip = cpu[label][0] / (args.rounds * args.trips) * 1e6
            per_mb = cpu[label][1] / (args.rounds * args.bytes / 1e6) * 1e6
            print(
                f"{label:>12}: round trip {rtt * 1e6:6.1f} us ({rtt / s_rtt:.2f}x), "
                f"throughput {rate / 1e6:7.1f} MB/s ({rate / s_rate:.2f}x); bridge CPU "
                f"{per_trip:5.1f} us per round trip, {per_mb:6.1f} us per MB"
            )
    finally:
        for _, proc, _ in bridges:
            proc.kill()
            proc.wait()
        server.kill()
        server.wait()
        os.unlink(path)
        os.rmdir(work)


if __name__ == "__main__":
    main()
