"""Machine specs: validated values and the ``machine create`` argv built from them.

Every check runs before smolvm is called, so a bad value is refused with InvalidArgument and
nothing is spawned. Rules follow the real smolvm 1.32.2 CLI (checked by the contract tests,
``docs/smolvm.md``); some are stricter on purpose (no value may start with ``-`` so it can
never be read as a flag; host socket paths must be absolute and unique).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterable, Mapping, Sequence

from attrs import field, frozen

from vmctl.errors import DeviceBudgetExceeded, InvalidArgument, sanitize

#: Default virtio-mmio slots left for user devices on x86_64 libkrun builds (smolvm-cli.md 4.5).
DEFAULT_DEVICE_BUDGET = 4
MAX_MOUNT_SOCKETS = 64
#: Host sources smolvm 1.32.2 refuses for ``--volume`` (tried one by one): these trees, and
#: ``/`` and ``/var`` themselves (``/var/lib`` is allowed). Symlinks are resolved first.
PROTECTED_VOLUME_TREES = (
    "/etc", "/run", "/proc", "/sys", "/dev", "/boot", "/usr", "/bin", "/lib", "/lib64", "/sbin",
    "/var/log", "/var/run",
)  # fmt: skip
PROTECTED_VOLUME_EXACT = ("/", "/var")
# ASCII digits only: ``\d`` also matches other scripts' digits (Arabic-Indic, fullwidth).
_USER = re.compile(r"([a-z_][a-z0-9_-]{0,31}|[0-9]{1,10})(:[0-9]{1,10})?\Z")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}\Z")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_HOSTNAME = re.compile(
    r"(?=.{1,253}\Z)([A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
    r"(\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?\Z"
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_LOCAL_IMAGE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
NET_BACKENDS = ("tsi", "virtio-net")


def _bad(what: str, value: object, why: str) -> InvalidArgument:
    return InvalidArgument(f"invalid {what} {sanitize(repr(value), 80)}: {why}")


def validate_name(name: str) -> str:
    """smolvm's machine-name rules: 1-128 of [A-Za-z0-9_-], alphanumeric first, no '--',
    not ending in '-'. So a name can never start with '-' and be read as a flag."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad("machine name", name, "use 1-128 of [A-Za-z0-9_-], starting alphanumeric")
    if name.endswith("-") or "--" in name:
        raise _bad("machine name", name, "must not end with '-' or contain '--'")
    return name


def _port_number(text: str, what: str) -> int:
    if not text.isdigit() or not text.isascii() or len(text) > 5:
        raise _bad(what, text, "must be an integer 1-65535")
    n = int(text)
    if not 1 <= n <= 65535:
        raise _bad(what, text, "must be an integer 1-65535")
    return n


@frozen
class PortMapping:
    """``-p HOST:GUEST``: published on host loopback only (no address form exists)."""

    host: int
    guest: int

    def __attrs_post_init__(self) -> None:
        for v in (self.host, self.guest):
            if type(v) is not int or not 1 <= v <= 65535:
                raise _bad("port", v, "must be an integer 1-65535")

    @classmethod
    def parse(cls, spec: str) -> PortMapping:
        host, sep, guest = spec.partition(":")
        if not sep or ":" in guest:
            raise _bad("port spec", spec, "use HOST:GUEST (no address, no protocol)")
        return cls(_port_number(host, "host port"), _port_number(guest, "guest port"))

    def arg(self) -> str:
        return f"{self.host}:{self.guest}"


def _check_path(value: str, what: str) -> None:
    if not isinstance(value, str) or not value or not os.path.isabs(value):
        raise _bad(what, value, "must be an absolute path")
    if ":" in value or _CONTROL.search(value):
        raise _bad(what, value, "must not contain ':' or control characters")


@frozen
class Volume:
    """``-v HOST:GUEST[:ro]``: a virtiofs share of an existing host directory."""

    host: str
    guest: str
    read_only: bool = False

    def __attrs_post_init__(self) -> None:
        _check_path(self.host, "volume host path")
        _check_path(self.guest, "volume guest path")

    @classmethod
    def parse(cls, spec: str) -> Volume:
        parts = spec.split(":")
        ro = False
        if len(parts) == 3:
            if parts[2] not in ("ro", "rw"):
                raise _bad("volume spec", spec, "mode must be ro or rw")
            ro = parts[2] == "ro"
        elif len(parts) != 2:
            raise _bad("volume spec", spec, "use HOST:GUEST[:ro|:rw]")
        return cls(parts[0], parts[1], ro)

    def check_host(self) -> None:
        """The host side must exist and be a directory (virtiofs cannot share a file)."""
        if not os.path.isdir(self.host):
            raise _bad("volume host path", self.host, "is not an existing directory")

    def arg(self) -> str:
        return f"{self.host}:{self.guest}" + (":ro" if self.read_only else "")


def _check_socket_paths(flag: str, host: str, guest: str) -> None:
    """Both ends absolute, and no ``;``/``|`` in the guest path (smolvm's separators)."""
    _check_path(host, f"{flag} host path")
    _check_path(guest, f"{flag} guest path")
    if any(c in guest for c in ";|"):
        raise _bad(f"{flag} guest path", guest, "must not contain ';' or '|'")


@frozen
class MountSocket:
    """``--mount-socket HOST:GUEST``: a host UNIX socket made visible in the guest."""

    host: str
    guest: str

    def __attrs_post_init__(self) -> None:
        _check_socket_paths("mount-socket", self.host, self.guest)

    @classmethod
    def parse(cls, spec: str) -> MountSocket:
        host, sep, guest = spec.partition(":")
        if not sep:
            raise _bad("mount-socket spec", spec, "use HOST:GUEST")
        return cls(host, guest)

    def arg(self) -> str:
        return f"{self.host}:{self.guest}"


def is_protected_source(path: str) -> bool:
    """A ``--volume`` host path smolvm refuses as a protected system path."""
    real = os.path.realpath(path)
    if real in PROTECTED_VOLUME_EXACT:
        return True
    return any(real == p or real.startswith(p + "/") for p in PROTECTED_VOLUME_TREES)


@frozen
class ExposeSocket:
    """``--expose-socket GUEST:HOST``: a UNIX socket a guest process listens on, reachable on
    the host at HOST (a path vmctl chooses, in a directory only the daemon can enter)."""

    guest: str
    host: str

    def __attrs_post_init__(self) -> None:
        _check_socket_paths("expose-socket", self.host, self.guest)

    def arg(self) -> str:
        return f"{self.guest}:{self.host}"


def check_user(user: str) -> str:
    """``-u/--user``: a user name or ``uid[:gid]`` (the image resolves names)."""
    if not isinstance(user, str) or not _USER.match(user):
        raise _bad("user", user, "must be a user name or uid[:gid]")
    return user


def _check_label(key: str, value: str) -> None:
    if not isinstance(key, str) or not isinstance(value, str):
        raise _bad("label", key, "key and value must be strings")
    if not key or len(key) > 128 or "=" in key or key.startswith("-") or key != key.strip():
        raise _bad("label key", key, "1-128 chars, no '=', no leading '-' or blanks")
    if _CONTROL.search(key) or " " in key:
        raise _bad("label key", key, "no spaces or control characters")
    if len(value) > 1024 or _CONTROL.search(value):
        raise _bad("label value", value, "at most 1024 chars, no control characters")


def _check_env(key: str, value: str) -> None:
    if not isinstance(key, str) or not _ENV_KEY.match(key):
        raise _bad("environment key", key, "must be an identifier [A-Za-z_][A-Za-z0-9_]*")
    if not isinstance(value, str) or "\0" in value:
        raise _bad("environment value", key, "must be a string without NUL")


def parse_pair(spec: str, what: str) -> tuple[str, str]:
    """Split ``K=V`` on the first '='; a missing '=' is refused (smolvm would copy or drop)."""
    key, sep, value = spec.partition("=")
    if not sep:
        raise _bad(what, spec, "use KEY=VALUE")
    return key, value


def _pairs(value: Mapping[str, str] | Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    if isinstance(value, Mapping):
        return tuple((k, v) for k, v in value.items())
    return tuple((k, v) for k, v in value)


def _check_cidr(value: str) -> None:
    try:
        if "/" in value:
            ipaddress.ip_network(value, strict=False)
        else:
            ipaddress.ip_address(value)
    except ValueError:
        raise _bad("allow-cidr", value, "must be an IP address or CIDR") from None


def _check_host(value: str) -> None:
    try:
        ipaddress.ip_address(value)
        return
    except ValueError:
        pass
    if not isinstance(value, str) or not _HOSTNAME.match(value) or value.startswith("-"):
        raise _bad("allow-host", value, "must be a hostname or an IP literal (no port)")


def is_local_image(image: str) -> bool:
    """smolvm's rule for a local image: a path, ``-`` (a tar on stdin) or a ``docker save``
    archive (packed layers)."""
    return (
        image.startswith(("/", "./", "../"))
        or image == "-"
        or image.endswith(_LOCAL_IMAGE_SUFFIXES)
    )


@frozen
class MachineSpec:
    """Everything ``machine create`` is told. Values are checked by :func:`validate_spec`."""

    name: str
    image: str | None = None
    from_file: str | None = None
    labels: tuple[tuple[str, str], ...] = field(default=(), converter=_pairs)
    cpus: int | None = None
    mem: int | None = None
    volumes: tuple[Volume, ...] = field(default=(), converter=tuple)
    ports: tuple[PortMapping, ...] = field(default=(), converter=tuple)
    env: tuple[tuple[str, str], ...] = field(default=(), converter=_pairs)
    workdir: str | None = None
    net: bool = False
    net_backend: str | None = None
    allow_cidrs: tuple[str, ...] = field(default=(), converter=tuple)
    allow_hosts: tuple[str, ...] = field(default=(), converter=tuple)
    outbound_localhost_only: bool = False
    mount_sockets: tuple[MountSocket, ...] = field(default=(), converter=tuple)
    expose_sockets: tuple[ExposeSocket, ...] = field(default=(), converter=tuple)
    block_private: bool = False
    user: str | None = None
    workload: tuple[str, ...] = field(default=(), converter=tuple)

    @property
    def has_egress_policy(self) -> bool:
        return bool(
            self.allow_cidrs
            or self.allow_hosts
            or self.outbound_localhost_only
            or self.block_private
        )

    @property
    def needs_nic(self) -> bool:
        """Ports, an egress policy or an explicit virtio-net backend mean one virtio-net NIC."""
        return bool(self.ports) or self.has_egress_policy or self.net_backend == "virtio-net"

    @property
    def packed_image(self) -> bool:
        return self.from_file is not None or (self.image is not None and is_local_image(self.image))


#: What a counted device is for (:func:`devices`).
VOLUME, NIC, PACKED = "volume", "nic", "image"


def devices(spec: MachineSpec) -> list[tuple[str, str]]:
    """The virtio-mmio devices the user side of ``spec`` needs (smolvm-cli.md 4.5), each as
    (what it is for, a detail): one per volume (virtiofs; its guest path), one NIC if any
    port or egress policy, one for a local or packed image. Mount-sockets are not counted:
    smolvm-cli.md does not list them as devices (they are assumed to ride on the fixed vsock
    device); see docs/smolvm.md."""
    out = [(VOLUME, v.guest) for v in spec.volumes]
    out += [(NIC, "ports/egress")] if spec.needs_nic else []
    out += [(PACKED, "local/packed image")] if spec.packed_image else []
    return out


def _unique(values: Sequence[object], what: str) -> None:
    if len(set(values)) != len(values):
        raise InvalidArgument(f"invalid {what} is repeated")


def validate_spec(
    spec: MachineSpec, device_budget: int = DEFAULT_DEVICE_BUDGET, check_paths: bool = True
) -> MachineSpec:
    """Refuse anything smolvm would reject, or that vmctl refuses on principle.

    ``check_paths`` also checks that every volume's host side is an existing directory.
    """
    validate_name(spec.name)
    if spec.image is not None and spec.from_file is not None:
        raise _bad("image", spec.image, "--image and --from are mutually exclusive")
    if spec.image is not None:
        if not spec.image or spec.image.startswith("-") or _CONTROL.search(spec.image):
            raise _bad("image", spec.image, "must be non-empty and not start with '-'")
    if spec.from_file is not None:
        _check_path(spec.from_file, "--from file")
    for k, v in spec.labels:
        _check_label(k, v)
    if len({k for k, _ in spec.labels}) != len(spec.labels):
        raise InvalidArgument("invalid labels: a key is repeated")
    if spec.cpus is not None and (type(spec.cpus) is not int or not 1 <= spec.cpus <= 16):
        raise _bad("cpus", spec.cpus, "must be an integer 1-16")
    if spec.mem is not None and (type(spec.mem) is not int or not 64 <= spec.mem <= 2**32 - 1):
        raise _bad("mem", spec.mem, "must be an integer number of MiB, at least 64")
    for vol in spec.volumes:
        if not isinstance(vol, Volume):
            raise _bad("volume", vol, "must be a Volume")
        if is_protected_source(vol.host):
            raise _bad("volume host path", vol.host, "smolvm refuses protected system paths")
        if check_paths:
            vol.check_host()
    _unique([v.guest for v in spec.volumes], "volumes: a guest path")
    for p in spec.ports:
        if not isinstance(p, PortMapping):
            raise _bad("port", p, "must be a PortMapping")
    _unique([p.host for p in spec.ports], "ports: a host port")
    for k, v in spec.env:
        _check_env(k, v)
    if spec.workdir is not None:
        _check_path(spec.workdir, "workdir")
    if spec.net_backend is not None and spec.net_backend not in NET_BACKENDS:
        raise _bad("net backend", spec.net_backend, "must be tsi or virtio-net")
    for c in spec.allow_cidrs:
        _check_cidr(c)
    for h in spec.allow_hosts:
        _check_host(h)
    for sockets, kind in ((spec.mount_sockets, MountSocket), (spec.expose_sockets, ExposeSocket)):
        flag = "mount-sockets" if kind is MountSocket else "expose-sockets"
        for one in sockets:
            if not isinstance(one, kind):
                raise _bad(flag, one, f"must be a {kind.__name__}")
        if len(sockets) > MAX_MOUNT_SOCKETS:
            raise InvalidArgument(f"invalid {flag}: at most {MAX_MOUNT_SOCKETS}")
        _unique([m.guest for m in sockets], f"{flag}: a guest path")
    _unique([e.host for e in spec.expose_sockets], "expose-sockets: a host path")
    if spec.user is not None:
        check_user(spec.user)
    if spec.net_backend == "tsi" and (spec.ports or spec.has_egress_policy):
        raise InvalidArgument(
            "invalid net backend 'tsi': published ports and egress policies need virtio-net"
        )
    if spec.net_backend == "virtio-net" and not (spec.net or spec.ports or spec.has_egress_policy):
        raise InvalidArgument("invalid net backend 'virtio-net': it needs --net")
    for word in spec.workload:
        if not isinstance(word, str) or "\0" in word:
            raise _bad("workload word", word, "must be a string without NUL")
    used = devices(spec)
    if len(used) > device_budget:
        vols = [d for k, d in used if k == VOLUME]
        raise DeviceBudgetExceeded(
            f"machine {spec.name!r} needs {len(used)} virtio devices "
            f"({len(vols)} volume(s){': ' + ', '.join(vols) if vols else ''}; "
            f"{int(spec.needs_nic)} NIC for ports/egress; "
            f"{int(spec.packed_image)} for a local/packed image) but the budget is "
            f"{device_budget}; smolvm would fail at start with krun_start_enter -22"
        )
    return spec


def create_args(spec: MachineSpec) -> list[str]:
    """The arguments after ``smolvm`` for ``machine create`` (long option forms only)."""
    args = ["machine", "create", "--name", spec.name]
    for k, v in spec.labels:
        args += ["--label", f"{k}={v}"]
    if spec.image is not None:
        args += ["--image", spec.image]
    if spec.from_file is not None:
        args += ["--from", spec.from_file]
    if spec.cpus is not None:
        args += ["--cpus", str(spec.cpus)]
    if spec.mem is not None:
        args += ["--mem", str(spec.mem)]
    for vol in spec.volumes:
        args += ["--volume", vol.arg()]
    for p in spec.ports:
        args += ["--port", p.arg()]
    for k, v in spec.env:
        args += ["--env", f"{k}={v}"]
    if spec.workdir is not None:
        args += ["--workdir", spec.workdir]
    if spec.net:
        args.append("--net")
    if spec.net_backend is not None:
        args += ["--net-backend", spec.net_backend]
    for c in spec.allow_cidrs:
        args += ["--allow-cidr", c]
    for h in spec.allow_hosts:
        args += ["--allow-host", h]
    if spec.outbound_localhost_only:
        args.append("--outbound-localhost-only")
    if spec.block_private:
        args.append("--block-private")
    for ms in spec.mount_sockets:
        args += ["--mount-socket", ms.arg()]
    for es in spec.expose_sockets:
        args += ["--expose-socket", es.arg()]
    if spec.user is not None:
        args += ["--user", spec.user]
    if spec.workload:
        args.append("--")
        args += list(spec.workload)
    return args


def exec_args(
    name: str,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    interactive: bool = False,
    detach: bool = False,
    user: str | None = None,
    guest_timeout: int | None = None,
    *,
    tty: bool = False,
) -> list[str]:
    """The arguments after ``smolvm`` for ``machine exec`` (``--name`` is long-only there).

    ``detach`` (``-d``) starts the command and returns its guest pid; it excludes ``-i`` and
    ``-t``. ``tty`` (``-t``) gives the command a guest terminal; smolvm sizes it from its own
    stdin's terminal and follows SIGWINCH. ``user`` is ``-u/--user`` (smolvm >= 1.32: a user
    name or ``uid[:gid]``), ``guest_timeout`` is smolvm's own ``--timeout`` in whole seconds
    (the guest command is killed, exit 124).
    """
    if detach and (interactive or tty):
        raise InvalidArgument("exec -d cannot feed stdin (-i) or a terminal (-t)")
    validate_name(name)
    if not argv:
        raise InvalidArgument("exec needs a command")
    for word in argv:
        if not isinstance(word, str) or "\0" in word:
            raise _bad("command word", word, "must be a string without NUL")
    args = ["machine", "exec", "--name", name]
    for k, v in (env or {}).items():
        _check_env(k, v)
        args += ["-e", f"{k}={v}"]
    if workdir is not None:
        _check_path(workdir, "workdir")
        args += ["-w", workdir]
    if user is not None:
        args += ["--user", check_user(user)]
    if guest_timeout is not None:
        if detach:
            raise InvalidArgument("exec -d cannot have a --timeout (it would kill the command)")
        if type(guest_timeout) is not int or guest_timeout < 1:
            raise _bad("exec timeout", guest_timeout, "must be a whole number of seconds >= 1")
        args += ["--timeout", f"{guest_timeout}s"]
    if interactive:
        args.append("-i")
    if tty:
        args.append("-t")
    if detach:
        args.append("-d")
    return [*args, "--", *argv]
