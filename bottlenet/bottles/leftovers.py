"""What a bottle that no longer exists left on the host: machines, its directory, VM uids.

A destroy is trusted to clean up; this is the independent look that proves it did, for
``bottlenetctl selftest`` (command ``Leftovers``). It asks smolvm's own listing (not the
daemon's records) for the bottle's machines, looks for the bottle's directory, and, under
per-VM uids, for reservations and processes no machine holds (:mod:`vmctl.residue`).
"""

from __future__ import annotations

import os

from twisted.internet.threads import deferToThreadPool

from bottlenet.bottles.host import VMHost
from bottlenet.bottles.model import Role, machine_name
from vmctl.residue import uid_leftovers


async def find_leftovers(name: str, host: VMHost | None, state_dir: str) -> list[str]:
    """One line per thing the bottle ``name`` left behind (empty: nothing); without smolvm
    (``host`` None), only its directory is looked for."""
    found: list[str] = []
    bottle_dir = os.path.join(state_dir, "bottles", name)
    if os.path.lexists(bottle_dir):
        found.append(f"the bottle's directory {bottle_dir} still exists")
    if host is None:
        return found
    smolvm, reactor = host.smolvm, host.reactor
    wanted = {machine_name(name, role) for role in Role}
    machines = await smolvm.list(include_ephemeral=True)
    found += [f"machine {m.name} still exists ({m.state})" for m in machines if m.name in wanted]
    if host.access.per_vm and smolvm.data_dir_root is not None:
        pool = reactor.getThreadPool()
        found += await deferToThreadPool(reactor, pool, uid_leftovers, smolvm.data_dir_root)
    return found
