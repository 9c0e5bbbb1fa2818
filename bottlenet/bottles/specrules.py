"""The rules of bottle-spec values that both sides apply: the daemon, when it reads a spec or
a command, and a launcher, when it builds one (:mod:`bottlenet.control.specbuilder`).

A leaf of the bottles wing: pure functions of their arguments (no filesystem, no VM, no
reactor; its only bottlenet imports are the errors, ``paths.MAX_SUN_PATH`` and the data
plane's pure name rules in ``forward.spec``), so a launcher on another host checks exactly what
the daemon will check: names, sizes, env entries, bounded templates, egress host names (IDNA
2008), volume syntax. What only the daemon's host can decide (does a volume's host directory
exist, does it overlap the daemon's own directories, is an image local to smolvm) stays in
:mod:`bottlenet.bottles.spec`.
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Iterable, Mapping
from enum import StrEnum

import idna

from bottlenet.errors import InvalidArgument, safe_repr
from bottlenet.forward.spec import check_label as check_label
from bottlenet.paths import MAX_SUN_PATH

MODES = ("auto", "alias", "socket", "none")


class ListenKind(StrEnum):
    """``sidecar.listen``: services on guest UNIX sockets (the default) or raw host TCP ports."""

    UNIX = "unix"
    TCP = "tcp"


LISTEN_UNIX = ListenKind.UNIX
LISTEN_TCP = ListenKind.TCP
#: ``agent.user``: a user name of the image or ``uid[:gid]`` (smolvm's ``exec -u``).
USER_RE = re.compile(r"([a-z_][a-z0-9_-]{0,31}|[0-9]{1,10})(:[0-9]{1,10})?")
MAX_ALLOW_HOSTS = 256
MAX_SERVICES = 16
MAX_ENV = 128
MAX_STRING = 4096
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_HOST_LABEL_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
#: Each placeholder's longest value: an IPv4 literal, a port, a socket path, a service name.
TEMPLATE_FIELDS = {"host": 15, "port": 5, "socket": MAX_SUN_PATH, "service": 32}
#: Longest value a template may stamp, and the most all stamped env entries may add up to
#: (well under the kernel's 128 KiB per argv string and its total argv limit).
MAX_STAMPED = MAX_STRING
MAX_STAMPED_TOTAL = 256 * 1024
#: (low, high, default) of the VM sizes a spec may ask for.
SIDECAR_CPUS = (1, 16, 1)
SIDECAR_MEM = (64, 1 << 20, 512)
AGENT_CPUS = (1, 16, 2)
AGENT_MEM = (64, 1 << 20, 2048)


def check_egress_host(host: object) -> str:
    """Validate one allow-list entry: a lowercase DNS name, optionally ``*.``-prefixed.

    Names follow IDNA 2008 with UTS 46 (the ``idna`` package, not Python's IDNA 2003 codec):
    ``faß.de`` stays its own domain (``xn--fa-hia.de``), never ``fass.de``. A name must
    already be in its UTS 46 mapped form (no fullwidth letters, no ``。``), so what an
    operator wrote is the domain that is allowed; invalid punycode (``xn--zz``) is refused.
    Unicode names are stored as A-labels, so the sidecar's proxy compares like with like.
    IP literals are refused: egress is by name.
    """
    if not isinstance(host, str) or not host or len(host) > 253:
        raise InvalidArgument(f"allow-host {safe_repr(host)} is not a host name")
    wildcard = host.startswith("*.")
    body = host[2:] if wildcard else host
    if body != body.lower():
        raise InvalidArgument(f"allow-host {safe_repr(host)} must be lowercase")
    try:
        mapped = idna.uts46_remap(body, std3_rules=True, transitional=False)
        if mapped != body:
            raise InvalidArgument(
                f"allow-host {safe_repr(host)} is not in its UTS 46 form: write it as "
                f"{safe_repr(mapped)}"
            )
        ascii_body = idna.encode(body).decode("ascii")
    except (idna.IDNAError, UnicodeError):
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
            parse_template(value, f"{where}[{i}]")
    return entries


def parse_template(value: str, where: str) -> list[tuple[str, str | None]]:
    """A template as (literal, field) pieces: bare ``{name}`` placeholders only.

    No format spec (``{host:>100000000}`` would allocate 100 MB in the daemon), no
    conversion, no attribute or index; the longest value it can stamp must fit MAX_STAMPED.
    """
    try:
        parsed = list(string.Formatter().parse(value))
    except ValueError:
        raise InvalidArgument(f"{where}: unbalanced braces in template") from None
    pieces: list[tuple[str, str | None]] = []
    longest = 0
    for literal, name, format_spec, conversion in parsed:
        if name is not None and (
            name not in TEMPLATE_FIELDS or format_spec or conversion is not None
        ):
            raise InvalidArgument(
                f"{where}: placeholders are {{host}}, {{port}}, {{socket}} or {{service}}, "
                "with no format spec or conversion"
            )
        longest += len(literal) + (TEMPLATE_FIELDS[name] if name is not None else 0)
        pieces.append((literal, name))
    if longest > MAX_STAMPED:
        raise InvalidArgument(f"{where}: the stamped value could exceed {MAX_STAMPED} characters")
    return pieces


def stamped_length(value: str) -> int:
    """The longest value a checked template can stamp."""
    return sum(
        len(literal) + (TEMPLATE_FIELDS[name] if name is not None else 0)
        for literal, name in parse_template(value, "template")
    )


def check_stamped_total(entries: Iterable[str]) -> None:
    """All the services' env templates together stamp at most MAX_STAMPED_TOTAL bytes."""
    total = sum(stamped_length(entry.partition("=")[2]) for entry in entries)
    if total > MAX_STAMPED_TOTAL:
        raise InvalidArgument(
            f"sidecar.service: the env templates could stamp more than {MAX_STAMPED_TOTAL} bytes"
        )


def stamp_template(value: str, fields: Mapping[str, str]) -> str:
    """Fill a template checked by :func:`parse_template` (plain substitution, no format())."""
    return "".join(
        literal + (fields[name] if name is not None else "")
        for literal, name in parse_template(value, "template")
    )


def check_env_entries(entries: tuple[str, ...], where: str) -> tuple[str, ...]:
    """``KEY=VALUE`` entries without templates (an exec's ``-e``), as the spec's ``env``."""
    return check_env(entries, where, templates=False)


def check_abs_path(path: str, where: str) -> str:
    if not path.startswith("/") or os.path.normpath(path) != path:
        raise InvalidArgument(f"{where}: must be an absolute, normalised path")
    return path


def split_volume(spec: str, where: str) -> tuple[str, str, str]:
    """``HOST:GUEST[:ro|:rw]`` as (host, guest, access), read-only unless ``:rw`` is written;
    both paths absolute and normalised (existence is the daemon's host's question)."""
    parts = spec.rsplit(":", 2)
    if len(parts) == 3 and parts[2] in ("ro", "rw"):
        host, guest, access = parts[0], parts[1], parts[2]
    else:
        host, _, guest = spec.rpartition(":")
        access = "ro"
    if not host or not guest:
        raise InvalidArgument(f"{where}: must be HOST:GUEST[:ro|:rw]")
    return check_abs_path(host, where), check_abs_path(guest, where), access
