"""The VM bottle as the daemon remembers it: one frozen value, and its state-file form.

Everything recovery needs after a restart is here (machine names, the sidecar pid, raw ports,
the agent endpoints with their real ports, the stamped env, the policy, the flags), so the
daemon can re-bind the same endpoints and tell its machines from anyone else's.
"""

from __future__ import annotations

import hashlib
from typing import Any

from attrs import field, frozen

from bottlenet.bottles.spec import BottleSpec, parse_bottle_spec
from bottlenet.bottles.store import StateError
from bottlenet.errors import InvalidArgument

ROLE_SIDECAR = "sidecar"
ROLE_AGENT = "agent"
LABEL_OWNER = "bottlenet.owner"
LABEL_BOTTLE = "bottlenet.bottle"
LABEL_ROLE = "bottlenet.role"

STATE_READY = "ready"
STATE_DEGRADED = "degraded"


def machine_name(bottle: str, role: str) -> str:
    """``bn-<bottle>-<role>``, or ``bn_<hash>-<role>`` when that breaks smolvm's name rules.

    smolvm refuses ``--`` anywhere, and a bottle name may contain ``--`` or end in ``-``
    (which the suffix would turn into ``--``). Bottle names never contain ``_``, so the
    hashed form can never collide with a literal one.
    """
    if "--" not in bottle and not bottle.endswith("-"):
        return f"bn-{bottle}-{role}"
    digest = hashlib.sha256(bottle.encode()).hexdigest()[:20]
    return f"bn_{digest}-{role}"


@frozen
class Endpoint:
    """One service of a VM bottle: where the agent connects, and the raw port behind it.

    Alias mode: ``host``/``port`` is the agent endpoint on the bottle's alias. Socket mode:
    ``path`` is the host UNIX socket (bottlenet's listener) and ``guest_path`` where it is
    mounted in the agent VM. ``raw_port`` is the sidecar's published port on 127.0.0.1; it is
    never given to the agent.
    """

    service: str
    guest_port: int
    raw_port: int
    host: str | None = None
    port: int | None = None
    path: str | None = None
    guest_path: str | None = None

    def agent_address(self) -> str:
        """What the agent dials: ``alias:port`` or the socket path inside the guest."""
        if self.host is not None:
            return f"{self.host}:{self.port}"
        return f"unix:{self.guest_path}"

    def to_json(self) -> dict[str, Any]:
        return {
            "service": self.service,
            "guest_port": self.guest_port,
            "raw_port": self.raw_port,
            "host": self.host,
            "port": self.port,
            "path": self.path,
            "guest_path": self.guest_path,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Endpoint:
        return cls(
            service=_typed(d, "service", str),
            guest_port=_typed(d, "guest_port", int),
            raw_port=_typed(d, "raw_port", int),
            host=_typed(d, "host", str, optional=True),
            port=_typed(d, "port", int, optional=True),
            path=_typed(d, "path", str, optional=True),
            guest_path=_typed(d, "guest_path", str, optional=True),
        )


@frozen
class VMBottle:
    """A bottle with a sidecar VM and an agent VM."""

    name: str
    spec: BottleSpec = field(eq=False)
    spec_doc: dict[str, Any] = field(eq=False)
    mode: str  # "alias" | "socket"
    mechanism: str
    alias: str | None
    sidecar_vm: str
    agent_vm: str
    sidecar_pid: int
    endpoints: tuple[Endpoint, ...]
    env: tuple[tuple[str, str], ...]
    policy: tuple[str, ...]
    probe_skipped: bool
    probe: str  # "PASS" | "FAIL" | "skipped"
    created_at: float
    state: str = STATE_READY
    detail: str | None = None

    @property
    def raw_ports(self) -> tuple[int, ...]:
        return tuple(e.raw_port for e in self.endpoints)

    def to_state(self) -> dict[str, Any]:
        return {
            "kind": "vm",
            "spec": self.spec_doc,
            "mode": self.mode,
            "mechanism": self.mechanism,
            "alias": self.alias,
            "sidecar_vm": self.sidecar_vm,
            "agent_vm": self.agent_vm,
            "sidecar_pid": self.sidecar_pid,
            "endpoints": [e.to_json() for e in self.endpoints],
            "env": [[k, v] for k, v in self.env],
            "policy": list(self.policy),
            "flags": {"probe_skipped": self.probe_skipped},
            "probe": self.probe,
            "created_at": self.created_at,
            "state": self.state,
            "detail": self.detail,
        }

    @classmethod
    def from_state(cls, name: str, d: dict[str, Any]) -> VMBottle:
        """Rebuild a bottle from its state record (StateError when it is malformed)."""
        try:
            spec_doc = _typed(d, "spec", dict)
            flags = _typed(d, "flags", dict)
            env = _typed(d, "env", list)
            if not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                for p in env
            ):
                raise StateError(f"bottle {name}: bad env")
            policy = _typed(d, "policy", list)
            if not all(isinstance(h, str) for h in policy):
                raise StateError(f"bottle {name}: bad policy")
            return cls(
                name=name,
                spec=parse_bottle_spec(name, spec_doc),
                spec_doc=spec_doc,
                mode=_typed(d, "mode", str),
                mechanism=_typed(d, "mechanism", str),
                alias=_typed(d, "alias", str, optional=True),
                sidecar_vm=_typed(d, "sidecar_vm", str),
                agent_vm=_typed(d, "agent_vm", str),
                sidecar_pid=_typed(d, "sidecar_pid", int),
                endpoints=tuple(Endpoint.from_json(e) for e in _typed(d, "endpoints", list)),
                env=tuple((k, v) for k, v in env),
                policy=tuple(policy),
                probe_skipped=flags.get("probe_skipped") is True,
                probe=_typed(d, "probe", str),
                created_at=float(_typed(d, "created_at", (int, float))),
                state=_typed(d, "state", str),
                detail=_typed(d, "detail", str, optional=True),
            )
        except InvalidArgument as e:
            raise StateError(f"bottle {name}: stored spec no longer valid: {e.message}") from None
        except (TypeError, AttributeError):
            raise StateError(f"bottle {name}: malformed record") from None


def _typed(d: object, key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
    if not isinstance(d, dict):
        raise StateError("record is not an object")
    value = d.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise StateError(f"record field {key} is missing or mistyped")
    return value
