"""CPU cost per relayed connection of the standalone forwarder (a profiling aid).

    .venv/bin/python benchmarks/connect_cost.py [-n 3000] [--profile out.prof] -- --engine splice

Starts a selector-based echo backend in this process's thread, the standalone forwarder (extra
arguments after ``--`` go to it), then runs ``n`` sequential connect / 1-byte echo / close
cycles like fwdbench's connect test, and prints the forwarder's CPU microseconds per
connection (utime+stime from /proc) and the rate. ``--profile`` runs the forwarder under
cProfile and writes the stats file when it exits. Timing belongs here, not in unit tests.
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


def cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    p.add_argument("rest", nargs="*", help="arguments for the standalone forwarder")
    args = p.parse_args()
    backend = echo_backend()
    port = free_port()
    cmd = [sys.executable]
    if args.profile:
        cmd += ["-m", "cProfile", "-o", args.profile]
    cmd += [
        "-m",
        "bottlenet.forward.standalone",
        "--listen",
        f"{LISTEN}:{port}",
        "--to",
        f"127.0.0.1:{backend}",
        *args.rest,
    ]
    child = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE)
    assert child.stdout is not None
    child.stdout.readline()  # "standalone: forwarding ..."
    if args.pin >= 0:
        for pid in (0, child.pid):
            os.sched_setaffinity(pid, {args.pin})

    def once() -> None:
        c = socket.create_connection((LISTEN, port))
        c.sendall(b"x")
        assert c.recv(1) == b"x"
        c.close()

    for _ in range(200):
        once()
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
        once()
    c1, t1 = cpu(child.pid), time.perf_counter()
    if args.spy:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
    child.send_signal(signal.SIGINT)
    child.wait(30)
    print(
        f"{args.n} connections: {1e6 * (c1 - c0) / args.n:.0f} µs forwarder CPU each,"
        f" {args.n / (t1 - t0):.0f}/s"
    )


if __name__ == "__main__":
    main()
