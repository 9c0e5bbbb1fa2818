"""Egress policy: write the allow-list into the sidecar and make its proxy reload it.

The sidecar image contract (docs/sidecar.md): the file at ``policy_path`` holds one host
per line; ``reload`` is an argv that makes the proxy re-read it and exits 0 on success. The
policy is written through ``smolvm machine exec`` with the document on stdin, atomically in
the guest (temp file + rename). Only a successful reload counts: on any failure the previous
file is put back, so the proxy's file never disagrees with the daemon's record.
"""

from __future__ import annotations

from collections.abc import Sequence

from twisted.logger import Logger

from bottlenet.bottles.owncommand import run_own_command
from bottlenet.bottles.spec import EgressSpec
from bottlenet.errors import SmolvmFailed
from bottlenet.kit.program import KitRef
from vmctl.smolvm import GUEST_ROOT, Smolvm

#: Atomic write inside the guest: "$1" is the policy path, stdin the document.
WRITE_ARGV = ["/bin/sh", "-c", 'cat > "$1.tmp" && mv "$1.tmp" "$1"', "sh"]
EXEC_TIMEOUT = 30.0
log = Logger()


def policy_document(hosts: Sequence[str]) -> bytes:
    """One host per line; an empty document denies all egress."""
    return "".join(f"{h}\n" for h in hosts).encode("ascii")


async def _write(
    smolvm: Smolvm, machine: str, path: str, hosts: Sequence[str], kit: KitRef | None
) -> None:
    argv = [*WRITE_ARGV, path] if kit is None else kit.argv("write", path)
    result = await run_own_command(smolvm, machine, argv, policy_document(hosts), EXEC_TIMEOUT, kit)
    if result.exit_code != 0:
        raise SmolvmFailed(
            f"writing the egress policy in {machine} failed (exit {result.exit_code})"
        )


async def _reload(smolvm: Smolvm, machine: str, egress: EgressSpec) -> None:
    result = await smolvm.exec(machine, list(egress.reload), timeout=EXEC_TIMEOUT, user=GUEST_ROOT)
    if result.exit_code != 0:
        raise SmolvmFailed(
            f"the egress reload command in {machine} failed (exit {result.exit_code})"
        )


async def push_policy(
    smolvm: Smolvm,
    machine: str,
    egress: EgressSpec,
    hosts: Sequence[str],
    previous: Sequence[str] | None,
    kit: KitRef | None = None,
) -> None:
    """Write ``hosts`` and reload; on failure restore ``previous`` (when there was one).
    ``kit``: the guest kit mounted in the sidecar writes the file (else its /bin/sh)."""
    try:
        await _write(smolvm, machine, egress.policy_path, hosts, kit)
        await _reload(smolvm, machine, egress)
    except BaseException:
        if previous is not None:
            try:
                await _write(smolvm, machine, egress.policy_path, previous, kit)
                await _reload(smolvm, machine, egress)
            except Exception as e:
                log.warn(
                    "could not restore the previous egress policy in {machine}: {err}",
                    machine=machine,
                    err=type(e).__name__,
                )
        raise
