"""bottlenet's in-guest bridge: one TCP listener on 127.0.0.1 per service, relayed to a socket.

Runs in the agent VM on the image's python3 (3.7 or later, standard library only), fed on
stdin, never written into the image. ``BRIDGES`` is filled in by ``script.render``: a list of
``[port, unix socket path]``. It binds every listener first (on 127.0.0.1 only) and prints
``BNB ready`` or ``BNB bind <port> <errno name>`` (then exits 3); after that it relays each
accepted connection byte for byte to a fresh connection on the socket, with half-close (an
end of stream in one direction is a ``shutdown(SHUT_WR)`` on the other side; the other
direction keeps flowing), one ``CHUNK`` buffer per direction, at most ``MAX_CONNECTIONS`` at
a time (more wait in the listen backlog). It runs in the foreground until killed. Its stdin
is its lifeline: when stdin is a pipe or a socket (the daemon's exec session), its end ends
the bridge, so a bridge never outlives the session that started it (a daemon killed with
SIGKILL included); fed from a file or a terminal it runs until killed. The lifeline and the
relay's pump are ``bottlenet.transparent.relay``'s, shared with the egress layer (the kit
ships that package; the no-kit script carries the module).

A connection the host never sees (issue 27 item 3): smolvm's VM confirms the connect to a
mounted socket even when the host side could not connect, and then the bytes go nowhere
with no end. So the bridge says ``BNB conn <port>`` for every connection it makes (no payload
byte is ever printed), the daemon compares that with what its listener saw, and answers
``down <port>`` on stdin when connections went missing: the bridge then ends that port's
connections that have not had a byte from the socket yet, and their clients get EOF.

Two blocking threads per connection, each a ``recv_into`` and ``sendall`` loop, are what
measured cheapest (benchmarks/bridge_cost.py on the host, the real-VM tier's bridge run in a
1-vCPU TCG guest): a round trip through them costs what the least relay there can be costs,
one epoll loop for every connection cost about 0.3 ms more per round trip in the guest, and
``os.splice`` through a pipe took twice the CPU per byte of a 256 KiB ``recv_into``.
"""

import errno
import socket
import sys
import threading
import time

from bottlenet.transparent.relay import lifeline, pump, spawn

BRIDGES = []  # type: list  # filled in by script.render
#: port -> the connections (client, upstream) that have had no byte from the socket yet.
QUIET = {}  # type: dict
LOCK = threading.Lock()

#: One buffer per direction: large reads mean few system calls per byte.
CHUNK = 256 * 1024
MAX_CONNECTIONS = 256
EXIT_BIND = 3
BIND_RETRY_SECONDS = 5.0


def say(*words):
    with LOCK:
        sys.stdout.write(" ".join(["BNB"] + [str(w) for w in words]) + "\n")
        sys.stdout.flush()


def close(sock):
    try:
        sock.close()
    except OSError:
        pass


def heard(port, pair):
    """The socket answered: this connection is no longer one the host may have missed."""
    with LOCK:
        QUIET.get(port, set()).discard(pair)


def end_quiet(port):
    """``down <port>``: end that port's connections that never had a byte from the socket."""
    with LOCK:
        pairs = list(QUIET.get(port, ()))
    for pair in pairs:
        for s in pair:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def relay(client, port, path, slots):
    """One connection: a fresh connection on the socket, two pumps, then both closed."""
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        close(upstream)
        close(client)
        slots.release()
        return
    pair = (client, upstream)
    with LOCK:
        QUIET.setdefault(port, set()).add(pair)
    say("conn", port)
    left = [2]
    lock = threading.Lock()

    def done():
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            heard(port, pair)
            close(client)
            close(upstream)
            slots.release()

    def direction(src, dst, first=None):
        pump(src, dst, CHUNK, first)
        done()

    try:
        spawn(direction, client, upstream)
    except RuntimeError:  # no thread to be had: this connection ends, the bridge goes on
        close(client)
        close(upstream)
        slots.release()
        return
    direction(upstream, client, lambda: heard(port, pair))


def serve(listener, port, path, slots):
    while True:
        slots.acquire()
        try:
            client, _ = listener.accept()
        except OSError as e:
            slots.release()
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                time.sleep(0.1)
            continue
        try:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            spawn(relay, client, port, path, slots)
        except (OSError, RuntimeError):
            close(client)
            slots.release()


def bind(port):
    """A listener on 127.0.0.1:port; a port still held (a predecessor being killed) is
    retried for a few seconds."""
    end = time.monotonic() + BIND_RETRY_SECONDS
    while True:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(128)
            return s
        except OSError as e:
            close(s)
            if e.errno != errno.EADDRINUSE or time.monotonic() >= end:
                raise
            time.sleep(0.2)


def told(line):
    """A line on the lifeline: ``down <port>`` ends that port's quiet connections."""
    words = line.split()
    if len(words) == 2 and words[0] == b"down" and words[1].isdigit():
        end_quiet(int(words[1]))


def main():
    threading.stack_size(256 * 1024)
    spawn(lifeline, told)
    listeners = []
    for port, path in BRIDGES:
        try:
            listeners.append((bind(port), path))
        except OSError as e:
            say("bind", port, errno.errorcode.get(e.errno or 0, "EUNKNOWN"))
            return EXIT_BIND
    slots = threading.Semaphore(MAX_CONNECTIONS)
    for (listener, path), (port, _) in zip(listeners, BRIDGES):
        spawn(serve, listener, port, path, slots)
    say("ready", len(listeners))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
