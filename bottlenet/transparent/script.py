"""The room's modules carried to an image's python3, for agent VMs without bottlenet's guest kit.

Where no kit is mounted, the daemon's guest programs run on the image's python3 from a script
on the guest's stdin (``/bin/sh -s``): nothing is written into the image. :func:`bootstrap`
is the one way such a program gets this room's modules: their sources travel inside it and a
finder imports them from memory (the layer here, the probe's link report, the bridge's
relay). ``render`` is the layer's own script: its program is an argument (``-c``), so the
session's stdin stays the layer's lifeline. A kit ships the room as a package and needs none
of this.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from importlib import resources

#: The modules the layer runs (its room, without this host-side file).
MODULES = ("netlink", "nftables", "routes", "names", "relay", "listener", "layer")
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
"""
_LAYER = """\
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
if command -v python3 >/dev/null 2>&1; then PY=python3
else echo "{notool}"; exit {no_tool}
fi
exec "$PY" -I -S -c '{program}' {command}
"""


def check_proxy_path(path: str) -> str:
    if not _PATH.fullmatch(path) or "/../" in f"{path}/" or "//" in path:
        raise ValueError(f"the proxy socket {path!r} is not an absolute path of [A-Za-z0-9._/-]")
    return path


def bootstrap(modules: Sequence[str], run: str) -> str:
    """Python source that makes ``modules`` of this room importable from memory, then runs
    ``run`` (a program's own text, which may import them)."""
    room = resources.files("bottlenet.transparent")
    sources = {f"bottlenet.transparent.{m}": room.joinpath(f"{m}.py").read_text() for m in modules}
    return _BOOT.format(sources=sources) + run


def program() -> str:
    """The bootstrap with the layer's sources in it."""
    return bootstrap(MODULES, _LAYER)


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
        no_tool=EXIT_NO_TOOL,
        notool=NO_TOOL,
        program=text,
    ).encode()


#: The guest command: the script comes on stdin.
ARGV = ("/bin/sh", "-s")
