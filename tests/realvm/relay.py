"""The guest half of the tier's socket-mode endpoint: a guest UNIX path onto a virtio port.

Stands in for smolvm's ``--mount-socket``: the host end of the port is a QEMU chardev that
connects to the daemon's real listener. One connection at a time; each opens the port, waits
for its host end to be connected (QEMU reconnects a second after the previous connection
ended), pumps bytes both ways, and ends when the guest side and then the host side are done.
A run may give the guest a pool of such ports (``NAME``, ``NAME-1``, ...; each a chardev onto
the same listener): connections take them in turn, so one need not wait out the previous
one's reconnect second (smolvm's vsock has no such wait).
"""

import os
import select
import socket
import sys
import time


def port_paths(name):
    """The ports named ``name`` and ``name-N``, in that order (``name`` first)."""
    base = "/sys/class/virtio-ports"
    found = {}
    for entry in os.listdir(base):
        try:  # a console port (virtconsole) has no name
            with open(os.path.join(base, entry, "name")) as fh:
                port = fh.read().strip()
        except FileNotFoundError:
            continue
        if port == name or (port.startswith(name + "-") and port[len(name) + 1 :].isdigit()):
            found[port] = "/dev/" + entry
    if name not in found:
        raise SystemExit("no virtio port named " + name)
    return [found[p] for p in sorted(found, key=lambda p: (len(p), p))]


def write_all(fd, data):
    """Write everything; a port whose host end is not (yet, again) connected is waited for
    (QEMU's chardev reconnects a second after the host closed the previous connection)."""
    view = memoryview(data)
    deadline = time.monotonic() + 30.0
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            select.select([], [fd], [], 0.1)


def host_connected(devs, seconds):
    """Open the first of ``devs`` whose host end is connected (until then a port polls HUP,
    not OUT, and reads as end of file), waiting for one: its index and fd, or None."""
    fds = [os.open(dev, os.O_RDWR | os.O_NONBLOCK) for dev in devs]
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLOUT)
    end = time.monotonic() + seconds
    chosen = None
    try:
        while chosen is None and time.monotonic() < end:
            ready = {fd for fd, ev in p.poll(100) if ev & select.POLLOUT}
            chosen = next((i for i, fd in enumerate(fds) if fd in ready), None)
    finally:
        for i, fd in enumerate(fds):
            if i != chosen:
                os.close(fd)
    return None if chosen is None else (chosen, fds[chosen])


def pump(conn, fd):
    guest_open, deadline = True, None
    try:
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if deadline is not None and wait == 0.0:
                return
            rlist = [fd] + ([conn] if guest_open else [])
            ready, _, _ = select.select(rlist, [], [], wait if wait is not None else 1.0)
            if conn in ready:
                data = conn.recv(65536)
                if not data:
                    guest_open, deadline = False, time.monotonic() + 3.0
                else:
                    write_all(fd, data)
            if fd in ready:
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not data:
                    return  # the host end closed
                conn.sendall(data)
    finally:
        os.close(fd)


def main():
    path, name = sys.argv[1], sys.argv[2]
    devs = port_paths(name)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    turn = 0
    while True:
        conn, _ = srv.accept()
        try:
            order = devs[turn:] + devs[:turn]  # the port used last comes last
            got = host_connected(order, 30.0)
            if got is not None:
                turn = (turn + got[0] + 1) % len(devs)
                pump(conn, got[1])
        except OSError:
            pass
        finally:
            conn.close()


main()
