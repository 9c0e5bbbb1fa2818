"""One transparent-egress scenario in a network namespace of its own (the host's kernel).

``unshare -n python -m tests.transparent.rig OUT.json``: lo only; a stand-in CONNECT proxy on a
UNIX socket (the sidecar service's mounted socket) with an allow-list of names, that tunnels
allowed names to an HTTP server on loopback and answers 403 to everything else, recording
each request line; the layer (``python -m bottlenet.transparent run``) as the daemon runs it;
then real clients that ignore proxy variables. Each outcome goes to OUT.json.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from bottlenet.transparent.layer import LISTEN_PORT
from bottlenet.transparent.script import render
from tests.netio import ConnectProxy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALLOWED = "example.test"
HTTP_PORT = 18090


class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"HELLO host={self.headers.get('Host')} path={self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 20) -> list[str]:
    """A client's rc and its output's last line."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env or {})
    except subprocess.TimeoutExpired:
        return ["timeout"]
    out = (p.stdout.strip() + "\n" + p.stderr.strip()).strip().splitlines()
    return [str(p.returncode), out[-1] if out else ""]


URLLIB = """
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())
except Exception as e:
    print(type(e).__name__, getattr(e, "reason", e)); sys.exit(1)
"""

DIAL = """
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    s = socket.create_connection((host, port), timeout=float(sys.argv[3]) if sys.argv[3:] else 10)
except OSError as e:
    print("connect", e.strerror); sys.exit(2)
try:
    s.sendall(b"x")
    print("read", repr(s.recv(100)))
except OSError as e:
    print("after connect", e.strerror); sys.exit(3)
"""

DGRAM = """
import socket, sys
fam = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
s = socket.socket(fam, socket.SOCK_DGRAM)
try:
    s.sendto(b"x", (sys.argv[1], int(sys.argv[2]))); print("sent")
except OSError as e:
    print("sendto", e.strerror); sys.exit(1)
"""


def scenario(work: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    subprocess.run(["ip", "link", "set", "lo", "down"], check=True)  # the layer brings it up
    httpd = socketserver.ThreadingTCPServer(("127.0.0.1", HTTP_PORT), Page)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    sock = os.path.join(work, "egress.sock")
    proxy = ConnectProxy(
        sock, lambda t: ("127.0.0.1", HTTP_PORT) if t.rpartition(":")[0] == ALLOWED else None
    )
    # What the daemon feeds a guest without the kit: the script on sh's stdin, then that
    # stdin held open (the lifeline); python3 is the "image's" (this one, first on PATH).
    bindir = os.path.join(work, "bin")
    os.makedirs(bindir)
    os.symlink(sys.executable, os.path.join(bindir, "python3"))
    layer = subprocess.Popen(
        ["/bin/sh", "-s"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd="/",
        env={"PATH": f"{bindir}:/usr/bin:/bin"},
    )
    assert layer.stdin is not None
    layer.stdin.write(render(sock, LISTEN_PORT))
    layer.stdin.flush()
    lines: list[str] = []
    assert layer.stdout is not None
    first = layer.stdout.readline().decode().strip()
    out["layer"] = first
    if first != "BNE ready":
        layer.wait(10)
        return out

    def read() -> None:
        assert layer.stdout is not None
        for raw in layer.stdout:
            lines.append(raw.decode().strip())

    threading.Thread(target=read, daemon=True).start()
    py = sys.executable
    url = f"http://{ALLOWED}/no-proxy"
    out["urllib"] = run([py, "-I", "-c", URLLIB, url])
    out["curl"] = run(["curl", "-sS", "--noproxy", "*", "-m", "10", f"http://{ALLOWED}/curl"])
    if shutil.which("busybox"):
        out["wget"] = run(["busybox", "wget", "-q", "-O", "-", f"http://{ALLOWED}/wget"])
    out["v4"] = run([py, "-I", "-c", DIAL, "203.0.113.7", "443"])
    out["v6"] = run([py, "-I", "-c", DIAL, "2001:db8::1", "443"])
    out["name-denied"] = run([py, "-I", "-c", URLLIB, "http://denied.test:8080/"])
    out["udp"] = run([py, "-I", "-c", DGRAM, "203.0.113.7", "5353"])
    out["udp6"] = run([py, "-I", "-c", DGRAM, "2001:db8::1", "5353"])
    out["ping"] = run(["busybox", "ping", "-c", "1", "-W", "2", "203.0.113.7"])
    out["direct"] = run([py, "-I", "-c", DIAL, "127.0.0.1", "1001"])
    # 16 at once
    procs = [
        subprocess.Popen(
            [py, "-I", "-c", URLLIB, f"http://{ALLOWED}/c{i}"],
            stdout=subprocess.PIPE,
            text=True,
            env={},
        )
        for i in range(16)
    ]
    out["concurrent"] = sum(1 for p in procs if p.communicate(timeout=30)[0].startswith("HELLO"))
    # a guest root flushes the rules: egress is gone, nothing else
    out["remove"] = run([py, "-m", "bottlenet.transparent", "remove"],
                        env={"PYTHONPATH": REPO})  # fmt: skip
    out["after-v4"] = run([py, "-I", "-c", DIAL, "203.0.113.7", "443", "2"])
    out["after-v6"] = run([py, "-I", "-c", DIAL, "2001:db8::1", "443", "2"])
    out["after-loopback"] = run(["curl", "-sS", "-m", "5", f"http://127.0.0.1:{HTTP_PORT}/lo"])
    time.sleep(0.2)
    out["proxy"] = list(proxy.lines)
    out["reports"] = list(lines)
    assert layer.stdin is not None
    layer.stdin.close()  # the lifeline: the layer ends
    out["layer_exit"] = layer.wait(10)
    httpd.shutdown()
    return out


def main() -> None:
    work = tempfile.mkdtemp(prefix="bne-rig-")
    try:
        result = scenario(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
