"""Which VMM uid may reach which of a bottle's sockets, under smolvm's two privilege models.

Under ``one uid`` (the daemon is not root) every VMM runs as the daemon's user: the bottle's
directory, the sidecar's socket directory and every socket stay 0700/0600 and the daemon's.

Under ``per-VM uids`` (root) each VMM runs as its own uid, which bottlenet reserves in
smolvm's registry before the VM's start (``vmctl.uids``), so the layout is made for it:

* ``<state-dir>``, ``bottles/`` and ``bottles/<name>/`` get ``o+x`` (0701): any uid may pass
  through, none may list, read or write; every file the daemon keeps there stays 0600;
* ``bottles/<name>/sidecar/`` is the sidecar VMM uid's own (0700): it creates exactly its
  exposed sockets there, and no other VMM uid can enter it;
* each agent endpoint ``bottles/<name>/<service>.sock`` is ``root:<agent uid>`` 0660: the
  agent VMM's uid (its gid is the same number, smolvm clears supplementary groups) may
  connect, no other uid may; and the endpoints admit only that uid and the daemon's own by
  ``SO_PEERCRED`` (``ForwardTable.admit_peers``), as the control socket checks its peers.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

from bottlenet.paths import open_regular
from vmctl.smolvm import VmUids

#: Others may search (traverse) a directory with this bit, never list it.
TRAVERSE = 0o001
#: An agent endpoint under per-VM uids: owner (the daemon) and group (the agent VMM's gid).
ENDPOINT_MODE = 0o660


def add_traverse(path: str) -> None:
    """Add ``o+x`` to a directory of the daemon's that lacks it (and nothing else)."""
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    if not mode & TRAVERSE:
        os.chmod(path, mode | TRAVERSE)


def _ancestors(path: str) -> list[str]:
    found = []
    path = os.path.abspath(path)
    while (parent := os.path.dirname(path)) != path:
        found.append(parent)
        path = parent
    return found


def closed_parents(path: str) -> list[str]:
    """``path``'s parents that lack ``o+x``: smolvm started as root adds it to each parent of
    its data dir at its first VM start (``docs/smolvm.md``), which the daemon says at start."""
    found = []
    for parent in _ancestors(path):
        try:
            mode = os.stat(parent).st_mode
        except FileNotFoundError:
            continue  # not made yet (smolvm makes it, with o+x)
        if not mode & TRAVERSE:
            found.append(parent)
    return found


class VmmAccess:
    """The file modes and peer uids of a bottle's sockets, for the daemon's model."""

    def __init__(self, state_dir: str, model: VmUids) -> None:
        self.state_dir = state_dir
        self.model = model

    @property
    def per_vm(self) -> bool:
        return self.model is VmUids.PER_VM

    def open_path(self, bottle_dir: str) -> None:
        """Under per-VM uids: o+x from the state dir down to the bottle's directory."""
        if not self.per_vm:
            return
        bottles = os.path.dirname(bottle_dir)
        for path in (self.state_dir, bottles, bottle_dir):
            add_traverse(path)

    def closed_ancestor(self, registry: str) -> str | None:
        """An ancestor of the state dir no VMM uid can pass (no ``o+x``) that smolvm's start
        will not open either (it adds ``o+x`` to its uid registry's ancestors only), or None."""
        if not self.per_vm:
            return None
        opened = {registry, *_ancestors(registry)}
        for path in _ancestors(self.state_dir):
            if path in opened:
                continue
            if not os.stat(path).st_mode & TRAVERSE:
                return path
        return None

    def hand_sidecar_dir(self, path: str, uid: int) -> None:
        """The sidecar VMM's socket directory becomes its uid's own (0700)."""
        os.chown(path, uid, uid, follow_symlinks=False)
        os.chmod(path, 0o700, follow_symlinks=False)

    def grant_endpoints(self, paths: Iterable[str], uid: int) -> None:
        """The agent VMM's uid (as its gid) may connect to these endpoints, nobody else."""
        for path in paths:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                continue  # never chown through a name that is not our socket
            os.chown(path, os.geteuid(), uid, follow_symlinks=False)
            os.chmod(path, ENDPOINT_MODE)  # sockets: Linux has no lchmod; lstat said socket

    def peers(self, agent_uid: int | None) -> frozenset[int]:
        """The uids the agent endpoints admit: the daemon's own, and the agent VMM's."""
        own = os.geteuid()
        return frozenset({own} if agent_uid is None else {own, agent_uid})


#: More than any uid's digits: a longer ``.vm-uid`` is not smolvm's.
VM_UID_MAX_BYTES = 16


def read_started_uid(path: str) -> int | None:
    """The uid in a started VM's ``.vm-uid`` (its VMM's uid owns that file and may have put
    anything there): read through ``open_regular`` (no FIFO, no symlink, no device), at most
    a few bytes; None when it holds no uid. Blocking: call it off the reactor thread.
    Raises OSError (NotRegularFile, FileNotFoundError)."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as fh:
        text = fh.read(VM_UID_MAX_BYTES + 1)
    if len(text) > VM_UID_MAX_BYTES or not text.strip().isdigit():
        return None
    return int(text.strip())
