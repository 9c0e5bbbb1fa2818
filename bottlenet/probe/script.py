"""The exact POSIX sh script the gate runs in a guest for one plan.

Where the daemon could build no kit (``bottlenet.kit``), the script is sent on the guest's
stdin (``/bin/sh -s``), so no file of the image is run but its ``/bin/sh`` and its
``python3``. The sh part lists the network interfaces (which needs no tool, so a python-less
guest still reports them); the checks are ``guest.py`` with the plan filled in, carrying the
modules its link report imports (``bottlenet.transparent``'s ``netlink`` and ``links``, by
``transparent.script.bootstrap``). With a kit, the kit's ``probe`` runs the same checks and
lines from :func:`kit_request` on its stdin.
"""

from __future__ import annotations

import json
from importlib import resources

from bottlenet.probe.plan import LOOPBACKS, VSOCK_HOST_CID, LayerPlan, ProbePlan
from bottlenet.transparent.script import bootstrap

EXIT_NO_TOOL = 4
#: What the guest program imports of ``bottlenet.transparent`` (its link report).
MODULES = ("netlink", "links")
_HEREDOC = "BOTTLENET_PROBE_PY"

_SH = """\
#!/bin/sh
# bottlenet launch gate: generated for one run (python -m bottlenet.probe script ...).
# Every line it prints is "BNP <nonce> ..."; the host judges them. Exit 0 pass, 1 fail,
# 3 the probe tool cannot detect connections, 4 no python3.
N={nonce}
say() {{ echo "BNP $N $*"; }}
say begin 1
# /proc/net/dev is this process's network namespace; /sys/class/net is the one sysfs was
# mounted in, so it is only the fallback.
if [ -r /proc/net/dev ]; then
    {{ read -r _; read -r _; while read -r l; do say iface "${{l%%:*}}"; done; }} < /proc/net/dev
elif [ -d /sys/class/net ]; then
    for i in /sys/class/net/*; do
        [ -e "$i" ] && say iface "${{i##*/}}"
    done
fi
if command -v python3 >/dev/null 2>&1; then PY=python3; say tool image
else say end notool; exit {no_tool}
fi
"$PY" -I -S - <<'{heredoc}'
{program}
{heredoc}
"""


def plan_literal(plan: ProbePlan) -> dict[str, object]:
    """The plan as ``guest.py`` reads it (``PLAN``): plain strings, lists and numbers."""
    return {
        "nonce": plan.nonce,
        "mode": plan.mode.value,
        "own": [str(t) for t in plan.own],
        "deny": [str(t) for t in plan.deny],
        "ports": list(plan.host_ports),
        "udp_ports": list(plan.udp_ports),
        "loopbacks": list(LOOPBACKS),
        "vsock_cid": VSOCK_HOST_CID,
        "outside": str(plan.outside),
        "dns": list(plan.dns),
        "absent": list(plan.absent),
        "ro": list(plan.ro),
        "rw": list(plan.rw),
        "connect_via": None if plan.connect_via is None else str(plan.connect_via),
        "connect_ok": list(plan.connect_ok),
        "connect_no": list(plan.connect_no),
        "witness": plan.witness,
        "timeout": plan.timeout,
    }


def layer_literal(plan: LayerPlan) -> dict[str, object]:
    """The layer's check as ``guest.py`` reads it (``PLAN["layer"]``: its own main)."""
    return {
        "nonce": plan.nonce,
        "layer": True,
        "canaries": list(plan.canaries()),
        "outside": str(plan.outside),
        "timeout": plan.timeout,
    }


def guest_program(plan: ProbePlan | LayerPlan) -> str:
    """``guest.py`` with its ``PLAN`` line replaced by this plan (a Python literal), after the
    modules it imports."""
    source = resources.files("bottlenet.probe").joinpath("guest.py").read_text()
    literal = layer_literal(plan) if isinstance(plan, LayerPlan) else plan_literal(plan)
    marker = "PLAN = {}  # type: dict  # filled in by script.render\n"
    assert marker in source
    return bootstrap(MODULES, source.replace(marker, f"PLAN = {literal!r}\n", 1))


def render(plan: ProbePlan | LayerPlan) -> bytes:
    """The script (every plan value was validated to a shell- and heredoc-safe alphabet)."""
    program = guest_program(plan)
    assert _HEREDOC not in program
    return _SH.format(
        nonce=plan.nonce, no_tool=EXIT_NO_TOOL, heredoc=_HEREDOC, program=program
    ).encode()


def kit_request(plan: ProbePlan | LayerPlan) -> bytes:
    """What the kit's ``probe`` reads on stdin: the plan, and the digest it must have."""
    assert plan.kit is not None
    literal = layer_literal(plan) if isinstance(plan, LayerPlan) else plan_literal(plan)
    return json.dumps({"plan": literal, "kit": plan.kit}).encode()


#: The guest command: the script comes on stdin.
ARGV = ("/bin/sh", "-s")
