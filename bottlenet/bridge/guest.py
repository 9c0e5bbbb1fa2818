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

One thread and one epoll loop serve every connection: in a 1-vCPU guest, two threads
per connection spent their time handing the GIL (and the CPU) back and forth. A read goes into
one shared ``CHUNK`` buffer and straight on to the other side; only what the other side does
not take at once is kept (at most one ``CHUNK`` per direction, and that direction reads
nothing more until it is written), so memory is bounded per connection.
"""

import errno
import os
import select
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
#: A hang-up or an error is served as both: the read or the write then says which.
IN_EVENTS = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
OUT_EVENTS = select.EPOLLOUT | select.EPOLLHUP | select.EPOLLERR
SAME, CHANGED, OVER = "same", "changed", "over"
NOBODY = (None, None)  # an fd ended earlier in the same round


def say(*words):
    sys.stdout.write(" ".join(["BNB"] + [str(w) for w in words]) + "\n")
    sys.stdout.flush()


def close(sock):
    try:
        sock.close()
    except OSError:
        pass


class Connection(object):
    """A client (side 0) and its connection on the socket (side 1). Direction ``i`` reads
    side ``i`` and writes the other; ``pending[i]`` is what the other side has not taken
    yet (side ``i`` is not read meanwhile), ``ended[i]`` that side ``i`` reached its end."""

    __slots__ = ("socks", "pending", "ended", "masks")

    def __init__(self, client, upstream):
        self.socks = (client, upstream)
        self.pending = [None, None]
        self.ended = [False, False]
        self.masks = [0, 0]

    def event(self, i, ev, view):
        """Serve one readiness event of side ``i``: ``SAME`` when the interests stay as they
        are (a round trip's usual case, no epoll call), ``CHANGED``, or ``OVER``."""
        pending = self.pending
        result = SAME
        if ev & IN_EVENTS and not self.ended[i] and pending[i] is None:
            src, dst = self.socks[i], self.socks[1 - i]
            try:
                n = src.recv_into(view)
            except (BlockingIOError, InterruptedError):
                n = -1
            if n == 0:
                self.ended[i] = True
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                if self.ended[1 - i]:
                    return OVER
                result = CHANGED
            elif n > 0:
                try:
                    sent = dst.send(view[:n])
                except (BlockingIOError, InterruptedError):
                    sent = 0
                if sent < n:
                    pending[i] = memoryview(bytes(view[sent:n]))
                    result = CHANGED
        j = 1 - i
        if ev & OUT_EVENTS and pending[j] is not None:
            try:
                sent = self.socks[i].send(pending[j])
            except (BlockingIOError, InterruptedError):
                sent = 0
            if sent < len(pending[j]):
                pending[j] = pending[j][sent:]
            else:
                pending[j] = None
                result = CHANGED
        return result

    def want(self, i):
        """The events side ``i`` waits for."""
        mask = 0
        if not self.ended[i] and self.pending[i] is None:
            mask = select.EPOLLIN
        if self.pending[1 - i] is not None:
            mask |= select.EPOLLOUT
        return mask


class Bridge(object):
    """Every listener and connection on one epoll loop."""

    def __init__(self, listeners):
        self.ep = select.epoll()
        self.handlers = {}  # fd -> (Connection, side), or (None, (listener, path))
        self.listeners = listeners
        self.view = memoryview(bytearray(CHUNK))
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
            self.ep.register(0, select.EPOLLIN)
            self.handlers[0] = (None, None)

    def accept_on(self, on):
        if on == self.accepting:
            return
        for listener, path in self.listeners:
            fd = listener.fileno()
            if on:
                self.ep.register(fd, select.EPOLLIN)
                self.handlers[fd] = (None, (listener, path))
            else:
                self.ep.unregister(fd)
                del self.handlers[fd]
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
        for i in (0, 1):
            want = conn.want(i)
            had = conn.masks[i]
            if want == had:
                continue
            fd = conn.socks[i].fileno()
            if not had:
                self.ep.register(fd, want)
                self.handlers[fd] = (conn, i)
            elif not want:
                self.ep.unregister(fd)
                del self.handlers[fd]
            else:
                self.ep.modify(fd, want)
            conn.masks[i] = want

    def end(self, conn):
        for i in (0, 1):
            sock = conn.socks[i]
            if conn.masks[i]:
                fd = sock.fileno()
                self.ep.unregister(fd)
                del self.handlers[fd]
                conn.masks[i] = 0
            close(sock)
        self.count -= 1

    def run(self):
        self.lifeline()
        handlers, view = self.handlers, self.view
        while True:
            now = time.monotonic()
            if self.waiting:
                retry, self.waiting = self.waiting, []
                for client, path, deadline in retry:
                    self.attach(client, path, deadline)
            self.accept_on(self.count < MAX_CONNECTIONS and now >= self.paused_until)
            timeout = -1
            if self.waiting:
                timeout = RETRY_SECONDS
            elif not self.accepting and self.count < MAX_CONNECTIONS:
                timeout = max(0.0, self.paused_until - now)
            for fd, ev in self.ep.poll(timeout):
                conn, side = handlers.get(fd, NOBODY)
                if conn is not None:
                    try:
                        result = conn.event(side, ev, view)
                    except OSError:  # one side failed: both directions end now
                        result = OVER
                    if result is CHANGED:
                        self.update(conn)
                    elif result is OVER:
                        self.end(conn)
                elif side is None:
                    if fd == 0:
                        self.stdin()
                elif self.accepting:
                    self.accept(*side)

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
