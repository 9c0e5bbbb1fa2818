"""The launch gate's checks, as run by python3 INSIDE the guest (never imported by the daemon).

``script.render`` puts this file, with ``PLAN`` filled in, into the POSIX sh script the gate
sends on the guest's stdin. It uses only the standard library (Python 3.7 or later) and
prints one ``BNP <nonce> ...`` line per check; the host's ``judge`` decides, so nothing here
is trusted: positive controls first (its own TCP and UNIX listeners must be seen, and an
ICMP echo to the guest's loopback answered), otherwise the run ends ``blind`` (exit 3).

The ways to the host it tries: TCP to the host ports via 127.0.0.1, ``[::1]``, each default
gateway and nameserver; the same ports over vsock to the host (CID 2); UDP to the well-known
UDP ports on the same addresses (any answer counts); ICMP and ICMPv6 echo to each gateway
and to the outside address. First it reports what each network link can carry (its kind,
flags, addresses and routes, read over rtnetlink by ``bottlenet.transparent.links``, which
the kit ships and the script carries): the judge allows a link but ``lo`` only when it
provably carries nothing.
"""

import hashlib
import os
import socket
import struct
import sys
import tempfile
import threading
import time

PLAN = {}  # type: dict  # filled in by script.render

EXIT_PASS, EXIT_FAIL, EXIT_BLIND = 0, 1, 3


def say(*words):
    sys.stdout.write(" ".join(["BNP", PLAN["nonce"]] + [str(w) for w in words]) + "\n")
    sys.stdout.flush()


def sockaddr(kind, addr):
    """(family, address) for ``tcp``/``udp``/``unix``/``vsock`` and ``HOST:PORT``/``PATH``/
    ``CID:PORT`` (HOST may be [v6%dev])."""
    if kind == "unix":
        return socket.AF_UNIX, addr
    if kind == "vsock":
        cid, _, port = addr.partition(":")
        return socket.AF_VSOCK, (int(cid), int(port))
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    if ":" in host:
        ip, _, dev = host.partition("%")
        scope = socket.if_nametoindex(dev) if dev else 0
        return socket.AF_INET6, (ip, int(port), 0, scope)
    return socket.AF_INET, (host, int(port))


def connect(kind, addr, send=None, timeout=None):
    """True when a connection is established within the budget (then ``send`` is written)."""
    t = PLAN["timeout"] if timeout is None else timeout
    try:
        family, target = sockaddr(kind, addr)
        s = socket.socket(family, socket.SOCK_STREAM)
    except (OSError, ValueError):
        return False
    try:
        s.settimeout(t)
        s.connect(target)
        if send is not None:
            s.sendall(send)
            s.shutdown(socket.SHUT_WR)
            end = time.monotonic() + t
            while time.monotonic() < end:  # until the witness has read and closed
                if not s.recv(256):
                    break
        return True
    except (OSError, ValueError):
        return False
    finally:
        s.close()


def hello(port):
    """A datagram a service on ``port`` answers: a DNS query, an NTP request, else the nonce."""
    if port == 53:
        return struct.pack("!HHHHHH", 0x424E, 0x0100, 1, 0, 0, 0) + b"\0" + struct.pack("!HH", 2, 1)
    if port == 123:
        return b"\x23" + b"\0" * 47
    return ("BNP-UDP %s\n" % PLAN["nonce"]).encode()


def datagram(addr):
    """True when a datagram to ``HOST:PORT`` is answered within the budget (any reply)."""
    try:
        family, target = sockaddr("udp", addr)
        s = socket.socket(family, socket.SOCK_DGRAM)
    except (OSError, ValueError):
        return False
    try:
        s.settimeout(PLAN["timeout"])
        s.connect(target)
        s.send(hello(target[1]))
        s.recv(512)
        return True
    except (OSError, ValueError):
        return False  # refused (ICMP port unreachable), unreachable, or silent
    finally:
        s.close()


def reach(target):
    """A deny target (``kind:address``) answers: connects, or for UDP replies."""
    kind, _, addr = target.partition(":")
    return datagram(addr) if kind == "udp" else connect(kind, addr)


def checksum(data):
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def ping(addr):
    """True when ``addr`` (IPv4, or IPv6 with ICMPv6) answers one echo within the budget;
    None when ICMP is unusable."""
    ident = os.getpid() & 0xFFFF
    v6 = ":" in addr
    family, proto = (
        (socket.AF_INET6, socket.IPPROTO_ICMPV6) if v6 else (socket.AF_INET, socket.IPPROTO_ICMP)
    )
    request, reply = (128, 129) if v6 else (8, 0)
    for kind in (socket.SOCK_RAW, socket.SOCK_DGRAM):
        try:
            s = socket.socket(family, kind, proto)
        except OSError:
            continue
        try:
            body = b"bottlenet-gate"
            header = struct.pack("!BBHHH", request, 0, 0, ident, 1)
            total = 0 if v6 else checksum(header + body)  # the kernel sums ICMPv6
            packet = struct.pack("!BBHHH", request, 0, total, ident, 1) + body
            s.settimeout(PLAN["timeout"])
            try:
                dest = sockaddr("tcp", "[%s]:0" % addr)[1] if v6 else (addr, 0)
                s.sendto(packet, dest)
            except (OSError, ValueError):
                return False
            end = time.monotonic() + PLAN["timeout"]
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                s.settimeout(left)
                try:
                    data, peer = s.recvfrom(2048)
                except OSError:
                    return False
                if kind == socket.SOCK_RAW and not v6:
                    data = data[(data[0] & 0x0F) * 4 :]
                if same_ip(peer[0], addr) and data[:1] == bytes([reply]):
                    return True
        finally:
            s.close()
    return None


def same_ip(a, b):
    """Two IP literals name the same address (scope ids aside)."""
    a, b = a.partition("%")[0], b.partition("%")[0]
    family = socket.AF_INET6 if ":" in a else socket.AF_INET
    try:
        return socket.inet_pton(family, a) == socket.inet_pton(family, b)
    except (OSError, ValueError):
        return False


def proxy_connect(via, target):
    """``answered`` (2xx), ``refused`` (any other answer or a close), ``unreachable``."""
    kind, _, addr = via.partition(":")
    try:
        family, sa = sockaddr(kind, addr)
        s = socket.socket(family, socket.SOCK_STREAM)
    except (OSError, ValueError):
        return "unreachable"
    try:
        s.settimeout(PLAN["timeout"] * 3)
        try:
            s.connect(sa)
        except OSError:
            return "unreachable"
        s.sendall(("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, target)).encode())
        head = b""
        while b"\r\n" not in head and len(head) < 256:
            chunk = s.recv(256)
            if not chunk:
                break
            head += chunk
        words = head.split(b"\r\n", 1)[0].split()
        good = len(words) >= 2 and words[0].startswith(b"HTTP/") and words[1][:1] == b"2"
        return "answered" if good and len(words[1]) == 3 else "refused"
    except OSError:
        return "refused"
    finally:
        s.close()


def resolves(name):
    ok = []

    def look():
        try:
            socket.getaddrinfo(name, 443)
            ok.append(1)
        except Exception:
            pass

    th = threading.Thread(target=look, daemon=True)
    th.start()
    th.join(PLAN["timeout"])
    return bool(ok)


def parallel(fn, items):
    """``fn`` over ``items`` in threads (at most 16 at once), results in order."""
    results = [None] * len(items)

    def run(i, item):
        results[i] = fn(item)

    for start in range(0, len(items), 16):
        threads = [
            threading.Thread(target=run, args=(i, items[i]), daemon=True)
            for i in range(start, min(start + 16, len(items)))
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(PLAN["timeout"] * 2 + 1)
    return results


def controls():
    """The positive controls: the tool must see its own listeners, and ICMP must work."""
    seen = {"tcp": 0, "unix": 0}
    ok = True

    def accept(srv, kind):
        try:
            srv.settimeout(PLAN["timeout"] * 2)
            conn, _ = srv.accept()
            seen[kind] += 1
            conn.close()
        except OSError:
            pass

    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(1)
    base = next((d for d in ("/run", "/dev/shm", "/tmp") if os.access(d, os.W_OK)), None)
    tmp = tempfile.mkdtemp(prefix="bnp-", dir=base)
    path = os.path.join(tmp, "c.sock")
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(path)
    unix.listen(1)
    for srv, kind, addr in (
        (tcp, "tcp", "127.0.0.1:%d" % tcp.getsockname()[1]),
        (unix, "unix", path),
    ):
        th = threading.Thread(target=accept, args=(srv, kind), daemon=True)
        th.start()
        connected = connect(kind, addr)
        th.join(PLAN["timeout"] * 2)
        good = connected and seen[kind] == 1
        say("control", kind, "ok" if good else "fail")
        ok = ok and good
        srv.close()
    os.unlink(path)
    os.rmdir(tmp)
    icmp = ping("127.0.0.1")
    say("control", "icmp", "ok" if icmp else "fail")
    return ok and bool(icmp)


def hexip4(h):
    return socket.inet_ntoa(struct.pack("<I", int(h, 16)))


def fields(path, skip=0):
    """The whitespace-split lines of a text file (none when it cannot be read)."""
    try:
        with open(path) as fh:
            return [line.split() for line in fh.readlines()[skip:]]
    except OSError:
        return []


def paths():
    """Every way to the host the guest knows of: default gateways and nameservers."""
    found = []
    for f in fields("/proc/net/route", skip=1):
        if len(f) > 3 and f[1] == "00000000" and int(f[3], 16) & 2:
            found.append(("gw", hexip4(f[2])))
    for f in fields("/proc/net/ipv6_route"):
        if len(f) == 10 and f[0] == "0" * 32 and f[1] == "00" and f[4] != "0" * 32:
            ip = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(f[4]))
            found.append(("gw", ip + "%" + f[9] if ip.startswith("fe80") else ip))
    for f in fields("/etc/resolv.conf"):
        if len(f) >= 2 and f[0] == "nameserver":
            found.append(("ns", f[1]))
    out = []
    for kind, addr in found:
        if (kind, addr) not in out:
            out.append((kind, addr))
    return out


def endpoint(kind, host, port):
    return "%s:[%s]:%d" % (kind, host, port) if ":" in host else "%s:%s:%d" % (kind, host, port)


def ident_hash(path):
    try:
        with open(path) as fh:
            value = fh.read().strip()
    except OSError:
        return "none"
    if not value:
        return "none"
    return hashlib.sha256(("%s:%s" % (PLAN["nonce"], value)).encode()).hexdigest()


def volumes():
    name = ".bottlenet-gate-" + PLAN["nonce"]
    for d in PLAN["ro"]:
        p = os.path.join(d, name)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            say("ro", d, "ok")
            continue
        os.close(fd)
        os.unlink(p)
        say("ro", d, "writable")
    for d in PLAN["rw"]:
        p = os.path.join(d, name)
        try:
            with open(p, "w") as fh:
                fh.write(PLAN["nonce"] + "\n")
            with open(p) as fh:
                good = fh.read() == PLAN["nonce"] + "\n"
        except OSError:
            good = False
        say("rw", d, "ok" if good else "fail")


def dial(canary):
    """A canary through the transparent egress layer: ``connected`` when the connect
    completes (the layer's listener took it; the host must have seen its CONNECT), else
    ``failed``. A name is resolved first (by the layer's fake-IP resolver)."""
    kind, _, rest = canary.partition(":")
    host, _, port = rest.rpartition(":")
    if kind == "name":
        found = []

        def look():
            try:
                found.extend(
                    socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
                )
            except Exception:
                pass

        th = threading.Thread(target=look, daemon=True)
        th.start()
        th.join(PLAN["timeout"])
        if not found:
            return "failed"
        rest = "%s:%s" % (found[0][4][0], port)
    end = time.monotonic() + PLAN["timeout"] * 3
    try:
        family, target = sockaddr("tcp", rest)
        s = socket.socket(family, socket.SOCK_STREAM)
    except (OSError, ValueError):
        return "failed"
    try:
        s.settimeout(PLAN["timeout"])
        try:
            s.connect(target)
        except ConnectionResetError:
            return "connected"  # reset by the layer before this thread ran again
        except (OSError, ValueError):
            return "failed"
        try:  # until the layer ends it (the proxy refused the canary)
            while time.monotonic() < end and s.recv(256):
                pass
        except OSError:
            pass
        return "connected"
    finally:
        s.close()


def layer_main():
    """The layer's check: canaries redirected, UDP and ICMP to the outside still blocked."""
    if not controls():
        say("end", "blind")
        return EXIT_BLIND
    fail = False
    canaries = list(PLAN["canaries"])
    for c, r in zip(canaries, parallel(dial, canaries)):
        say("redirect", c, r)
        fail = fail or r != "connected"
    udp = "udp:" + PLAN["outside"][4:]
    r = reach(udp)
    say("deny", udp, "reachable" if r else "blocked")
    outside_ip = PLAN["outside"][4:].rpartition(":")[0].strip("[]")
    answered = ping(outside_ip)
    say("icmp", outside_ip, "answers" if answered else "blocked")
    fail = fail or r or bool(answered)
    say("end", "fail" if fail else "pass")
    return EXIT_FAIL if fail else EXIT_PASS


def report_links():
    """``link NAME KIND FLAGS``, then its ``addr NAME IP/LEN`` and ``route NAME TYPE DEST/LEN``
    lines, for every link (``links unreadable`` when rtnetlink cannot be read)."""
    try:
        from bottlenet.transparent.links import read

        found = read()
    except Exception:  # no rtnetlink, or an image's python3 too old for the reader
        say("links", "unreadable")
        return
    for link in found:
        say("link", link.name, link.kind or "-", "%x" % link.flags)
        for a in link.addresses:
            say("addr", link.name, a)
        for r in link.routes:
            say("route", link.name, r)


def main():
    if PLAN.get("layer"):
        return layer_main()
    report_links()
    if not controls():
        say("end", "blind")
        return EXIT_BLIND
    fail = False
    for ep in PLAN["own"]:
        kind, _, addr = ep.partition(":")
        line = ("BNP-WITNESS %s %s\n" % (PLAN["nonce"], ep)).encode() if PLAN["witness"] else None
        good = connect(kind, addr, send=line)
        say("own", ep, "ok" if good else "fail")
        fail = fail or not good
    routes = paths()
    for kind, addr in routes:
        say("path", kind, addr)
    hosts = list(PLAN["loopbacks"]) + [a for _, a in routes]
    deny = list(PLAN["deny"])
    wanted = [endpoint("tcp", h, port) for h in hosts for port in PLAN["ports"]]
    wanted += ["vsock:%d:%d" % (PLAN["vsock_cid"], port) for port in PLAN["ports"]]
    wanted += [endpoint("udp", h, port) for h in hosts for port in PLAN["udp_ports"]]
    wanted += [PLAN["outside"], "udp:" + PLAN["outside"][4:]]
    for t in wanted:
        if t not in deny:
            deny.append(t)
    reached = parallel(reach, deny)
    for t, r in zip(deny, reached):
        say("deny", t, "reachable" if r else "blocked")
        fail = fail or r
    outside_ip = PLAN["outside"][4:].rpartition(":")[0].strip("[]")
    icmp = [a for k, a in routes if k == "gw"] + [outside_ip]
    icmp = [a for i, a in enumerate(icmp) if a not in icmp[:i]]
    if any(":" in a for a in icmp):  # ICMPv6 must be seen to work before it is trusted
        icmp6 = bool(ping("::1"))
        say("control", "icmp6", "ok" if icmp6 else "fail")
        fail = fail or not icmp6
    answered = parallel(ping, icmp)
    for a, r in zip(icmp, answered):
        say("icmp", a, "answers" if r else "blocked")
        fail = fail or bool(r)
    for name, r in zip(PLAN["dns"], parallel(resolves, PLAN["dns"])):
        say("dns", name, "resolves" if r else "blocked")
        fail = fail or r
    for p in PLAN["absent"]:
        present = os.path.lexists(p)
        say("absent", p, "present" if present else "ok")
        fail = fail or present
    if PLAN["connect_via"]:
        for target in PLAN["connect_ok"] + PLAN["connect_no"]:
            r = proxy_connect(PLAN["connect_via"], target)
            say("connect", target, r)
            fail = fail or (r != "answered") == (target in PLAN["connect_ok"])
    say("id", "machine-id", ident_hash("/etc/machine-id"))
    say("id", "hostname", ident_hash("/proc/sys/kernel/hostname"))
    volumes()
    say("end", "fail" if fail else "pass")
    return EXIT_FAIL if fail else EXIT_PASS


if __name__ == "__main__":
    sys.exit(main())
