"""The rules of bottle-spec values that both sides apply: the daemon, when it reads a spec or
a command, and a launcher, when it builds one (:mod:`bottlenet.control.specbuilder`).

A leaf of the bottles wing: pure functions of their arguments (no filesystem, no VM, no
reactor; its only bottlenet imports are the errors and the data plane's pure name rules in
``forward.spec``), so a launcher on another host checks exactly what the daemon will check.
What only the daemon's host can decide (does a volume's host directory exist, is an image local
to smolvm) stays in :mod:`bottlenet.bottles.spec`.
"""

from __future__ import annotations

import os
import re
import string

from bottlenet.errors import InvalidArgument, safe_repr
from bottlenet.forward.spec import check_label as check_label

MODES = ("auto", "alias", "socket", "none")
#: ``sidecar.listen``: services on guest UNIX sockets (the default) or raw host TCP ports.
LISTEN_UNIX = "unix"
LISTEN_TCP = "tcp"
#: ``agent.user``: a user name of the image or ``uid[:gid]`` (smolvm's ``exec -u``).
USER_RE = re.compile(r"([a-z_][a-z0-9_-]{0,31}|[0-9]{1,10})(:[0-9]{1,10})?")
MAX_ALLOW_HOSTS = 256
MAX_SERVICES = 16
MAX_ENV = 128
MAX_STRING = 4096
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_HOST_LABEL_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
TEMPLATE_FIELDS = frozenset({"host", "port", "socket", "service"})
#: (low, high, default) of the VM sizes a spec may ask for.
SIDECAR_CPUS = (1, 16, 1)
SIDECAR_MEM = (64, 1 << 20, 512)
AGENT_CPUS = (1, 16, 2)
AGENT_MEM = (64, 1 << 20, 2048)


def check_egress_host(host: object) -> str:
    """Validate one allow-list entry: a lowercase DNS name, optionally ``*.``-prefixed.

    Unicode names are accepted in lowercase and stored in their IDNA (punycode) form, so the
    sidecar's proxy compares like with like. IP literals are refused: egress is by name.
    """
    if not isinstance(host, str) or not host or len(host) > 253:
        raise InvalidArgument(f"allow-host {safe_repr(host)} is not a host name")
    wildcard = host.startswith("*.")
    body = host[2:] if wildcard else host
    if body != body.lower():
        raise InvalidArgument(f"allow-host {safe_repr(host)} must be lowercase")
    try:
        ascii_body = body.encode("idna").decode("ascii")
    except UnicodeError:
        raise InvalidArgument(f"allow-host {safe_repr(host)} is not a valid IDNA name") from None
    labels = ascii_body.split(".")
    if len(labels) < 2 or not all(_HOST_LABEL_RE.fullmatch(label) for label in labels):
        raise InvalidArgument(f"allow-host {safe_repr(host)} is not a valid host name")
    if labels[-1].isdigit():
        raise InvalidArgument(f"allow-host {safe_repr(host)}: IP literals are not host names")
    return ("*." if wildcard else "") + ascii_body


def check_allow_hosts(hosts: object) -> tuple[str, ...]:
    """Validate a whole allow-list (at most 256 names, duplicates removed, order kept)."""
    if not isinstance(hosts, list | tuple):
        raise InvalidArgument("allow_hosts must be a list of host names")
    if len(hosts) > MAX_ALLOW_HOSTS:
        raise InvalidArgument(f"allow_hosts has more than {MAX_ALLOW_HOSTS} entries")
    return tuple(dict.fromkeys(check_egress_host(h) for h in hosts))


def check_env(entries: tuple[str, ...], where: str, *, templates: bool) -> tuple[str, ...]:
    for i, entry in enumerate(entries):
        key, sep, value = entry.partition("=")
        if not sep or not ENV_KEY_RE.fullmatch(key):
            raise InvalidArgument(f"{where}[{i}]: must be KEY=VALUE with KEY a variable name")
        if any(ord(c) < 32 and c != "\t" for c in value):
            raise InvalidArgument(f"{where}[{i}]: value must not contain control characters")
        if templates:
            try:
                fields = {f for _, f, _, _ in string.Formatter().parse(value) if f is not None}
            except ValueError:
                raise InvalidArgument(f"{where}[{i}]: unbalanced braces in template") from None
            unknown = fields - TEMPLATE_FIELDS
            if unknown:
                raise InvalidArgument(
                    f"{where}[{i}]: unknown placeholder; use {{host}}, {{port}}, {{socket}} "
                    "or {service}"
                )
    return entries


def check_env_entries(entries: tuple[str, ...], where: str) -> tuple[str, ...]:
    """``KEY=VALUE`` entries without templates (an exec's ``-e``), as the spec's ``env``."""
    return check_env(entries, where, templates=False)


def check_abs_path(path: str, where: str) -> str:
    if not path.startswith("/") or os.path.normpath(path) != path:
        raise InvalidArgument(f"{where}: must be an absolute, normalised path")
    return path


def split_volume(spec: str, where: str) -> tuple[str, str]:
    """``HOST:GUEST[:ro|:rw]``: both paths absolute and normalised (existence is the daemon's
    host's question)."""
    parts = spec.rsplit(":", 2)
    if len(parts) == 3 and parts[2] in ("ro", "rw"):
        host, guest = parts[0], parts[1]
    else:
        host, _, guest = spec.rpartition(":")
    if not host or not guest:
        raise InvalidArgument(f"{where}: must be HOST:GUEST[:ro|:rw]")
    return check_abs_path(host, where), check_abs_path(guest, where)
