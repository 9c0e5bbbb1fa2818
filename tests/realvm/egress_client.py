"""Clients that ignore proxy variables, in the real-VM tier's egress run (the guest's python3,
run with an empty environment). Prints ``RVE <check> <outcome>`` lines, never a payload but
the test page's own words."""

import socket
import sys
import urllib.request

CONF = {}  # filled in by the host


def say(*words):
    sys.stdout.write(" ".join(["RVE"] + [str(w).replace(" ", "_") for w in words]) + "\n")
    sys.stdout.flush()


def fetch(name, url):
    try:
        body = urllib.request.urlopen(url, timeout=30).read().decode()
        say(name, 200, body)
    except Exception as e:
        say(name, type(e).__name__)


def dial(name, host, port, timeout=20):
    """A raw TCP dial: what the far end did with it."""
    try:
        s = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        say(name, "connect", e.strerror or type(e).__name__)
        return
    try:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        data = s.recv(100)
        say(name, "read", len(data))
    except OSError as e:
        say(name, "after-connect", e.strerror or type(e).__name__)
    finally:
        s.close()


def datagram(name, host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_DGRAM)
    try:
        s.sendto(b"x", (host, port))
        say(name, "sent")
    except OSError as e:
        say(name, "sendto", e.strerror)
    finally:
        s.close()


def resolve(name, host):
    try:
        say(name, socket.gethostbyname(host))
    except OSError as e:
        say(name, "error", type(e).__name__)


def main():
    what = sys.argv[1]
    if what == "before":
        say("env", len(__import__("os").environ))
        fetch("urllib", "http://{}/urllib".format(CONF["allowed"]))
        fetch("urllib-denied", "http://{}/denied".format(CONF["denied"]))
        resolve("resolve", CONF["allowed"].partition(":")[0])
        dial("raw-v4", "203.0.113.7", 443)
        dial("raw-v6", "2001:db8::1", 443)
        datagram("udp", "203.0.113.7", 5353)
        datagram("udp6", "2001:db8::1", 5353)
    else:
        dial("after-v4", "203.0.113.7", 443, timeout=3)
        dial("after-v6", "2001:db8::1", 443, timeout=3)
        own("after-own", CONF["socket"], CONF["allowed"])


def own(name, path, target):
    """The bottle's own endpoint (its mounted socket), asked for a tunnel directly."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    try:
        s.connect(path)
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        say(name, s.recv(200).split(b"\r\n", 1)[0].decode().split(" ")[1])
    except (OSError, IndexError) as e:
        say(name, "error", type(e).__name__)
    finally:
        s.close()


if __name__ == "__main__":
    main()
