"""bottlenet's in-guest bridge: one TCP listener on 127.0.0.1 per service, relayed to a socket.

Runs in the agent VM on the image's python3 (3.7 or later, standard library only), fed on
stdin, never written into the image. ``BRIDGES`` is filled in by ``script.render``: a list of
``[port, unix socket path]``. It binds every listener first (on 127.0.0.1 only) and prints
``BNB ready`` or ``BNB bind <port> <errno name>`` (then exits 3); after that it relays each
accepted connection byte for byte to a fresh connection on the socket, with half-close (an
end of stream in one direction is a ``shutdown(SHUT_WR)`` on the other side; the other
direction keeps flowing), at most ``MAX_CONNECTIONS`` at a time (more wait in the listen
backlog). It runs in the foreground until killed and prints nothing else (no payload byte is
ever printed). Its stdin is its lifeline: when stdin is a pipe or a socket (the daemon's exec
session), its end ends the bridge, so a bridge never outlives the session that started it (a
daemon killed with SIGKILL included); fed from a file or a terminal it runs until killed.

One thread and one ``selectors`` loop serve every connection: in a 1-vCPU guest, two threads
per connection spent their time handing the GIL (and the CPU) back and forth. A read goes into
one shared ``CHUNK`` buffer and straight on to the other side; only what the other side does
not take at once is kept (at most one ``CHUNK`` per direction, and that direction reads
nothing more until it is written), so memory is bounded per connection.
"""

import errno
import os
import selectors
import socket
import stat
import sys
import time

BRIDGES = []  # type: list  # filled in by script.render

#: The most one read moves; the buffer is shared by every connection.
CHUNK = 256 * 1024
MAX_CONNECTIONS = 256
EXIT_BIND = 3
BIND_RETRY_SECONDS = 5.0
#: How long a new connection waits for room in the socket's accept queue, asking this often.
CONNECT_SECONDS = 5.0
RETRY_SECONDS = 0.05
#: How long accepting pauses when the guest is out of file descriptors or memory.
PAUSE_SECONDS = 0.1
READ = selectors.EVENT_READ
WRITE = selectors.EVENT_WRITE


def say(*words):
    sys.stdout.write(" ".join(["BNB"] + [str(w) for w in words]) + "\n")
    sys.stdout.flush()


def close(sock):
    try:
        sock.close()
    except OSError:
        pass


class Flow(object):
    """One direction of a connection: what is read from ``src`` is written to ``dst``."""

    __slots__ = ("src", "dst", "pending", "ended")

    def __init__(self, src, dst):
        self.src = src
        self.dst = dst
        self.pending = None  # a memoryview of what dst has not taken yet
        self.ended = False  # src reached its end

    def reading(self):
        return not self.ended and self.pending is None

    def done(self):
        return self.ended and self.pending is None

    def read(self, buf, view):
        try:
            n = self.src.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return
        if not n:
            self.ended = True
            self.half_close()
            return
        try:
            sent = self.dst.send(view[:n])
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < n:
            self.pending = memoryview(bytes(view[sent:n]))

    def write(self):
        try:
            sent = self.dst.send(self.pending)
        except (BlockingIOError, InterruptedError):
            return
        self.pending = self.pending[sent:] if sent < len(self.pending) else None
        if self.done():
            self.half_close()

    def half_close(self):
        if self.pending is None:
            try:
                self.dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass


class Connection(object):
    """A client and its socket connection: two flows, each side's interest kept current."""

    __slots__ = ("client", "upstream", "up", "down", "masks")

    def __init__(self, client, upstream):
        self.client = client
        self.upstream = upstream
        self.up = Flow(client, upstream)
        self.down = Flow(upstream, client)
        self.masks = {client: 0, upstream: 0}

    def ready(self, sock, mask, buf, view):
        """Serve one readiness event; False once the connection is over (both closed)."""
        try:
            mine, theirs = (self.up, self.down) if sock is self.client else (self.down, self.up)
            if mask & READ and mine.reading():
                mine.read(buf, view)
            if mask & WRITE and theirs.pending is not None:
                theirs.write()
        except OSError:  # one side failed: both directions end now
            return False
        return not (self.up.done() and self.down.done())

    def want(self, sock):
        if sock is self.client:
            return (READ if self.up.reading() else 0) | (WRITE if self.down.pending else 0)
        return (READ if self.down.reading() else 0) | (WRITE if self.up.pending else 0)


class Bridge(object):
    """Every listener and connection on one selector."""

    def __init__(self, listeners):
        self.sel = selectors.DefaultSelector()
        self.listeners = listeners
        self.buf = bytearray(CHUNK)
        self.view = memoryview(self.buf)
        self.count = 0  # connections open or waiting for the socket
        self.waiting = []  # [client, path, deadline]: the socket's queue was full
        self.accepting = False
        self.paused_until = 0.0

    def lifeline(self):
        """Watch stdin when it is a pipe or a socket (the session); its bytes are discarded."""
        try:
            mode = os.fstat(0).st_mode
        except OSError:
            return
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            self.sel.register(0, READ, None)

    def accept_on(self, on):
        if on == self.accepting:
            return
        for listener, path in self.listeners:
            if on:
                self.sel.register(listener, READ, path)
            else:
                self.sel.unregister(listener)
        self.accepting = on

    def accept(self, listener, path):
        while self.count < MAX_CONNECTIONS:
            try:
                client, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.paused_until = time.monotonic() + PAUSE_SECONDS
                    self.accept_on(False)
                return
            self.count += 1
            self.attach(client, path, time.monotonic() + CONNECT_SECONDS)

    def attach(self, client, path, deadline):
        """Connect ``client`` to a fresh connection on the socket at ``path``."""
        try:
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError:
            self.drop(client)
            return
        try:
            upstream.setblocking(False)
            upstream.connect(path)
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (BlockingIOError, InterruptedError):  # the socket's queue is full: ask again
            close(upstream)
            if time.monotonic() < deadline:
                self.waiting.append([client, path, deadline])
            else:
                self.drop(client)
            return
        except OSError:
            close(upstream)
            self.drop(client)
            return
        conn = Connection(client, upstream)
        self.update(conn)

    def drop(self, client):
        close(client)
        self.count -= 1

    def update(self, conn):
        for sock in (conn.client, conn.upstream):
            want = conn.want(sock)
            had = conn.masks[sock]
            if want == had:
                continue
            if not had:
                self.sel.register(sock, want, conn)
            elif not want:
                self.sel.unregister(sock)
            else:
                self.sel.modify(sock, want, conn)
            conn.masks[sock] = want

    def end(self, conn):
        for sock in (conn.client, conn.upstream):
            if conn.masks[sock]:
                self.sel.unregister(sock)
                conn.masks[sock] = 0
            close(sock)
        self.count -= 1

    def run(self):
        self.lifeline()
        while True:
            now = time.monotonic()
            if self.waiting:
                retry, self.waiting = self.waiting, []
                for client, path, deadline in retry:
                    self.attach(client, path, deadline)
            self.accept_on(self.count < MAX_CONNECTIONS and now >= self.paused_until)
            timeout = None
            if self.waiting:
                timeout = RETRY_SECONDS
            elif not self.accepting and self.count < MAX_CONNECTIONS:
                timeout = max(0.0, self.paused_until - now)
            for key, mask in self.sel.select(timeout):
                data = key.data
                if data is None:
                    self.stdin()
                elif isinstance(data, str):
                    if self.accepting:
                        self.accept(key.fileobj, data)
                elif data.masks[key.fileobj]:  # not ended earlier in this round
                    if data.ready(key.fileobj, mask, self.buf, self.view):
                        self.update(data)
                    else:
                        self.end(data)

    def stdin(self):
        try:
            data = os.read(0, 4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            os._exit(0)


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
            s.setblocking(False)
            return s
        except OSError as e:
            close(s)
            if e.errno != errno.EADDRINUSE or time.monotonic() >= end:
                raise
            time.sleep(0.2)


def main():
    listeners = []
    for port, path in BRIDGES:
        try:
            listeners.append((bind(port), path))
        except OSError as e:
            say("bind", port, errno.errorcode.get(e.errno or 0, "EUNKNOWN"))
            return EXIT_BIND
    bridge = Bridge(listeners)
    say("ready", len(listeners))
    bridge.run()


if __name__ == "__main__":
    sys.exit(main())
