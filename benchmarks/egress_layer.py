"""What the transparent egress layer costs against the bridge (a benchmark, not a test).

    unshare -n .venv/bin/python benchmarks/egress_layer.py [--rounds 5] [--connects 200]

Needs root in a network namespace of its own (``unshare -n``: lo only; the layer installs
routes and nf_tables rules there). Runs a stand-in CONNECT proxy on a UNIX socket (the
sidecar service's mounted socket) that tunnels to a local echo and bulk server, then two ways
to it, each a real process fed its script as the daemon feeds the guest: bottlenet's bridge
(``127.0.0.1:PORT``; the client sends ``CONNECT`` itself, as an ``HTTPS_PROXY`` client does)
and the transparent layer (the client dials ``203.0.113.7:PORT``, redirected; the layer sends
``CONNECT``). In alternating rounds it measures connect setup (a new connection until the
tunnel has echoed 64 bytes: median of ``--connects``) and bulk (a 64 MiB read), keeps the
best of each and prints the ratios layer / bridge. The machine is shared and noisy: only
ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bottlenet.bridge.script import Bridge  # noqa: E402
from bottlenet.bridge.script import render as render_bridge  # noqa: E402
from bottlenet.transparent.layer import LISTEN_PORT  # noqa: E402
from bottlenet.transparent.script import render as render_layer  # noqa: E402
from tests.netio import ConnectProxy  # noqa: E402

SERVER_PORT, BRIDGE_PORT = 18500, 3128
OUTSIDE = "203.0.113.7"
BULK = 64 * 1024 * 1024


def echo_and_bulk(port: int) -> None:
    """A loopback TCP server: first byte E (echo) or B<n>\\n (n bytes out)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(128)

    def serve(c: socket.socket) -> None:
        with c:
            mode = c.recv(1)
            if mode == b"E":
                while d := c.recv(65536):
                    c.sendall(d)
            else:
                n = int(c.recv(16).split(b"\n")[0])
                chunk = bytes(262144)
                while n > 0:
                    c.sendall(chunk[: min(n, len(chunk))])
                    n -= len(chunk)

    def loop() -> None:
        while True:
            c, _ = srv.accept()
            threading.Thread(target=serve, args=(c,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()


def start(script: bytes, ready: bytes) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(["/bin/sh", "-s"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(script)
    p.stdin.flush()
    line = p.stdout.readline()
    if not line.startswith(ready):
        raise SystemExit(f"not ready: {line!r}")
    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()  # type: ignore[union-attr]
    return p


def tunnel(path: str) -> socket.socket:
    """A tunnel to the server on one path: ``bridge`` (CONNECT by the client) or ``layer``."""
    if path == "bridge":
        s = socket.create_connection(("127.0.0.1", BRIDGE_PORT))
        s.sendall(f"CONNECT {OUTSIDE}:{SERVER_PORT} HTTP/1.1\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(4096)
        return s
    return socket.create_connection((OUTSIDE, SERVER_PORT))


def connect_setup(path: str, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        with tunnel(path) as s:
            s.sendall(b"E" + bytes(63))
            got = 0
            while got < 63:
                got += len(s.recv(64))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bulk(path: str) -> float:
    with tunnel(path) as s:
        t0 = time.perf_counter()
        s.sendall(b"B%d\n" % BULK)
        got = 0
        buf = bytearray(262144)
        while got < BULK:
            n = s.recv_into(buf)
            if not n:
                break
            got += n
        return got / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--connects", type=int, default=200)
    args = ap.parse_args()
    with open("/proc/net/dev") as fh:
        if [ln.split(":")[0].strip() for ln in fh.readlines()[2:]] != ["lo"]:
            raise SystemExit("run it in a network namespace of its own: unshare -n ...")
    work = tempfile.mkdtemp(prefix="bn-egress-bench-")
    sock = os.path.join(work, "egress.sock")
    echo_and_bulk(SERVER_PORT)
    # the sidecar's CONNECT proxy stand-in: every target is tunnelled to the server
    proxy = ConnectProxy(sock, lambda target: ("127.0.0.1", SERVER_PORT))
    layer = start(render_layer(sock, LISTEN_PORT), b"BNE ready")
    bridge = start(render_bridge([Bridge(BRIDGE_PORT, sock)]), b"BNB ready")
    best: dict[str, list[float]] = {"bridge": [1e9, 0.0], "layer": [1e9, 0.0]}
    try:
        for r in range(args.rounds):
            for path in ("bridge", "layer") if r % 2 == 0 else ("layer", "bridge"):
                setup, rate = connect_setup(path, args.connects), bulk(path)
                best[path] = [min(best[path][0], setup), max(best[path][1], rate)]
                print(f"round {r} {path}: setup {setup * 1e3:.3f} ms, bulk {rate / 1e6:.0f} MB/s")
    finally:
        for p in (layer, bridge):
            p.terminate()
            p.wait(10)
        proxy.close()
        shutil.rmtree(work, ignore_errors=True)
    (bs, br), (ls, lr) = best["bridge"], best["layer"]
    print(
        f"best of {args.rounds}: connect setup layer {ls * 1e3:.3f} ms vs bridge {bs * 1e3:.3f}"
        f" ms ({ls / bs:.2f}x); bulk layer {lr / 1e6:.0f} MB/s vs bridge {br / 1e6:.0f} MB/s"
        f" ({lr / br:.2f}x)"
    )


if __name__ == "__main__":
    main()
