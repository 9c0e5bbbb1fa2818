"""The bridge run's clients, as run by python3 INSIDE the real-VM guest (no NIC).

Only the stamped environment tells them where the proxy is (``HTTPS_PROXY``/``HTTP_PROXY`` =
``http://127.0.0.1:3128``, served by bottlenet's bridge). One ``RVB`` line per result. Then
the cost of the bridge: round trips and a bulk read through a CONNECT tunnel, through the
bridge (TCP 127.0.0.1:3128) and on the mounted socket directly, in alternating rounds.
"""

import os
import select
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


def child(serve):
    """Run ``serve`` in a forked child (until killed); the parent gets its pid."""
    pid = os.fork()
    if pid:
        return pid
    try:
        serve()
    finally:
        os._exit(0)


def local_echo(path):
    """An in-guest UNIX echo, one connection at a time."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)

    def serve():
        while True:
            c, _ = srv.accept()
            while True:
                data = c.recv(65536)
                if not data:
                    break
                c.sendall(data)
            c.close()

    return child(serve)


def least_relay(path):
    """The least a relay hop can do for a round trip: TCP 127.0.0.1 to the UNIX socket at
    ``path``, blocking, one message each way in turn (only good for a ping-pong)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def serve():
        while True:
            c, _ = srv.accept()
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            u.connect(path)
            while True:
                data = c.recv(65536)
                if not data:
                    break
                u.sendall(data)
                back = b""
                while len(back) < len(data):
                    back += u.recv(65536)
                c.sendall(back)
            c.close()
            u.close()

    return srv.getsockname()[1], child(serve)


def select_relay(path):
    """The least generic relay on the full path: TCP 127.0.0.1 to the UNIX socket at
    ``path``, one thread, one ``select`` for both directions, half-close passed on. Any
    relay a guest could run does at least this (it carries a CONNECT tunnel and a bulk
    read); it is the floor an extra guest process puts under the bridge's ratios."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def serve():
        buf = bytearray(262144)
        view = memoryview(buf)
        while True:
            c, _ = srv.accept()
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            u.connect(path)
            peer = {c: u, u: c}
            open_ = [c, u]
            while open_:
                for src in select.select(open_, [], [])[0]:
                    n = src.recv_into(buf)
                    if n:
                        peer[src].sendall(view[:n])
                    else:
                        open_.remove(src)
                        try:
                            peer[src].shutdown(socket.SHUT_WR)
                        except OSError:
                            open_.clear()
            c.close()
            u.close()

    return srv.getsockname()[1], child(serve)


def tcp(port):
    def connect():
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    return connect


def unix(path):
    def connect():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        s.connect(path)
        return s

    return connect


def round_trips(connect, n, through_proxy=True):
    s = tunnel(connect, CONF["echo"]) if through_proxy else connect()
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
    buf = bytearray(262144)  # as large as the bridge's reads: the same client for both paths
    total, t = 0, None
    try:
        while True:
            n = s.recv_into(buf)
            if not n:
                break
            if t is None:
                t = time.perf_counter()
            total += n
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
    # The same hop with nothing behind it but an in-guest UNIX echo: on the socket directly,
    # through the least relay there can be, and through bottlenet's bridge.
    local = CONF["local_socket"]
    pids = [local_echo(local)]
    port, pid = least_relay(local)
    pids.append(pid)
    hops = (("direct", unix(local)), ("least", tcp(port)), ("bridge", tcp(CONF["local_port"])))
    full_port, pid = select_relay(CONF["socket"])
    pids.append(pid)
    paths = (("bridge", via_bridge), ("least", tcp(full_port)), ("socket", via_socket))
    for _ in range(CONF["rounds"]):
        for label, connect in paths:
            rtt = round_trips(connect, CONF["trips"])
            rate = bulk(connect)
            say("cost", label, "%.6f" % rtt, "%.0f" % rate)
        for label, connect in hops:
            say("local", label, "%.6f" % round_trips(connect, CONF["trips"], False))
    for pid in pids:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
