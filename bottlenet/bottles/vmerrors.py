"""vmctl's errors as the control plane's: one mapping for every caller that drives smolvm.

A leaf of the bottles wing (it knows the two error hierarchies, nothing of bottles), so a
module that only runs a command in a VM (``attach``) need not import the host.
"""

from __future__ import annotations

from bottlenet.errors import (
    BottlenetError,
    Busy,
    InvalidArgument,
    KvmUnavailable,
    SmolvmFailed,
    SmolvmUnavailable,
    Unavailable,
)
from vmctl.errors import AgentBusy, VmctlError
from vmctl.errors import SmolvmFailed as VmSmolvmFailed


def map_vmctl(e: VmctlError, bottle: str | None = None) -> BottlenetError:
    """vmctl's codes onto the control plane's (messages are already sanitised). ``bottle``:
    the bottle the call was for, named in a BUSY (the guest agent's admission limits)."""
    if isinstance(e, AgentBusy):
        whose = f"bottle {bottle}" if bottle else "the VM"
        return Busy(
            f"{whose}: smolvm's guest agent refused the command at {e.limit or 'a limit'}; "
            "retry when one of its sessions ends"
        )
    if e.code in ("SMOLVM_UNAVAILABLE", "UNSUPPORTED_VERSION"):
        return SmolvmUnavailable(e.message)
    # A budget or argument problem found before smolvm ran is the caller's; the same code
    # reported by smolvm itself (krun -22 at start) is a smolvm failure.
    if e.code in ("INVALID_ARGUMENT", "DEVICE_BUDGET") and not isinstance(e, VmSmolvmFailed):
        return InvalidArgument(e.message)
    if e.code == "UNAVAILABLE":
        return Unavailable(e.message)
    if e.code == "KVM_UNAVAILABLE":
        return KvmUnavailable(e.message)
    # The wire code is SMOLVM_FAILED; vmctl's finer code leads the message unless it is the
    # same word (which once printed "SMOLVM_FAILED: SMOLVM_FAILED: ...").
    if e.code == SmolvmFailed.code:
        return SmolvmFailed(e.message)
    return SmolvmFailed(f"{e.code}: {e.message}")
