"""The bridge's proof, run in the guest right after the bridge is ready: for each port, a
connection to 127.0.0.1:<port> sends the witness line the host's listener for that service
must see (``BNP-WITNESS <nonce> <endpoint>``) and waits until the host closes it. It prints
``BNB reach <port> ok`` or ``BNB reach <port> <errno name>``; the host decides on what its
own listener saw, not on these lines. ``CHECK`` is filled in by ``script.render_reach``.
"""

import errno
import socket
import sys

CHECK = {}  # type: dict  # filled in by script.render_reach


def reach(port, line, timeout):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(("127.0.0.1", port))
        s.sendall(line)
        while s.recv(512):
            pass
        return "ok"
    except socket.timeout:
        return "timeout"
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, "EUNKNOWN")
    finally:
        s.close()


def main():
    for port, endpoint in CHECK["ports"]:
        line = ("BNP-WITNESS %s %s\n" % (CHECK["nonce"], endpoint)).encode()
        sys.stdout.write("BNB reach %d %s\n" % (port, reach(port, line, CHECK["timeout"])))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
