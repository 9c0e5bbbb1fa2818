"""The cause the host can see when an agent's connection to its endpoint never arrived
(``bottles/unseen.py``, issue 27 item 3): a real VM's refused connect hangs in the guest, so the
launch gate's and the bridge's failures name the endpoint and what the host knows."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from twisted.internet import defer
from twisted.internet.task import Clock

from bottlenet.bottles.probe import Gate, GateSettings
from bottlenet.bottles.unseen import grant_problem, why_unseen
from bottlenet.forward.table import ForwardCounters
from tests.probe.guests import pass_transcript
from vmctl.smolvm import ExecResult

VM_UID = 2_000_000


@pytest.fixture
def tmp_path() -> Iterator[str]:
    """A directory every uid may pass (pytest's own temp root is 0700)."""
    path = tempfile.mkdtemp(prefix="bnu-", dir="/tmp")
    os.chmod(path, 0o701)
    yield path
    shutil.rmtree(path, True)


def endpoint(tmp_path: str, mode: int = 0o660, gid: int = VM_UID) -> str:
    d = os.path.join(tmp_path, "bottles")
    os.mkdir(d, 0o701)
    path = os.path.join(d, "egress.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()
    os.chown(path, 0, gid)
    os.chmod(path, mode)
    return path


def test_a_grant_that_admits_the_vmm_uid_has_no_problem(tmp_path: Any) -> None:
    """root:<vmm uid> 0660 under o+x parents: the VMM may connect; the cause says the grant
    looks right and asks whether the VMM runs as that uid."""
    path = endpoint(tmp_path)
    assert grant_problem(path, VM_UID) is None
    assert "though its grant admits uid 2000000" in why_unseen(path, VM_UID, refused=False)


def test_each_grant_problem_is_named(tmp_path: Any) -> None:
    """A socket the uid cannot write, a parent it cannot pass, a socket that is gone."""
    path = endpoint(tmp_path, mode=0o600)
    assert grant_problem(path, VM_UID) == (
        "uid 2000000 (the agent VM's VMM) cannot write the socket (0600 0:2000000)"
    )
    os.chmod(path, 0o660)
    os.chmod(os.path.dirname(path), 0o700)
    assert grant_problem(path, VM_UID) == (
        f"uid 2000000 (the agent VM's VMM) cannot pass {os.path.dirname(path)} (0700 0:0)"
    )
    os.chmod(os.path.dirname(path), 0o701)
    os.unlink(path)
    assert why_unseen(path, VM_UID, refused=False) == (
        f"bottlenet's listener at {path} never saw the connection: the socket is gone (its "
        "listener was removed) (a grant problem)"
    )


class _Forward:
    def __init__(self, table: _Table) -> None:
        self.table = table

    @property
    def counters(self) -> ForwardCounters:
        return ForwardCounters(0, 0, self.table.refused, 0, 0, 0)


class _Table:
    """The two things the gate reads of a ForwardTable besides ``divert``: counters, peers."""

    def __init__(self) -> None:
        self.refused = 0
        self.peers = {"b1": frozenset({os.geteuid(), VM_UID})}

    def divert(self, bottle: str, label: str, factory: Any) -> None:
        pass

    def get(self, bottle: str, label: str) -> _Forward:
        return _Forward(self)


def test_the_gate_names_a_connection_its_listener_refused(tmp_path: Any) -> None:
    """The VMM's connection came from a uid the endpoint does not admit (the listener
    refused it): the gate's failure says so, naming the endpoint."""
    from bottlenet.bottles.model import SocketEndpoint

    path = endpoint(tmp_path)
    table = _Table()

    class RefusedGuest:
        def exec(self, name: str, argv: list[str], stdin: bytes, timeout: float, **kw: Any) -> Any:
            table.refused += 1  # the listener's SO_PEERCRED check turned it away
            code, out = pass_transcript(stdin)
            return defer.succeed(ExecResult(code, out, b"", 0.1))

    gate = Gate(
        Clock(),
        RefusedGuest(),  # type: ignore[arg-type]
        table,  # type: ignore[arg-type]
        state_dir=str(tmp_path),
        settings=GateSettings(outside="198.18.0.1:9", dns_name="gate.invalid", home=str(tmp_path)),
    )
    ep = SocketEndpoint("egress", 3128, path, "/run/bottle/egress.sock", "/s/sidecar/egress.sock")
    d = defer.Deferred.fromCoroutine(
        gate.run("b1", "bn-b1-agent", "socket", [ep], other_bottle=None)
    )
    _plan, verdict = d.result  # type: ignore[attr-defined]
    assert verdict.problems[-1] == (
        f"own endpoint unix:/run/bottle/egress.sock (egress): bottlenet's listener at {path} "
        "refused a connection from a uid it does not admit (a uid problem: the agent VM's VMM "
        "is not uid 2000000)"
    )
