"""The agent VM's environment, stamped from the agent endpoints only (never a raw port).

Each service's ``env`` templates are filled with ``{host}``, ``{port}``, ``{socket}`` and
``{service}``: ``{host}`` is 127.0.0.1 and ``{port}`` the service's guest port, served inside
the agent VM by the bridge to ``{socket}`` (the mounted socket); ``BOTTLENET_BRIDGES`` lists
those ``PORT=PATH`` pairs for the bridge (docs/sidecar.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from bottlenet.bottles.model import AgentSocket
from bottlenet.bottles.spec import BottleSpec
from bottlenet.bottles.specrules import stamp_template
from bottlenet.probe.plan import IsolationMode


def stamp_env(
    spec: BottleSpec, mode: IsolationMode, endpoints: Sequence[AgentSocket]
) -> tuple[tuple[str, str], ...]:
    assert spec.sidecar is not None and spec.agent is not None
    env: dict[str, str] = {}
    for entry in spec.agent.env:
        key, _, value = entry.partition("=")
        env[key] = value
    env["BOTTLENET_BOTTLE"] = spec.name
    env["BOTTLENET_MODE"] = mode
    by_service = {e.service: e for e in endpoints}
    bridges = []
    for svc in spec.sidecar.services:
        ep = by_service[svc.name]
        host, port, sock = "127.0.0.1", str(svc.guest_port), ep.guest_path
        bridges.append(f"{svc.guest_port}={ep.guest_path}")
        for entry in svc.env:
            key, _, template = entry.partition("=")
            fields = {"host": host, "port": port, "socket": sock, "service": svc.name}
            env[key] = stamp_template(template, fields)
    if bridges:
        env["BOTTLENET_BRIDGES"] = " ".join(bridges)
    return tuple(env.items())
