"""One of bottlenet's own commands in a guest, fed on stdin: as the guest's root, under the
kit's session wrapper where a kit is mounted (else the image's), within a timeout.

The gate's probe, the bridge's reach proof, the egress layer's check and the egress policy's
write all run this way; the agent's own commands (``attach.py``, ``workload.py``) do not.
"""

from __future__ import annotations

from collections.abc import Sequence

from bottlenet.kit.program import KitRef, kit_session
from vmctl.smolvm import GUEST_ROOT, ExecResult, Smolvm


async def run_own_command(
    smolvm: Smolvm,
    machine: str,
    argv: Sequence[str],
    stdin: bytes,
    timeout: float,
    kit: KitRef | None,
) -> ExecResult:
    """``machine exec -u 0:0 -i`` of ``argv`` (smolvm's failures raised as vmctl's errors)."""
    return await smolvm.exec(
        machine, argv, stdin=stdin, timeout=timeout, user=GUEST_ROOT, session=kit_session(kit)
    )
