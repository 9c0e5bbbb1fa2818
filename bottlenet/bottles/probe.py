"""The isolation probe (launch gate): what to check from inside the agent VM, and the verdict.

``probe.sh`` runs in the agent VM through ``smolvm machine exec`` (stdin = the script). Its
output is guest-controlled (at ``VerifyBottle`` time the agent's workload is running), so the
verdict never echoes it: a ``LEAK`` line is only reported when it names one of the endpoints
this module asked about.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from importlib import resources

from attrs import frozen

from bottlenet.bottles.model import Endpoint

#: Outside the host: must be unreachable from any agent VM.
EXTERNAL_TARGET = "1.1.1.1:443"
#: A public name that must not resolve inside an agent VM.
DNS_NAME = "example.com"
PROBE_TIMEOUT = 60.0
_LEAK = re.compile(r"^LEAK (?:dns (\S+) resolves|(\S+) is reachable)$")
_OWN_FAIL = re.compile(r"^FAIL own (\S+) does not connect$")


def probe_script() -> bytes:
    return resources.files("bottlenet.bottles").joinpath("probe.sh").read_bytes()


@frozen
class ProbePlan:
    """The checks: ``own`` must connect, ``deny`` must not, ``dns`` names must not resolve."""

    own: tuple[str, ...]
    deny: tuple[str, ...]
    dns: tuple[str, ...]

    def args(self) -> list[str]:
        return (
            [f"own:{e}" for e in self.own]
            + [f"deny:{e}" for e in self.deny]
            + [f"dns:{n}" for n in self.dns]
        )

    def argv(self) -> list[str]:
        return ["/bin/sh", "-s", "--", *self.args()]

    @property
    def count(self) -> int:
        return len(self.own) + len(self.deny) + len(self.dns)


def plan_probe(
    endpoints: Sequence[Endpoint],
    *,
    other_bottle: str | None,
    host_services: Sequence[int] = (),
    external: str = EXTERNAL_TARGET,
    dns_name: str = DNS_NAME,
) -> ProbePlan:
    """Own endpoints, plus: every raw port, another bottle, host services, internet, DNS.

    ``other_bottle`` is ``alias:port`` of another bottle's live endpoint (or an alias of the
    pool that is not ours); ``host_services`` are other ports listening on host 127.0.0.1.
    """
    own = []
    for e in endpoints:
        if e.host is not None:
            own.append(f"tcp:{e.host}:{e.port}")
        else:
            own.append(f"unix:{e.guest_path}")
    deny = [f"tcp:127.0.0.1:{e.raw_port}" for e in endpoints]
    deny += [
        f"tcp:127.0.0.1:{p}" for p in host_services if p not in {e.raw_port for e in endpoints}
    ]
    if other_bottle is not None:
        deny.append(f"tcp:{other_bottle}")
    deny.append(f"tcp:{external}")
    return ProbePlan(tuple(own), tuple(dict.fromkeys(deny)), (dns_name,))


@frozen
class ProbeVerdict:
    passed: bool
    problems: tuple[str, ...]

    def describe(self) -> str:
        return "; ".join(self.problems) if self.problems else "all checks passed"


def judge(plan: ProbePlan, exit_code: int, stdout: bytes) -> ProbeVerdict:
    """PASS only with exit 0, a last line ``RESULT PASS`` and no leak or failure line."""
    lines = [ln.strip() for ln in stdout.decode("utf-8", "replace").splitlines() if ln.strip()]
    known_tcp = {e for e in plan.deny} | {e for e in plan.own}
    problems: list[str] = []
    for line in lines:
        m = _LEAK.match(line)
        if m:
            name, endpoint = m.group(1), m.group(2)
            if name is not None:
                problems.append(f"leak: DNS name {name} resolves" if name in plan.dns else "leak")
            else:
                problems.append(
                    f"leak: {endpoint} is reachable" if endpoint in known_tcp else "leak"
                )
            continue
        m = _OWN_FAIL.match(line)
        if m:
            ep = m.group(1)
            problems.append(
                f"own endpoint {ep} does not connect" if ep in plan.own else "own endpoint fails"
            )
    if exit_code == 3:
        problems.append("the probe found no python3, nc or curl in the agent image")
    last = lines[-1] if lines else ""
    passed = exit_code == 0 and last == "RESULT PASS" and not problems
    if not passed and not problems:
        problems.append(f"probe did not pass (exit {exit_code})")
    return ProbeVerdict(passed, tuple(dict.fromkeys(problems)))
