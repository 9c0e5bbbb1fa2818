"""CPU cost per relayed connection or message of a forwarder (a profiling aid).

    .venv/bin/python benchmarks/connect_cost.py [-n 3000] [--profile out.prof] -- --engine splice
    .venv/bin/python benchmarks/connect_cost.py --daemon readme [--rtt] [--spy FILE]

Starts a selector-based echo backend in this process's thread and a forwarder: the standalone
forwarder (extra arguments after ``--`` go to it), or with ``--daemon readme|unit`` the daemon
as users start it (``daemon_peer.py``). Then it runs ``n`` sequential connect / 1-byte echo /
close cycles like fwdbench's connect test (or, with ``--rtt``, ``n`` 64-byte round trips on
one connection like its latency test), and prints the forwarder's CPU microseconds per
connection or round trip (utime+stime from /proc) and the rate. ``--profile`` runs the
forwarder under cProfile (standalone only), ``--spy`` records it with py-spy. Timing belongs
here, not in unit tests.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from echoserver import serve_echo  # sibling module: these files run as scripts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTEN = "127.77.0.1"


def echo_backend() -> int:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1024)
    threading.Thread(target=serve_echo, args=(srv,), daemon=True).start()
    return int(srv.getsockname()[1])


def cpu(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of ``pid`` (its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def free_port() -> int:
    s = socket.socket()
    s.bind((LISTEN, 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("-n", type=int, default=3000)
    p.add_argument("--profile", help="write the forwarder's cProfile stats here")
    p.add_argument("--spy", help="record the forwarder with py-spy (raw format) to this file")
    p.add_argument("--pin", type=int, default=1, help="CPU to pin everything to (-1: none)")
    p.add_argument(
        "--callgrind",
        metavar="FILE",
        help="run the forwarder under valgrind's callgrind (instruction counts) into FILE",
    )
    p.add_argument("--daemon", choices=("readme", "unit"), help="run the daemon instead")
    p.add_argument(
        "--command",
        help="run this forwarder instead (a peer: {listen_host} {listen_port} {target_port})",
    )
    p.add_argument("--rtt", action="store_true", help="64-byte round trips on one connection")
    p.add_argument("rest", nargs="*", help="arguments for the standalone forwarder")
    args = p.parse_args()
    backend = echo_backend()
    port = free_port()
    cmd = [sys.executable]
    if args.callgrind:
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--trace-children=yes",
            f"--callgrind-out-file={args.callgrind}.%p",
            *cmd,
        ]
    if args.profile:
        cmd += ["-m", "cProfile", "-o", args.profile]
    where = ["--listen", f"{LISTEN}:{port}", "--to", f"127.0.0.1:{backend}"]
    if args.command:
        cmd = args.command.format(
            listen_host=LISTEN, listen_port=port, target_host="127.0.0.1", target_port=backend
        ).split()
    elif args.daemon:
        cmd += [os.path.join(ROOT, "benchmarks", "daemon_peer.py"), args.daemon, *where]
    else:
        cmd += [os.path.join(ROOT, "benchmarks", "standalone.py"), *where, *args.rest]
    child = subprocess.Popen(
        cmd,
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_ready(port)
    if args.pin >= 0:
        pin(child.pid, args.pin)

    def once() -> None:
        c = socket.create_connection((LISTEN, port))
        c.sendall(b"x")
        assert c.recv(1) == b"x"
        c.close()

    message = b"m" * 64
    rtt_conn = socket.create_connection((LISTEN, port))
    rtt_conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round_trip() -> None:
        rtt_conn.sendall(message)
        got = 0
        while got < len(message):
            got += len(rtt_conn.recv(4096))

    step = round_trip if args.rtt else once
    for _ in range(200):
        step()
    if args.spy:
        spy = subprocess.Popen(
            [
                os.path.join(os.path.dirname(sys.executable), "py-spy"),
                "record",
                "-r",
                "1000",
                "-f",
                "raw",
                "-o",
                args.spy,
                "--pid",
                str(child.pid),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1)
    c0, t0 = cpu(child.pid), time.perf_counter()
    for _ in range(args.n):
        step()
    c1, t1 = cpu(child.pid), time.perf_counter()
    if args.spy:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
    rtt_conn.close()
    child.send_signal(signal.SIGINT)
    child.wait(30)
    what = "round trips" if args.rtt else "connections"
    user, system = (1e6 * (b - a) / args.n for a, b in zip(c0, c1, strict=True))
    print(
        f"{args.n} {what}: {user + system:.1f} µs forwarder CPU each ({user:.1f} user,"
        f" {system:.1f} system), {args.n / (t1 - t0):.0f}/s"
    )


def wait_ready(port: int, timeout: float = 300.0) -> None:
    """Until one byte echoes through the forwarder (as fwdbench decides a peer is ready)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((LISTEN, port), timeout=2) as c:
                c.sendall(b"x")
                if c.recv(1) == b"x":
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("connect_cost: the forwarder did not come up")
        time.sleep(0.05)


def pin(pid: int, cpu_index: int) -> None:
    """This process (all its threads) and every thread of the forwarder to one CPU."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cpu_index})
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {cpu_index})


if __name__ == "__main__":
    main()
