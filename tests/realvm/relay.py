"""The guest half of the tier's socket-mode endpoint: a guest UNIX path onto a virtio port.

Stands in for smolvm's ``--mount-socket``: the host end of the port is a QEMU chardev that
connects to the daemon's real listener. One connection at a time; each opens the port, pumps
bytes both ways, and ends when the guest side and then the host side are done.
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


def pump(conn, dev):
    fd = os.open(dev, os.O_RDWR | os.O_NONBLOCK)
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
                    os.write(fd, data)
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
