"""The exact POSIX sh scripts the daemon feeds an agent VM: the bridge, and its reach check.

Where the daemon could build no kit (``bottlenet.kit``), both come on the guest's stdin
(``/bin/sh -s``), so nothing is written into the image and nothing of it runs but its
``/bin/sh`` and its ``python3``; the bridge's program carries the module it shares with the
egress layer (``bottlenet.transparent.relay``, by ``transparent.script.bootstrap``). With a
kit, its ``bridge`` takes :func:`bridge_args` and its ``reach`` reads :func:`reach_request`.
Every value in them is validated to a shell- and heredoc-safe alphabet first.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources

from attrs import frozen

from bottlenet.errors import InvalidArgument
from bottlenet.probe.plan import check_guest_path, check_port, safe_repr
from bottlenet.transparent.script import bootstrap

#: Exit codes of the bridge script (besides being killed).
EXIT_BIND = 3
EXIT_NO_TOOL = 4
#: The bridge's stdout lines.
READY = "BNB ready"
NO_TOOL = "BNB notool"
_HEREDOC = "BOTTLENET_BRIDGE_PY"
#: A UNIX socket path has at most 107 bytes.
MAX_PATH = 107
#: What the bridge imports of ``bottlenet.transparent`` (the lifeline and the pump it shares
#: with the egress layer): carried in its program.
MODULES = ("relay",)

_SH = """\
#!/bin/sh
# bottlenet's in-guest bridge ({what}): fed on stdin to /bin/sh -s in the agent VM.
{comment}
# Exit {no_tool}: no python3 (3.7 or later) in the guest.
if command -v python3 >/dev/null 2>&1; then PY=python3
else echo "{notool}"; exit {no_tool}
fi
{run}
"""
#: The bridge: its program is an argument, so its stdin stays the session's (its lifeline).
_RUN_ARG = """exec "$PY" -I -S -c '{program}'"""
#: A short check: its program comes in a here-document.
_RUN_HEREDOC = """exec "$PY" -I -S - <<'{heredoc}'
{program}
{heredoc}"""


@frozen
class Bridge:
    """One service's bridge: guest ``127.0.0.1:port`` relayed to the socket at ``path``."""

    port: int
    path: str

    @classmethod
    def parse(cls, text: str) -> Bridge:
        """``PORT=PATH`` (the form of ``BOTTLENET_BRIDGES``)."""
        port, sep, path = text.partition("=")
        if not sep or not port.isdigit() or len(port) > 5:
            raise InvalidArgument(f"bridge {safe_repr(text)} is not PORT=PATH")
        return cls.of(int(port), path)

    @classmethod
    def of(cls, port: int, path: str) -> Bridge:
        check_port(port)
        check_guest_path(path, "bridge socket")
        if len(path.encode()) > MAX_PATH:
            raise InvalidArgument(
                f"bridge socket {safe_repr(path)} is longer than {MAX_PATH} bytes"
            )
        return cls(port, path)

    def __str__(self) -> str:
        return f"{self.port}={self.path}"


def check_bridges(bridges: Sequence[Bridge]) -> tuple[Bridge, ...]:
    if not bridges:
        raise InvalidArgument("a bridge needs at least one PORT=PATH")
    ports = [b.port for b in bridges]
    if len(set(ports)) != len(ports):
        raise InvalidArgument("each bridge port may appear once")
    return tuple(Bridge.of(b.port, b.path) for b in bridges)


def _program(module: str, name: str, literal: object) -> str:
    source = resources.files("bottlenet.bridge").joinpath(module).read_text()
    marker = f"{name} = {'[]' if isinstance(literal, list) else '{}'}  # type: "
    start = source.index(marker)
    end = source.index("\n", start)
    program = source[:start] + f"{name} = {literal!r}" + source[end:]
    assert _HEREDOC not in program
    return program


def _render(what: str, comment: str, run: str) -> bytes:
    return _SH.format(
        what=what, comment=comment, no_tool=EXIT_NO_TOOL, notool=NO_TOOL, run=run
    ).encode()


def render(bridges: Sequence[Bridge]) -> bytes:
    """The bridge: runs in the foreground until killed, or until its stdin (a pipe or a
    socket: the daemon's session) ends."""
    bridges = check_bridges(bridges)
    literal = [[b.port, b.path] for b in bridges]
    comment = (
        f"# Relays 127.0.0.1:PORT to the UNIX socket PATH for {' '.join(map(str, bridges))}\n"
        "# and runs until killed, or until its stdin ends when that is a pipe or a socket.\n"
        f'# Prints "{READY} N" once listening; exit {EXIT_BIND}: a port could not be bound.'
    )
    program = bootstrap(MODULES, _program("guest.py", "BRIDGES", literal)).replace("'", "'\\''")
    run = _RUN_ARG.format(program=program)
    return _render("python -m bottlenet.bridge script", comment, run)


def reach_endpoint(port: int) -> str:
    """What the reach check names a port (the witness line's endpoint)."""
    return f"tcp:127.0.0.1:{port}"


def bridge_args(bridges: Sequence[Bridge]) -> list[str]:
    """The kit's ``bridge`` arguments: ``PORT=PATH`` each."""
    return [str(b) for b in check_bridges(bridges)]


def reach_check(nonce: str, ports: Sequence[int], timeout: float = 10.0) -> dict[str, object]:
    """The reach check's ``CHECK``: the nonce, each port with its endpoint, the budget."""
    if not nonce.isalnum() or not nonce.isascii():
        raise InvalidArgument("the nonce must be hex")
    return {
        "nonce": nonce,
        "ports": [[check_port(p), reach_endpoint(p)] for p in ports],
        "timeout": float(timeout),
    }


def reach_request(nonce: str, ports: Sequence[int], timeout: float = 10.0) -> bytes:
    """What the kit's ``reach`` reads on stdin."""
    return json.dumps(reach_check(nonce, ports, timeout)).encode()


def render_reach(nonce: str, ports: Sequence[int], timeout: float = 10.0) -> bytes:
    """The reach check: one witness line through each bridged port."""
    literal = reach_check(nonce, ports, timeout)
    comment = "# Sends one witness line through each bridged port; prints one BNB line per port."
    run = _RUN_HEREDOC.format(heredoc=_HEREDOC, program=_program("reach.py", "CHECK", literal))
    return _render("reach check", comment, run)


#: The guest command: the script comes on stdin.
ARGV = ("/bin/sh", "-s")
