"""Why an agent's connection to one of its endpoints never reached bottlenet (issue 27 item 3).

A real agent VM reaches its endpoints through ``--mount-socket``: on each guest connect the
VMM (under per-VM uids, its own uid) connects to the endpoint's host socket. When that connect
fails (the VMM uid may not pass a parent directory or write the socket, the listener is gone)
libkrun still confirms the guest's connect and the guest's bytes go nowhere: no EOF, no reset
(snapshot ``src/devices/src/virtio/vsock/muxer.rs`` ``process_op_request``). The guest can
only time out. The host can see more: whether its listener saw the connection at all (it
counts every one it accepts or refuses) and whether the endpoint's grant admits the VMM's uid.
:func:`why_unseen` says which, for the launch gate's and the bridge's failures.
"""

from __future__ import annotations

import os
import stat

from bottlenet.forward.table import ForwardTable

#: Mode bits (owner, group, other) for "may pass" and "may write".
_SEARCH = (stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH)
_WRITE = (stat.S_IWUSR, stat.S_IWGRP, stat.S_IWOTH)


def seen_count(table: ForwardTable, bottle: str, label: str) -> int:
    """Connections the endpoint's listener has seen: relayed or refused."""
    try:
        c = table.get(bottle, label).counters
    except Exception:
        return 0
    return c.accepted + c.refused


def refused_count(table: ForwardTable, bottle: str, label: str) -> int:
    try:
        return table.get(bottle, label).counters.refused
    except Exception:
        return 0


def vmm_uid(table: ForwardTable, bottle: str) -> int | None:
    """The agent VM's VMM uid the bottle's endpoints admit (None: one uid, file modes only)."""
    peers = getattr(table, "peers", {})
    others = sorted((peers.get(bottle) or frozenset()) - {os.geteuid()})
    return others[0] if others else None


def _may(st: os.stat_result, uid: int, bits: tuple[int, int, int]) -> bool:
    """As the kernel decides for a process of ``uid``, gid ``uid`` and no other group (how
    smolvm drops each VMM)."""
    if uid == 0:
        return True
    if st.st_uid == uid:
        return bool(st.st_mode & bits[0])
    if st.st_gid == uid:
        return bool(st.st_mode & bits[1])
    return bool(st.st_mode & bits[2])


def _describe(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o} {st.st_uid}:{st.st_gid}"


def grant_problem(path: str, uid: int) -> str | None:
    """What keeps ``uid`` from connecting to the socket at ``path``, or None."""
    parent = os.path.dirname(path)
    chain = []
    while True:
        chain.append(parent)
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    for d in reversed(chain):
        try:
            st = os.stat(d)
        except OSError:
            return f"{d} is gone"
        if not _may(st, uid, _SEARCH):
            return f"uid {uid} (the agent VM's VMM) cannot pass {d} ({_describe(st)})"
    try:
        st = os.stat(path)
    except OSError:
        return "the socket is gone (its listener was removed)"
    if not _may(st, uid, _WRITE):
        return f"uid {uid} (the agent VM's VMM) cannot write the socket ({_describe(st)})"
    return None


def why_unseen(path: str, uid: int | None, *, refused: bool) -> str:
    """The host's view of an endpoint the guest could not use, in one clause."""
    where = f"bottlenet's listener at {path}"
    if refused:
        return (
            f"{where} refused a connection from a uid it does not admit (a uid problem: the "
            f"agent VM's VMM is not uid {uid})"
        )
    if uid is None:
        return f"{where} never saw the connection (a grant or uid problem)"
    problem = grant_problem(path, uid)
    if problem is not None:
        return f"{where} never saw the connection: {problem} (a grant problem)"
    return (
        f"{where} never saw the connection, though its grant admits uid {uid}: the VMM could "
        "not connect (a grant or uid problem: does the VMM run as that uid?)"
    )
