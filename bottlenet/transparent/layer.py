"""The layer's entry point: ``main(argv)``, one subcommand of bottlenet's guest kit.

``install [--port N]``: the routes and the nf_tables table (as root). ``serve --proxy PATH
[--port N]``: the listener and the resolver, in the foreground. ``run --proxy PATH [--port
N]``: both, as the daemon runs it in an attached session. ``remove``: the table deleted (what
a guest root that flushes the rules does). Every line it prints is ``BNE ...``:

* ``BNE ready`` once installed and listening;
* ``BNE missing KEY``: the kernel lacks a piece (``nftables.NEEDS[KEY]`` says which; exit 5);
* ``BNE failed STEP ERRNO``: a step failed otherwise (exit 6);
* ``BNE conn TARGET OUTCOME`` for each redirected connection.

Like the bridge, its stdin is its lifeline (``relay.lifeline``, the bridge's too): when stdin
is a pipe or a socket (the daemon's session), its end ends the layer. The rules stay when it
ends: with the listener gone, connects are refused, and a restart installs them again.
"""

from __future__ import annotations

import errno
import sys
import threading
import time
from collections.abc import Sequence

from bottlenet.transparent import nftables, routes
from bottlenet.transparent.listener import Listener
from bottlenet.transparent.netlink import NetlinkError
from bottlenet.transparent.relay import lifeline, spawn

#: The listener's port: below 1024, so no agent process (not root) can take it.
LISTEN_PORT = 1001
EXIT_USAGE, EXIT_MISSING, EXIT_FAILED = 2, 5, 6
_LOCK = threading.Lock()


def say(*words: object) -> None:
    with _LOCK:
        sys.stdout.write(" ".join(["BNE", *map(str, words)]) + "\n")
        sys.stdout.flush()


def _errno_name(e: BaseException) -> str:
    code = getattr(e, "errno", None)
    return errno.errorcode.get(code, "EUNKNOWN") if isinstance(code, int) else "EUNKNOWN"


def install(port: int) -> int:
    """The routes, then the table; 0, or the exit status after saying why not."""
    try:
        routes.install()
    except (OSError, NetlinkError) as e:
        say("failed", "routes", _errno_name(e))
        return EXIT_FAILED
    try:
        nftables.install(port)
    except nftables.Missing as e:
        say("missing", e.what)
        return EXIT_MISSING
    except (OSError, NetlinkError) as e:
        say("failed", "nftables", _errno_name(e))
        return EXIT_FAILED
    return 0


def serve(proxy: str, port: int) -> int:
    threading.stack_size(256 * 1024)
    spawn(lifeline)
    listener = Listener(proxy, port, lambda target, outcome: say("conn", target, outcome))
    try:
        listener.bind()
    except OSError as e:
        say("failed", "bind", _errno_name(e))
        return EXIT_FAILED
    listener.start()
    say("ready")
    while True:
        time.sleep(3600)


USAGE = "usage: egress install [--port N] | serve|run --proxy PATH [--port N] | remove"


def parse(argv: Sequence[str]) -> tuple[str, str | None, int] | None:
    """(command, proxy socket, port), or None for a command line that is not one. No
    argparse: the kit carries only what the guest programs import."""
    if not argv or argv[0] not in ("install", "serve", "run", "remove"):
        return None
    command, proxy, port = argv[0], None, LISTEN_PORT
    rest = list(argv[1:])
    while rest:
        if len(rest) < 2 or command == "remove":
            return None
        flag, value = rest.pop(0), rest.pop(0)
        if flag == "--proxy" and command in ("serve", "run"):
            proxy = value
        elif flag == "--port" and value.isdigit() and 1 <= int(value) <= 65535:
            port = int(value)
        else:
            return None
    if command in ("serve", "run") and proxy is None:
        return None
    return command, proxy, port


def main(argv: Sequence[str] | None = None) -> int:
    parsed = parse(sys.argv[1:] if argv is None else argv)
    if parsed is None:
        sys.stderr.write(USAGE + "\n")
        return EXIT_USAGE
    command, proxy, port = parsed
    if command == "remove":
        try:
            nftables.remove()
        except (OSError, NetlinkError, nftables.Missing) as e:
            say("failed", "nftables", _errno_name(e))
            return EXIT_FAILED
        return 0
    if command in ("install", "run"):
        code = install(port)
        if code or command == "install":
            return code
    assert proxy is not None
    return serve(proxy, port)


def entry(argv: list[str] | None = None) -> None:
    sys.exit(main(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    entry()
