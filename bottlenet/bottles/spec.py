"""Bottle specs: what a launcher asks for, validated field by field before anything is made.

A spec arrives as a TOML file (``bottlenetctl bottle create NAME --spec FILE``) or as the
equivalent JSON over the control socket. Every field is checked here and every problem is an
InvalidArgument naming the field, so no half-valid spec ever reaches smolvm.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from attrs import field, frozen

from bottlenet.bottles.specrules import (
    AGENT_CPUS,
    AGENT_MEM,
    LISTEN_TCP,
    LISTEN_UNIX,
    MAX_ENV,
    MAX_SERVICES,
    MAX_STRING,
    MODES,
    SIDECAR_CPUS,
    SIDECAR_MEM,
    USER_RE,
    ListenKind,
    check_abs_path,
    check_allow_hosts,
    check_egress_host,
    check_env,
    check_env_entries,
    check_stamped_total,
    split_volume,
    stamp_template,
)
from bottlenet.errors import InvalidArgument, safe_repr
from bottlenet.fields import Fields, shown_key
from bottlenet.forward.spec import LABEL_RE, check_bottle_name
from vmctl.spec import is_local_image as vmctl_is_local_image

PACKED_SUFFIX = ".smolmachine"


def is_local_image(image: str) -> bool:
    """Local by smolvm's rule (see ``vmctl.spec.is_local_image``), or a packed machine."""
    return vmctl_is_local_image(image) or image.endswith(PACKED_SUFFIX)


def image_fields(image: str) -> dict[str, str]:
    """The MachineSpec fields for ``image``: a packed machine goes to ``--from``."""
    return {"from_file": image} if image.endswith(PACKED_SUFFIX) else {"image": image}


@frozen
class ServiceSpec:
    """One sidecar service the agent may reach, and how its endpoint is stamped into env."""

    name: str
    guest_port: int
    env: tuple[str, ...] = ()


@frozen
class EgressSpec:
    allow_hosts: tuple[str, ...]
    policy_path: str
    reload: tuple[str, ...]
    #: The sidecar service whose agent endpoint is an HTTP CONNECT proxy enforcing
    #: ``allow_hosts`` (the launch gate then checks it answers and refuses accordingly).
    connect_proxy: str | None = None


#: How sidecar services reach bottlenet: ``unix`` (default) guest UNIX sockets exposed with
#: ``--expose-socket`` into the bottle's 0700 directory; ``tcp`` (opt-in, for a sidecar image
#: that can only serve TCP) raw published ports on host 127.0.0.1, which any local user can
#: connect to.


@frozen
class SidecarSpec:
    image: str
    cpus: int
    mem: int
    services: tuple[ServiceSpec, ...]
    egress: EgressSpec | None
    listen: ListenKind = LISTEN_UNIX


class BridgeMode(StrEnum):
    """Who bridges the guest's ``127.0.0.1:<port>`` to the mounted sockets."""

    BOTTLENET = "bottlenet"  # bottlenet's own bridge (docs/sidecar.md)
    NONE = "none"  # the image brings its own (BOTTLENET_BRIDGES)


@frozen
class AgentSpec:
    image: str
    cpus: int
    mem: int
    env: tuple[str, ...] = ()
    workload: tuple[str, ...] = ()
    volumes: tuple[str, ...] = ()
    #: Who the workload runs as (``exec -u``): a user name of the image or ``uid[:gid]``.
    user: str | None = None
    #: Whether bottlenet runs its own in-guest bridge (``none``: the image brings one).
    bridge: BridgeMode = BridgeMode.BOTTLENET
    #: The sidecar service (an HTTP CONNECT proxy) every TCP connect of the agent goes to,
    #: through bottlenet's transparent egress layer (None: no layer).
    transparent_egress: str | None = None


@frozen
class BottleSpec:
    """A validated spec; ``doc`` is the document it was read from (kept in the state file)."""

    name: str
    mode: str  # auto | alias | socket | none
    sidecar: SidecarSpec | None
    agent: AgentSpec | None
    doc: dict[str, Any] = field(factory=dict, eq=False, repr=False)

    @property
    def has_vms(self) -> bool:
        return self.mode != "none"


def _fields(table: object, where: str, allowed: set[str]) -> Fields:
    return Fields(table, where, allowed=allowed, error=InvalidArgument)


def _string(f: Fields, key: str, *, required: bool = True, default: str | None = None) -> str:
    """A non-empty string of at most MAX_STRING characters, without control characters."""
    value = f.get(key, default, required=required)
    if not isinstance(value, str) or not value or len(value) > MAX_STRING:
        raise f.fail(key, "must be a non-empty string")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise f.fail(key, "must not contain control characters")
    return value


def _strings(f: Fields, key: str, *, limit: int = MAX_ENV) -> tuple[str, ...]:
    """A list of at most ``limit`` strings without NUL (empty when missing)."""
    value = f.get(key, [])
    if not isinstance(value, list) or len(value) > limit:
        raise f.fail(key, f"must be a list of at most {limit} strings")
    for i, item in enumerate(value):
        if not isinstance(item, str) or len(item) > MAX_STRING or "\x00" in item:
            raise f.fail(f"{key}[{i}]", "must be a string without NUL")
    return tuple(value)


def _check_volume(spec: str, where: str) -> str:
    """``HOST:GUEST[:ro|:rw]``, read-only unless ``:rw`` is written. The host directory is the
    create's to resolve and check, once, for whoever asks (``volumes.py``): not here, by a
    path, and not again when a kept bottle's spec is read back."""
    host, guest, access = split_volume(spec, where)
    return f"{host}:{guest}:{access}"


def check_local_images(spec: BottleSpec) -> None:
    """Refuse a local image (archive, directory, ``.smolmachine`` pack) that is not there.

    Checked when a bottle is created, before any machine exists: smolvm would only say so at
    ``machine create``, after the sidecar VM had been created and started. Not at parse time,
    so that a persisted bottle whose image was removed since is still restored. Relative paths
    are the daemon's, as smolvm (spawned in the daemon's cwd) would read them.
    """
    for where, part in (("sidecar.image", spec.sidecar), ("agent.image", spec.agent)):
        if part is None or part.image == "-" or not is_local_image(part.image):
            continue
        if not os.path.exists(part.image):
            raise InvalidArgument(f"{where}: local image {safe_repr(part.image)} does not exist")


def _service(raw: object, where: str) -> ServiceSpec:
    f = _fields(raw, where, {"name", "guest_port", "env"})
    name = _string(f, "name")
    if not LABEL_RE.fullmatch(name):
        raise InvalidArgument(f"{f.path('name')}: must match [a-z0-9][a-z0-9_-]{{0,31}}")
    port = f.integer("guest_port", 1, 65535)
    env = check_env(_strings(f, "env"), f.path("env"), templates=True)
    return ServiceSpec(name, port, env)


def _egress(raw: object, where: str) -> EgressSpec:
    f = _fields(raw, where, {"allow_hosts", "policy_path", "reload", "connect_proxy"})
    try:
        hosts = check_allow_hosts(f.get("allow_hosts", []))
    except InvalidArgument as e:
        raise InvalidArgument(f"{f.path('allow_hosts')}: {e.message}") from None
    policy_path = check_abs_path(_string(f, "policy_path"), f.path("policy_path"))
    reload = _strings(f, "reload", limit=64)
    if not reload or not reload[0].startswith("/"):
        raise InvalidArgument(f"{f.path('reload')}: must be an argv whose first item is absolute")
    proxy = _string(f, "connect_proxy") if "connect_proxy" in f.table else None
    return EgressSpec(hosts, policy_path, reload, proxy)


def _sidecar(raw: object) -> SidecarSpec:
    f = _fields(raw, "sidecar", {"image", "cpus", "mem", "service", "egress", "listen"})
    image = _string(f, "image")
    listen = f.get("listen", LISTEN_UNIX)
    if listen not in (LISTEN_UNIX, LISTEN_TCP):
        raise InvalidArgument(
            'sidecar.listen: must be "unix" (services on guest UNIX sockets, the default) '
            'or "tcp" (raw ports on host 127.0.0.1 that every local user can reach)'
        )
    listen = ListenKind(listen)
    cpus = f.integer("cpus", SIDECAR_CPUS[0], SIDECAR_CPUS[1], default=SIDECAR_CPUS[2])
    mem = f.integer("mem", SIDECAR_MEM[0], SIDECAR_MEM[1], default=SIDECAR_MEM[2])
    raw_services = f.get("service", [])
    if not isinstance(raw_services, list) or not 1 <= len(raw_services) <= MAX_SERVICES:
        raise InvalidArgument(f"sidecar.service: must list 1-{MAX_SERVICES} services")
    services = tuple(_service(s, f"sidecar.service[{i}]") for i, s in enumerate(raw_services))
    names = [s.name for s in services]
    if len(set(names)) != len(names):
        raise InvalidArgument("sidecar.service: service names must be unique")
    egress = _egress(f.get("egress"), "sidecar.egress") if "egress" in f.table else None
    check_stamped_total(entry for svc in services for entry in svc.env)
    if (
        egress is not None
        and egress.connect_proxy is not None
        and egress.connect_proxy not in names
    ):
        raise InvalidArgument("sidecar.egress.connect_proxy: must name one of sidecar.service")
    return SidecarSpec(image, cpus, mem, services, egress, listen)


def _agent(raw: object) -> AgentSpec:
    f = _fields(
        raw,
        "agent",
        {"image", "cpus", "mem", "env", "workload", "volumes", "user", "bridge",
         "transparent_egress"},
    )  # fmt: skip
    image = _string(f, "image")
    cpus = f.integer("cpus", AGENT_CPUS[0], AGENT_CPUS[1], default=AGENT_CPUS[2])
    mem = f.integer("mem", AGENT_MEM[0], AGENT_MEM[1], default=AGENT_MEM[2])
    env = check_env(_strings(f, "env"), "agent.env", templates=False)
    workload = _strings(f, "workload", limit=256)
    volumes = tuple(
        _check_volume(v, f"agent.volumes[{i}]") for i, v in enumerate(_strings(f, "volumes"))
    )
    user = f.get("user")
    if user is not None and (not isinstance(user, str) or not USER_RE.fullmatch(user)):
        raise InvalidArgument("agent.user: must be a user name of the image or uid[:gid]")
    bridge = f.get("bridge", BridgeMode.BOTTLENET.value)
    if bridge not in tuple(BridgeMode):
        raise InvalidArgument('agent.bridge: must be "bottlenet" (the default) or "none"')
    layer = (
        _string(f, "transparent_egress", required=False)
        if "transparent_egress" in f.table
        else None
    )
    return AgentSpec(image, cpus, mem, env, workload, volumes, user, BridgeMode(bridge), layer)


def _refuse_unencodable(data: Mapping[str, Any]) -> None:
    """Every key and string of the document encodes as UTF-8 (no lone surrogate, which JSON's
    ``\\ud800`` can carry): each reaches argv, files and logs, where it would fail late."""
    todo: list[tuple[str, object]] = [("", data)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, Mapping):
            for key, item in value.items():
                path = f"{where}.{shown_key(key)}" if where else shown_key(key)
                _check_encodes(key, path)
                todo.append((path, item))
        elif isinstance(value, list):
            todo.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_encodes(value, where)


def _check_encodes(value: object, where: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"{where}: must be valid Unicode (no lone surrogates)") from None


def _check_transparent_egress(mode: str, sidecar: SidecarSpec, agent: AgentSpec) -> None:
    """``agent.transparent_egress`` names a service of the sidecar, in socket mode (the layer
    reaches the proxy through its mounted socket; an alias-mode agent has a network)."""
    service = agent.transparent_egress
    if service is None:
        return
    if service not in [s.name for s in sidecar.services]:
        raise InvalidArgument(
            "agent.transparent_egress: must name one of sidecar.service (the HTTP CONNECT proxy)"
        )
    if mode not in ("socket", "auto"):
        raise InvalidArgument(
            f"agent.transparent_egress: needs socket mode (the agent VM has no network device "
            f"and reaches the proxy through its mounted socket), not mode {mode!r}"
        )


def parse_bottle_spec(name: str, data: object) -> BottleSpec:
    """Validate a parsed spec document (from TOML or JSON) for bottle ``name``."""
    check_bottle_name(name)
    if not isinstance(data, Mapping):
        raise InvalidArgument("spec: must be a table")
    _refuse_unencodable(data)
    f = _fields(data, "", {"mode", "sidecar", "agent"})
    mode = f.get("mode", "auto")
    if mode not in MODES:
        raise InvalidArgument(f"mode: must be one of {', '.join(MODES)}")
    if mode == "none":
        if "sidecar" in f.table or "agent" in f.table:
            raise InvalidArgument("mode: 'none' is a forward-only bottle: no sidecar or agent")
        return BottleSpec(name, mode, None, None, dict(f.table))
    sidecar = _sidecar(f.get("sidecar", required=True))
    agent = _agent(f.get("agent", required=True))
    _check_transparent_egress(mode, sidecar, agent)
    if mode == "socket" and not is_local_image(agent.image):
        raise InvalidArgument(
            "agent.image: socket mode gives the agent VM no network, so smolvm cannot pull a "
            "registry image: use a local image (an archive, a directory or a packed machine)"
        )
    return BottleSpec(name, mode, sidecar, agent, dict(f.table))


__all__ = [
    "MAX_ENV",
    "MAX_STRING",
    "AgentSpec",
    "BottleSpec",
    "EgressSpec",
    "ServiceSpec",
    "SidecarSpec",
    "check_allow_hosts",
    "check_egress_host",
    "check_env_entries",
    "check_local_images",
    "image_fields",
    "is_local_image",
    "parse_bottle_spec",
    "stamp_template",
]


def check_create(name: str, alias: object | None, spec: BottleSpec) -> bool:
    """A create's spec checked against its other arguments (its name, an ``alias``, local
    images); True when it makes VMs. (Its volumes: the create's first step, ``volumes.py``.)"""
    if spec.name != name:
        raise InvalidArgument(f"the spec was read for bottle {spec.name}, not {name}")
    check_local_images(spec)
    if spec.has_vms and alias is not None:
        # An alias is a forward-only bottle's: a VM bottle's agent reaches its endpoints
        # over mounted sockets.
        raise InvalidArgument("--alias only applies to forward-only bottles, not VM bottles")
    return spec.has_vms
