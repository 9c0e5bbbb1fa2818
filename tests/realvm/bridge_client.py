"""The bridge run's clients, as run by python3 INSIDE the real-VM guest (no NIC).

Only the stamped environment tells them where the proxy is (``HTTPS_PROXY``/``HTTP_PROXY`` =
``http://127.0.0.1:3128``, served by bottlenet's bridge). One ``RVB`` line per result. Then
the cost of the bridge: round trips and a bulk read through a CONNECT tunnel, through the
bridge (TCP 127.0.0.1:3128) and on the mounted socket directly, in alternating rounds.
"""

import os
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request

CONF = {}  # filled in by the host: ports and names


def say(*words):
    sys.stdout.write(" ".join(["RVB"] + [str(w) for w in words]) + "\n")
    sys.stdout.flush()


def fetch(url, context=None):
    try:
        with urllib.request.urlopen(url, timeout=60, context=context) as r:
            return r.status, r.read().decode(errors="replace").strip()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except Exception as e:
        return "error", type(e).__name__


def tunnel(connect, target):
    """A CONNECT tunnel through the proxy on ``connect`` (a socket factory)."""
    s = connect()
    s.sendall(("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, target)).encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk:
            raise OSError("proxy closed the tunnel")
        head += chunk
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise OSError("CONNECT refused")
    return s


def via_bridge():
    s = socket.create_connection(("127.0.0.1", CONF["port"]), timeout=60)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def via_socket():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(CONF["socket"])
    return s


def round_trips(connect, n):
    s = tunnel(connect, CONF["echo"])
    msg = b"x" * 64
    times = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            s.sendall(msg)
            got = b""
            while len(got) < len(msg):
                chunk = s.recv(len(msg) - len(got))
                if not chunk:
                    raise OSError("echo closed")
                got += chunk
            times.append(time.perf_counter() - t)
    finally:
        s.close()
    times.sort()
    return times[len(times) // 2]


def bulk(connect):
    s = tunnel(connect, CONF["blast"])
    total, t = 0, None
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            if t is None:
                t = time.perf_counter()
            total += len(chunk)
    finally:
        s.close()
    return total / (time.perf_counter() - t) if t else 0.0


def main():
    allowed = "http://%s/page" % CONF["allowed"]
    denied = "http://%s/page" % CONF["denied"]
    status, body = fetch(allowed)
    say("urllib-allowed", status, body.replace(" ", "_"))
    status, body = fetch(denied)
    say("urllib-refused", status)
    ctx = ssl.create_default_context(cafile="/ca.pem")
    status, body = fetch("https://%s/secret" % CONF["tls"], ctx)
    say("urllib-connect", status, body.replace(" ", "_"))
    try:
        socket.create_connection((CONF["outside"], 443), timeout=10).close()
        say("direct", "connected")
    except OSError as e:
        say("direct", getattr(e, "errno", None), os.strerror(e.errno or 0).replace(" ", "_"))
    # Alternating rounds: the host is shared and emulation is noisy; the host keeps the best
    # of each path.
    for _ in range(CONF["rounds"]):
        for label, connect in (("bridge", via_bridge), ("socket", via_socket)):
            rtt = round_trips(connect, CONF["trips"])
            rate = bulk(connect)
            say("cost", label, "%.6f" % rtt, "%.0f" % rate)


if __name__ == "__main__":
    main()
