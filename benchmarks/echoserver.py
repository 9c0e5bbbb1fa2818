"""A selector-based echo server for the benchmarks: many connections, no payload kept."""

from __future__ import annotations

import selectors
import socket


def serve_echo(srv: socket.socket, recv_size: int = 65536) -> None:
    """Echo every connection accepted on the listening ``srv``, forever (call it in a thread
    or a child process). Accepts are drained per event; a peer that errors is closed."""
    srv.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            s = key.fileobj
            if s is srv:
                while True:
                    try:
                        c, _ = srv.accept()
                    except OSError:  # BlockingIOError: drained; EMFILE: try on the next event
                        break
                    c.setblocking(False)
                    sel.register(c, selectors.EVENT_READ)
                continue
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(recv_size)
            except OSError:
                data = b""
            if data:
                try:
                    s.send(data)
                except OSError:
                    pass
            else:
                sel.unregister(s)
                s.close()
