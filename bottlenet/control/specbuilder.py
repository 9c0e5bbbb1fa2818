"""A typed bottle spec for launchers: attrs classes mirroring ``docs/sidecar.md``, checked on
construction with the daemon's own rules (:mod:`bottlenet.bottles.specrules`), turned into
the JSON that ``CreateBottle`` takes.

Client side: it imports only the errors and two pure leaf modules (the spec value rules and
the name rules), no reactor and no daemon machinery, so a launcher on another host can use it.
What only the daemon's host can answer (does a volume's host directory exist there; is the
agent image local to its smolvm) is checked by the daemon at create time, with the same
messages.

    spec = BottleSpec(
        mode="socket",
        sidecar=Sidecar(
            image="registry.example/bottle-sidecar:1",
            services=(Service("egress", 3128, env=("HTTPS_PROXY=http://{host}:{port}",)),),
            egress=Egress(("pypi.org",), "/etc/bottle/egress-allow", ("/usr/local/bin/reload",)),
        ),
        agent=Agent(image="/var/lib/bottles/agent.tar", workload=("/usr/local/bin/run-agent",)),
    )
    client.create_bottle("agent1", spec=spec.to_json())
"""

from __future__ import annotations

import json
from collections.abc import Iterable
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
    check_abs_path,
    check_allow_hosts,
    check_env,
    check_label,
    check_stamped_total,
    split_volume,
)
from bottlenet.errors import InvalidArgument


def _words(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


def _services(values: Iterable[Service]) -> tuple[Service, ...]:
    return tuple(values)


def _hosts(values: Iterable[str]) -> tuple[str, ...]:
    return check_allow_hosts(list(values) if not isinstance(values, list | tuple) else values)


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_STRING:
        raise InvalidArgument(f"{where}: must be a non-empty string")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidArgument(f"{where}: must not contain control characters")
    return value


def _strings(value: object, where: str, limit: int = MAX_ENV) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or len(value) > limit:
        raise InvalidArgument(f"{where}: must be a list of at most {limit} strings")
    for i, item in enumerate(value):
        if not isinstance(item, str) or len(item) > MAX_STRING or "\x00" in item:
            raise InvalidArgument(f"{where}[{i}]: must be a string without NUL")
    return tuple(value)


def _integer(value: object, where: str, bounds: tuple[int, int, int]) -> int:
    low, high, _ = bounds
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgument(f"{where}: must be an integer {low}-{high}")
    return value


@frozen
class Service:
    """``[[sidecar.service]]``: a service the agent may reach, and its stamped env."""

    name: str
    guest_port: int
    env: tuple[str, ...] = field(default=(), converter=_words)

    def __attrs_post_init__(self) -> None:
        check_label(self.name)
        _integer(self.guest_port, "guest_port", (1, 65535, 0))
        check_env(_strings(self.env, "env"), "env", templates=True)

    def to_doc(self) -> dict[str, Any]:
        return {"name": self.name, "guest_port": self.guest_port, "env": list(self.env)}


@frozen
class Egress:
    """``[sidecar.egress]``: the allow-list (normalised, IDNA as punycode) and how to push it."""

    allow_hosts: tuple[str, ...] = field(converter=_hosts)
    policy_path: str
    reload: tuple[str, ...] = field(converter=_words)

    def __attrs_post_init__(self) -> None:
        check_abs_path(_text(self.policy_path, "egress.policy_path"), "egress.policy_path")
        reload = _strings(self.reload, "egress.reload", limit=64)
        if not reload or not reload[0].startswith("/"):
            raise InvalidArgument("egress.reload: must be an argv whose first item is absolute")

    def to_doc(self) -> dict[str, Any]:
        return {
            "allow_hosts": list(self.allow_hosts),
            "policy_path": self.policy_path,
            "reload": list(self.reload),
        }


@frozen
class Sidecar:
    """``[sidecar]``: the image with the bottle's services (1-16, unique names)."""

    image: str
    services: tuple[Service, ...] = field(converter=_services)
    cpus: int = SIDECAR_CPUS[2]
    mem: int = SIDECAR_MEM[2]
    egress: Egress | None = None
    listen: str = LISTEN_UNIX

    def __attrs_post_init__(self) -> None:
        _text(self.image, "sidecar.image")
        if self.listen not in (LISTEN_UNIX, LISTEN_TCP):
            raise InvalidArgument(f'sidecar.listen: must be "{LISTEN_UNIX}" or "{LISTEN_TCP}"')
        _integer(self.cpus, "sidecar.cpus", SIDECAR_CPUS)
        _integer(self.mem, "sidecar.mem", SIDECAR_MEM)
        if not 1 <= len(self.services) <= MAX_SERVICES:
            raise InvalidArgument(f"sidecar.service: must list 1-{MAX_SERVICES} services")
        if not all(isinstance(s, Service) for s in self.services):
            raise InvalidArgument("sidecar.service: must be Service values")
        names = [s.name for s in self.services]
        if len(set(names)) != len(names):
            raise InvalidArgument("sidecar.service: service names must be unique")
        check_stamped_total(entry for s in self.services for entry in s.env)

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "image": self.image,
            "cpus": self.cpus,
            "mem": self.mem,
            "service": [s.to_doc() for s in self.services],
            "listen": self.listen,
        }
        if self.egress is not None:
            doc["egress"] = self.egress.to_doc()
        return doc


@frozen
class Agent:
    """``[agent]``: the untrusted agent's VM, its env, workload and volumes."""

    image: str
    cpus: int = AGENT_CPUS[2]
    mem: int = AGENT_MEM[2]
    env: tuple[str, ...] = field(default=(), converter=_words)
    workload: tuple[str, ...] = field(default=(), converter=_words)
    volumes: tuple[str, ...] = field(default=(), converter=_words)
    #: The workload's user (``exec -u``): a user name of the image or ``uid[:gid]``.
    user: str | None = None

    def __attrs_post_init__(self) -> None:
        _text(self.image, "agent.image")
        if self.user is not None and (
            not isinstance(self.user, str) or not USER_RE.fullmatch(self.user)
        ):
            raise InvalidArgument("agent.user: must be a user name of the image or uid[:gid]")
        _integer(self.cpus, "agent.cpus", AGENT_CPUS)
        _integer(self.mem, "agent.mem", AGENT_MEM)
        check_env(_strings(self.env, "agent.env"), "agent.env", templates=False)
        _strings(self.workload, "agent.workload", limit=256)
        for i, v in enumerate(_strings(self.volumes, "agent.volumes")):
            split_volume(v, f"agent.volumes[{i}]")

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "image": self.image,
            "cpus": self.cpus,
            "mem": self.mem,
            "env": list(self.env),
            "workload": list(self.workload),
            "volumes": list(self.volumes),
        }
        if self.user is not None:
            doc["user"] = self.user
        return doc


@frozen
class BottleSpec:
    """A whole spec: ``mode`` plus the sidecar and agent (both, unless ``mode="none"``)."""

    mode: str = "auto"
    sidecar: Sidecar | None = None
    agent: Agent | None = None

    def __attrs_post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgument(f"mode: must be one of {', '.join(MODES)}")
        if self.mode == "none":
            if self.sidecar is not None or self.agent is not None:
                raise InvalidArgument("mode: 'none' is a forward-only bottle: no sidecar or agent")
            return
        if self.sidecar is None:
            raise InvalidArgument("sidecar: missing")
        if self.agent is None:
            raise InvalidArgument("agent: missing")

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"mode": self.mode}
        if self.sidecar is not None:
            doc["sidecar"] = self.sidecar.to_doc()
        if self.agent is not None:
            doc["agent"] = self.agent.to_doc()
        return doc

    def to_json(self) -> str:
        """The ``spec`` argument of ``CreateBottle`` (compact JSON)."""
        return json.dumps(self.to_doc(), separators=(",", ":"), ensure_ascii=False)
