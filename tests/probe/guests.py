"""Simulated guests for the gate step, for tests whose "VMs" cannot run the script.

The script the gate sends embeds its plan (``PLAN = {...}``); a simulated guest reads it back,
answers every planned check, and (when honest) connects to each own endpoint's witness the way
the real guest does. The transcript is built from the same ``expected_*`` helpers the judge
uses, so a change to the plan's shape changes both sides at once.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from twisted.internet.testing import StringTransport

from bottlenet.probe.judge import expected_deny, expected_icmp
from bottlenet.probe.plan import ProbePlan
from bottlenet.probe.witness import WitnessFactory


def read_plan(script: bytes) -> tuple[dict[str, Any], ProbePlan]:
    """The plan embedded in a rendered gate script, as a dict and as a ProbePlan."""
    literal = re.search(r"^PLAN = (\{.*\})$", script.decode(), re.M)
    assert literal is not None, "not a gate script"
    p = ast.literal_eval(literal.group(1))
    plan = ProbePlan(
        mode=p["mode"],
        nonce=p["nonce"],
        own=p["own"],
        deny=p["deny"],
        host_ports=p["ports"],
        udp_ports=p["udp_ports"],
        outside=p["outside"],
        dns=p["dns"],
        absent=p["absent"],
        ro=p["ro"],
        rw=p["rw"],
    )
    return p, plan


def pass_transcript(script: bytes, leaks: tuple[str, ...] = ()) -> tuple[int, bytes]:
    """(exit code, stdout) of a guest where every check holds but the ``leaks`` deny targets."""
    p, plan = read_plan(script)
    body = ["begin 1", "iface lo", "tool image", "control tcp ok", "control unix ok"]
    body += ["control icmp ok"]
    body += [f"own {t} ok" for t in p["own"]]
    body += [
        f"deny {t} {'reachable' if t in leaks else 'blocked'}" for t in expected_deny(plan, [])
    ]
    body += [f"icmp {a} blocked" for a in expected_icmp(plan, [])]
    body += [f"dns {n} blocked" for n in p["dns"]] + [f"absent {a} ok" for a in p["absent"]]
    body += [f"ro {v} ok" for v in p["ro"]]
    body += ["id machine-id none", "id hostname none", "end " + ("fail" if leaks else "pass")]
    out = "".join(f"BNP {p['nonce']} {ln}\n" for ln in body).encode()
    return (1 if leaks else 0), out


def witness_own_endpoints(table: Any) -> int:
    """Connect to every diverted forward's witness with its expected line; how many."""
    seen = 0
    for key in table.keys():
        factory = table.diverted_to(*key)
        if isinstance(factory, WitnessFactory):
            proto = factory.buildProtocol(None)
            proto.makeConnection(StringTransport())
            proto.dataReceived(factory.witness.expect(factory.endpoint) + b"\n")
            seen += 1
    return seen
