"""The layer as a POSIX sh script for an agent VM without bottlenet's guest kit.

Until the kit (issue 36) is mounted, the daemon runs the layer on the image's python3, as it
runs the bridge: the script comes on the guest's stdin (``/bin/sh -s``), and the layer's
modules travel inside its ``-c`` program (a finder that imports them from memory), so
nothing is written into the image and the session's stdin stays the layer's lifeline. A kit
calls ``bottlenet.transparent.layer.main`` itself and needs none of this.
"""

from __future__ import annotations

import re
from importlib import resources

#: The modules the layer runs (its room, without this host-side file).
MODULES = ("netlink", "nftables", "routes", "names", "listener", "layer")
#: Where a trusted kit with its own python3 is mounted (the probe's KIT_DIR).
KIT_DIR = "/run/bottlenet-probe"
EXIT_NO_TOOL = 4
NO_TOOL = "BNE notool"
_PATH = re.compile(r"/[A-Za-z0-9._/-]{1,106}")

_BOOT = """\
import sys
from importlib.abc import Loader, MetaPathFinder
from importlib.util import spec_from_loader
SOURCES = {sources!r}
PACKAGES = ("bottlenet", "bottlenet.transparent")
class Memory(MetaPathFinder, Loader):
    def find_spec(self, name, path=None, target=None):
        if name in PACKAGES or name in SOURCES:
            return spec_from_loader(name, self, is_package=name in PACKAGES)
        return None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        if module.__name__ in PACKAGES:
            module.__path__ = []
            return
        exec(compile(SOURCES[module.__name__], module.__name__, "exec"), module.__dict__)
sys.meta_path.insert(0, Memory())
from bottlenet.transparent.layer import main
sys.exit(main(sys.argv[1:]))
"""

_SH = """\
#!/bin/sh
# bottlenet's transparent egress layer (issue 37), fed on stdin to /bin/sh -s in the agent VM
# as root: routes and nf_tables rules by netlink, a listener on port {port}, a resolver on
# 127.0.0.53:53; every TCP connect leaves as CONNECT host:port on {proxy}.
# Prints "BNE ready", then one "BNE conn TARGET OUTCOME" per connection; runs until its stdin
# ends. Exit 5: the kernel lacks a piece ("BNE missing KEY"); {no_tool}: no python3.
if [ -x {kit}/bin/python3 ]; then PY={kit}/bin/python3
elif command -v python3 >/dev/null 2>&1; then PY=python3
else echo "{notool}"; exit {no_tool}
fi
exec "$PY" -I -S -c '{program}' {command}
"""


def check_proxy_path(path: str) -> str:
    if not _PATH.fullmatch(path) or "/../" in f"{path}/" or "//" in path:
        raise ValueError(f"the proxy socket {path!r} is not an absolute path of [A-Za-z0-9._/-]")
    return path


def program() -> str:
    """The bootstrap with the layer's sources in it."""
    room = resources.files("bottlenet.transparent")
    sources = {f"bottlenet.transparent.{m}": room.joinpath(f"{m}.py").read_text() for m in MODULES}
    return _BOOT.format(sources=sources)


def render(proxy: str, port: int, command: str = "run") -> bytes:
    """The script for a layer whose proxy service is mounted at ``proxy`` (``command``:
    ``run``, or ``remove``: the table deleted, as a guest root may)."""
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range")
    text = program().replace("'", "'\\''")
    proxy = check_proxy_path(proxy)
    argv = {"run": f"run --proxy {proxy} --port {port}", "remove": "remove"}[command]
    return _SH.format(
        port=port,
        command=argv,
        proxy=proxy,
        kit=KIT_DIR,
        no_tool=EXIT_NO_TOOL,
        notool=NO_TOOL,
        program=text,
    ).encode()


#: The guest command: the script comes on stdin.
ARGV = ("/bin/sh", "-s")
