"""The guest half of the tier's socket-mode endpoint: a guest UNIX path onto a virtio port.

Stands in for smolvm's ``--mount-socket``: the host end of the port is a QEMU chardev that
connects to the daemon's real listener. One connection at a time; each opens the port, waits
for its host end to be connected (QEMU reconnects a second after the previous connection
ended), pumps bytes both ways, and ends when the guest side and then the host side are done.
"""

import os
import select
import socket
import sys
import time


def port_path(name):
    base = "/sys/class/virtio-ports"
    for entry in os.listdir(base):
        with open(os.path.join(base, entry, "name")) as fh:
            if fh.read().strip() == name:
                return "/dev/" + entry
    raise SystemExit("no virtio port named " + name)


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


def host_connected(fd, seconds):
    """Wait until the port's host end is connected (until then it polls HUP, not OUT, and
    reads as end of file)."""
    p = select.poll()
    p.register(fd, select.POLLOUT)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if any(ev & select.POLLOUT for _, ev in p.poll(100)):
            return True
    return False


def pump(conn, dev):
    fd = os.open(dev, os.O_RDWR | os.O_NONBLOCK)
    guest_open, deadline = True, None
    try:
        if not host_connected(fd, 30.0):
            return
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
    dev = port_path(name)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    while True:
        conn, _ = srv.accept()
        try:
            pump(conn, dev)
        except OSError:
            pass
        finally:
            conn.close()


main()
