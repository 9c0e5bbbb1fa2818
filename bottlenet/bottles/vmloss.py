"""Whether an attached session ended because its VM did (issue 27 item 6).

A real smolvm VM that stops or crashes takes every attached session with it: the CLI ends
with ``connection to VM lost``, exit 1 (``src/agent/client.rs`` ``interactive_session``), and
every guest process is gone. bottlenet's own sessions in the agent VM (the bridge and the
workload waiter) then ask smolvm once how the VM is: a VM that is no longer running makes the
bottle degraded with that reason at once, rather than a bridge restarted against a dead VM
until its back-off gives up, or a waiter that never reports.
"""

from __future__ import annotations

from typing import Any

from vmctl.errors import NotFound, VmctlError


async def lost_reason(smolvm: Any, machine: str) -> str | None:
    """Why ``machine``'s sessions ended if its VM did; None while it runs (or is only
    ``unreachable``) or when smolvm cannot tell (the caller's own path goes on)."""
    try:
        m = await smolvm.status(machine)
    except NotFound:
        return f"agent VM {machine} no longer exists: its sessions ended with it"
    except VmctlError:
        return None
    if m.running or m.unreachable:
        return None
    return (
        f"agent VM {machine} is {m.state} (it stopped or crashed): its sessions ended with it "
        "(connection to VM lost)"
    )
