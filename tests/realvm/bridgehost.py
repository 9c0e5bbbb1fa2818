"""The real-VM bridge run: bottlenet's bridge in a guest kernel with no NIC, real clients, a
real proxy. Runs inside the caller's ``unshare -n -m`` (only ``lo``), like tests/realvm/host.py.

Host side: tinyproxy (Debian's, standing in for the sidecar's egress proxy) allowing
``allowed.test`` and denying everything else, behind the daemon's real forward
(``ForwardTable``, a UNIX listener relaying to the proxy's TCP port); QEMU's virtio-serial
chardev connects to that listener and the guest's relay maps ``/run/bottle/egress.sock``
onto the port (the stand-in for smolvm's ``--mount-socket``). Local web servers: an allowed
one, a denied one, a TLS one with a certificate of a test CA, an echo and a bulk source for
the cost measurement. Guest side: bottlenet's bridge, fed on a kept-open stdin to ``sh -s``
exactly as the daemon's session feeds it, then python's urllib (tests/realvm/bridge_client.py)
and Debian's curl (copied into the initramfs with its libraries), with only the stamped proxy
variables.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bottlenet.bridge.script import Bridge, render
from tests.realvm.build import GUEST_PYTHON, _libs, _python_files, find_kit
from tests.realvm.host import (
    GUEST_SOCKET,
    OUTSIDE,
    Accepts,
    boot,
    namespace_setup,
    own_forward,
    qemu_argv,
    run_cpio,
)

HERE = os.path.dirname(os.path.abspath(__file__))
GUEST_PORT = 3128
#: A second bridge, onto an in-guest UNIX echo: the bridge's own cost, nothing behind it.
LOCAL_PORT, LOCAL_SOCKET = 3129, "/tmp/rvb-echo.sock"
PROXY_PORT, ALLOWED_PORT, DENIED_PORT, TLS_PORT, ECHO_PORT, BLAST_PORT = (
    18128, 18180, 18181, 18443, 18007, 18019,
)  # fmt: skip
DENIED_ADDR = "127.0.0.2"
BLAST_BYTES = 8 * 1024 * 1024
TRIPS = 200
ROUNDS = 3
#: vCPUs of the bridge run's guest: 1 in the tier; ``BOTTLENET_REALVM_SMP=2`` for a measurement.
SMP = int(os.environ.get("BOTTLENET_REALVM_SMP", "1"))
CLIENT_IMPORTS = (
    "urllib.request urllib.error ssl http.client socket time os sys encodings.idna"
    " encodings.latin_1 encodings.ascii encodings.utf_8 stringprep unicodedata"
)
CURL = "/usr/bin/curl"
#: virtio ports onto the forward (tests/realvm/relay.py takes them in turn): the run opens
#: about thirty connections one after another, each would otherwise wait out QEMU's
#: one-second reconnect of the previous one.
PORTS = 4

GUEST_SH = """\
#!/bin/sh
# The stamped environment of a socket-mode agent with an egress service on guest port {port}.
export HTTPS_PROXY=http://127.0.0.1:{port} HTTP_PROXY=http://127.0.0.1:{port}
export https_proxy=$HTTPS_PROXY http_proxy=$HTTP_PROXY
# bottlenet's bridge, fed as the daemon's session feeds it: on stdin, which stays open.
{{ cat /bridge.sh; sleep 100000; }} | sh -s > /tmp/bridge.out 2>&1 &
{{ cat /bridge-local.sh; sleep 100000; }} | sh -s > /tmp/bridge-local.out 2>&1 &
i=0
while ! grep -q '^BNB ready' /tmp/bridge.out && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
echo "RVB bridge $(head -c 80 /tmp/bridge.out | tr '\\n ' '__')"
python3 -I -S /bridge_client.py
c=$(curl -s -o /tmp/c1 -w '%{{http_code}}' http://allowed.test:{allowed}/page)
echo "RVB curl-allowed $c $(tr ' ' _ < /tmp/c1)"
c=$(curl -s -o /dev/null -w '%{{http_code}}' http://denied.test:{denied}/page)
echo "RVB curl-refused $c"
c=$(curl -s --cacert /ca.pem -o /tmp/c3 -w '%{{http_code}}' https://allowed.test:{tls}/secret)
echo "RVB curl-connect $c $(tr ' ' _ < /tmp/c3)"
curl -s --noproxy '*' -m 10 -o /dev/null http://{outside}:443/
echo "RVB curl-direct $?"
"""

TINYPROXY_CONF = """\
Port {port}
Listen 127.0.0.1
Timeout 60
MaxClients 32
Allow 127.0.0.1
LogLevel Warning
LogFile "{log}"
Filter "{filter}"
FilterDefaultDeny Yes
"""


class _Pages(BaseHTTPRequestHandler):
    hits: dict[str, int] = {}

    def do_GET(self) -> None:
        name = self.server.name  # type: ignore[attr-defined]
        _Pages.hits[name] = _Pages.hits.get(name, 0) + 1
        body = f"{name} page".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_pages(name: str, addr: str, port: int, tls: ssl.SSLContext | None = None) -> None:
    srv = ThreadingHTTPServer((addr, port), _Pages)
    srv.name = name  # type: ignore[attr-defined]
    if tls is not None:
        srv.socket = tls.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()


def serve_stream(port: int, handler: Any) -> None:
    srv = socket.create_server(("127.0.0.1", port), backlog=16)

    def loop() -> None:
        while True:
            c, _ = srv.accept()
            threading.Thread(target=handler, args=(c,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()


def echo(c: socket.socket) -> None:
    """Echo the round trips, then close: the guest's port has no half-close, so the end of
    a tunnel must come from this side (then QEMU reconnects for the next connection)."""
    left = TRIPS * 64
    with c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while left > 0 and (data := c.recv(65536)):
            c.sendall(data)
            left -= len(data)


def blast(c: socket.socket) -> None:
    with c:
        chunk = b"\0" * 65536
        for _ in range(BLAST_BYTES // len(chunk)):
            c.sendall(chunk)


def test_ca(work: str) -> tuple[str, ssl.SSLContext]:
    """A CA and a server certificate for allowed.test (openssl CLI); the server's context."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=work, check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=bottlenet realvm test CA")  # fmt: skip
    openssl("req", *ec, "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=allowed.test")
    with open(os.path.join(work, "san.ext"), "w") as fh:
        fh.write("subjectAltName=DNS:allowed.test\n")
    openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "srv.pem", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(os.path.join(work, "srv.pem"), os.path.join(work, "srv.key"))
    return os.path.join(work, "ca.pem"), ctx


def start_tinyproxy(work: str) -> subprocess.Popen[bytes]:
    flt = os.path.join(work, "filter")
    with open(flt, "w") as fh:
        fh.write("^allowed\\.test$\n")
    conf = os.path.join(work, "tinyproxy.conf")
    with open(conf, "w") as fh:
        fh.write(
            TINYPROXY_CONF.format(
                port=PROXY_PORT, log=os.path.join(work, "tinyproxy.log"), filter=flt
            )
        )
    proc = subprocess.Popen(
        ["tinyproxy", "-d", "-c", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", PROXY_PORT), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("tinyproxy did not start") from None
            time.sleep(0.05)


def guest_files(ca: str) -> dict[str, bytes | str]:
    conf = {
        "port": GUEST_PORT,
        "socket": GUEST_SOCKET,
        "allowed": f"allowed.test:{ALLOWED_PORT}",
        "denied": f"denied.test:{DENIED_PORT}",
        "tls": f"allowed.test:{TLS_PORT}",
        "echo": f"allowed.test:{ECHO_PORT}",
        "blast": f"allowed.test:{BLAST_PORT}",
        "outside": OUTSIDE,
        "trips": TRIPS,
        "rounds": ROUNDS,
        "local_port": LOCAL_PORT,
        "local_socket": LOCAL_SOCKET,
    }
    with open(os.path.join(HERE, "bridge_client.py")) as fh:
        client = fh.read().replace("CONF = {}  # filled in by the host", f"CONF = {conf!r}  #")
    files: dict[str, bytes | str] = {
        "/bridge.sh": render([Bridge(GUEST_PORT, GUEST_SOCKET)]),
        "/bridge-local.sh": render([Bridge(LOCAL_PORT, LOCAL_SOCKET)]),
        "/probe.sh": GUEST_SH.format(
            port=GUEST_PORT,
            allowed=ALLOWED_PORT,
            denied=DENIED_PORT,
            tls=TLS_PORT,
            outside=OUTSIDE,
        ).encode(),
        "/bridge_client.py": client.encode(),
        "/ca.pem": ca,
        CURL: CURL,
    }
    py = _python_files(CLIENT_IMPORTS)
    for f in py:
        files[f] = f
    for lib in _libs([CURL, GUEST_PYTHON, *[f for f in py if f.endswith(".so")]]):
        files[lib] = lib
    return files


def hosts_file(work: str) -> None:
    """allowed.test and denied.test for tinyproxy's lookups (this mount namespace only)."""
    path = os.path.join(work, "hosts")
    with open(path, "w") as fh:
        fh.write(f"127.0.0.1 localhost allowed.test\n{DENIED_ADDR} denied.test\n")
    subprocess.run(["mount", "--bind", path, "/etc/hosts"], check=True)


def the_web(work: str) -> subprocess.Popen[bytes]:
    """What the guests' clients reach: ``allowed.test`` and ``denied.test`` (pages on
    127.0.0.1 and DENIED_ADDR, names in this mount namespace's hosts file) and tinyproxy in
    front of them, allowing the first only; returns tinyproxy's process."""
    hosts_file(work)
    subprocess.run(["ip", "addr", "add", f"{DENIED_ADDR}/32", "dev", "lo"], check=False)
    serve_pages("allowed", "127.0.0.1", ALLOWED_PORT)
    serve_pages("denied", DENIED_ADDR, DENIED_PORT)
    return start_tinyproxy(work)


def parse(transcript: bytes) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in transcript.decode("utf-8", "replace").splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "RVB":
            out.setdefault(words[1], []).append(" ".join(words[2:]))
    return out


async def run(reactor: Any, name: str) -> dict[str, Any]:
    kit = find_kit()
    if kit is None:
        raise SystemExit("no real-VM kit: run python -m tests.realvm.build first")
    if shutil.which("tinyproxy") is None or not os.path.exists(CURL):
        raise SystemExit("the bridge run needs tinyproxy and curl (Debian packages)")
    namespace_setup()
    work = tempfile.mkdtemp(prefix="rvm-bridge-")
    proxy = the_web(work)
    ca, tls = test_ca(work)
    serve_pages("secret", "127.0.0.1", TLS_PORT, tls)
    serve_stream(ECHO_PORT, echo)
    serve_stream(BLAST_PORT, blast)
    outside = Accepts()
    outside.listen(OUTSIDE, 443)

    state_dir = os.path.join(work, "state")
    os.makedirs(state_dir, mode=0o700)
    table, sock, _ = await own_forward(reactor, state_dir, PROXY_PORT)

    conf = "NET=none\nBLIND=0\nSHARES=''\n"
    initrd = os.path.join(work, "initrd.cpio")
    run_cpio({"/rvm.conf": conf.encode(), **guest_files(ca)}, kit.initrd, initrd)
    argv = qemu_argv({"net": "none", "smp": SMP}, kit, initrd, work, sock, [], ports=PORTS)
    qemu, code, wall = await boot(reactor, argv)
    await table.stopService()
    proxy.terminate()
    proxy.wait(10)
    with open(os.path.join(work, "console.log"), "rb") as fh:
        console = fh.read().decode("utf-8", "replace")
    with open(os.path.join(work, "transcript.txt"), "rb") as fh:
        results = parse(fh.read())
    shutil.rmtree(work, ignore_errors=True)
    return {
        "variant": name,
        "results": results,
        "lines": report_lines(results),
        "denied_hits": _Pages.hits.get("denied", 0),
        "outside_accepts": outside.seen[f"{OUTSIDE}:443"],
        "qemu_exit": code,
        "probe_exit": next(
            (int(ln.split()[1]) for ln in console.splitlines() if ln.startswith("RVM-EXIT ")),
            None,
        ),
        "wall": round(wall, 1),
        "witnessed": [],
        "console": [ln.strip() for ln in console.splitlines() if ln.startswith("RVM-")],
        "qemu_output": qemu.output.decode("utf-8", "replace")[-2000:] if code else "",
        "kernel": kit.kernel_version,
    }


def cost(results: dict[str, list[str]]) -> dict[str, float] | None:
    rows: dict[str, tuple[float, float]] = {}
    for row in results.get("cost", []):  # the best round trip and the best rate of each path
        label, rtt, rate = row.split()
        best = rows.get(label, (float("inf"), 0.0))
        rows[label] = (min(best[0], float(rtt)), max(best[1], float(rate)))
    if set(rows) != {"bridge", "least", "socket"}:
        return None
    (b_rtt, b_rate), (s_rtt, s_rate) = rows["bridge"], rows["socket"]
    l_rtt, l_rate = rows["least"]
    local: dict[str, float] = {}
    for row in results.get("local", []):
        label, rtt = row.split()
        local[label] = min(local.get(label, float("inf")), float(rtt))
    least = local.get("least", 0.0) - local.get("direct", 0.0)
    return {
        "rtt_bridge": b_rtt, "rtt_socket": s_rtt, "rtt_ratio": b_rtt / s_rtt,
        "local": local, "rtt_least_ratio": (s_rtt + least) / s_rtt,
        "rate_bridge": b_rate, "rate_socket": s_rate,
        "rate_ratio": b_rate / s_rate if s_rate else 0.0,
        "rtt_least": l_rtt, "rate_least": l_rate, "rtt_floor": l_rtt / s_rtt,
        "rate_floor": l_rate / s_rate if s_rate else 0.0,
    }  # fmt: skip


def report_lines(results: dict[str, list[str]]) -> list[str]:
    lines = [f"{key}: {' | '.join(values)}" for key, values in sorted(results.items())]
    lines = [ln for ln in lines if not ln.startswith(("cost: ", "local: "))]
    c = cost(results)
    if c is not None:
        lines.append(
            f"bridge cost (best of {ROUNDS} alternating rounds): "
            f"round trip {c['rtt_ratio']:.2f}x (bridge {c['rtt_bridge'] * 1e3:.2f} ms"
            f" vs socket {c['rtt_socket'] * 1e3:.2f} ms; target <= 1.5x), throughput "
            f"{c['rate_ratio']:.2f}x (bridge {c['rate_bridge'] / 1e6:.1f} MB/s vs socket "
            f"{c['rate_socket'] / 1e6:.1f} MB/s; target >= 0.7x); the floor, the least "
            f"relay on the same path: round trip {c['rtt_floor']:.2f}x "
            f"({c['rtt_least'] * 1e3:.2f} ms), throughput {c['rate_floor']:.2f}x "
            f"({c['rate_least'] / 1e6:.1f} MB/s)"
        )
        local = c["local"]
        if set(local) == {"direct", "least", "bridge"}:
            lines.append(
                "bridge hop alone (in-guest UNIX echo): round trip direct "
                f"{local['direct'] * 1e3:.2f} ms, through the least blocking relay "
                f"(ping-pong only) {local['least'] * 1e3:.2f} ms, through the bridge "
                f"{local['bridge'] * 1e3:.2f} ms; that relay's hop on the socket path would be "
                f"{c['rtt_least_ratio']:.2f}x"
            )
    return lines
