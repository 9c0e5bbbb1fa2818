"""ForwardTable API: binding invariants, errors, counters, refusal log rate limiting."""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any

import pytest
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.trial import unittest

from bottlenet.errors import AlreadyExists, BindRefused, Busy, InvalidArgument, NotFound
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import ForwardSpec, TCPListen, TCPTarget
from bottlenet.forward.table import ForwardTable
from tests.forward.netutil import POOL, registry_with
from tests.forward.test_loopback import LOOP, tempdir

OWN = "127.77.0.2"
OTHER = "127.77.0.3"  # belongs to bottle b2

REJECTED_ALIASES = [
    "0.0.0.0",
    "::",
    "",
    "127.0.0.1",
    "::1",
    "localhost",
    "127.78.0.2",  # outside the pool
    OTHER,  # another bottle's alias
    "127.1",
    "0x7f.0.0.2",
    "2130706434",
    "127.0.0.016",
    " 127.77.0.2",
    "127.77.0.2\n",
    "127.77.0.2/32",
    "::ffff:127.77.0.2",
]


def failure_of(d: Deferred[Any]) -> Failure:
    result: list[Failure] = []
    d.addErrback(result.append)
    assert result, "expected a synchronous failure"
    return result[0]


def as_value(text: str) -> Any:
    """What a caller that skipped parsing might put in TCPListen.alias."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return text


@pytest.mark.parametrize("spelling", REJECTED_ALIASES)
def test_rejected_alias_spellings(spelling: str) -> None:
    # The path a config file or control request takes: parse, then claim...
    if spelling == OTHER:
        POOL.parse_alias(spelling)  # a fine pool address: ownership is what refuses it
    else:
        with pytest.raises(InvalidArgument):
            POOL.parse_alias(spelling)
    reg = registry_with(("b1", OWN), ("b2", OTHER))
    with pytest.raises((InvalidArgument, AlreadyExists)):
        reg.claim("b3", spelling)
    # ... and the table re-checks before binding, whatever the caller did.
    table = ForwardTable(Clock(), reg, state_dir="/nonexistent")
    spec = ForwardSpec("b1", "web", TCPListen(as_value(spelling), 0), TCPTarget(LOOP, 9))
    f = failure_of(table.add(spec))
    assert f.check(InvalidArgument), f
    assert table.list() == []


def test_registry_refuses_another_bottles_alias_with_already_exists() -> None:
    reg = registry_with(("b2", OTHER))
    with pytest.raises(AlreadyExists):
        reg.claim("b1", OTHER)


def test_unknown_forward_is_not_found() -> None:
    table = ForwardTable(Clock(), AliasRegistry(POOL), state_dir="/nonexistent")
    with pytest.raises(NotFound):
        table.get("b1", "web")
    assert failure_of(table.remove("b1", "web")).check(NotFound)
    assert table.list() == []


def test_bad_target_refused() -> None:
    table = ForwardTable(Clock(), registry_with(("b1", OWN)), state_dir="/nonexistent")
    alias = ipaddress.IPv4Address(OWN)
    for target in (
        TCPTarget(ipaddress.IPv4Address("10.0.0.1"), 80),
        TCPTarget(LOOP, 0),
    ):
        f = failure_of(table.add(ForwardSpec("b1", "web", TCPListen(alias, 0), target)))
        assert f.check(InvalidArgument), f


@pytest.mark.parametrize(
    "target",
    [
        OWN + ":7300",  # the forward's own alias: one connection became 1024 relays
        "127.77.0.9:443",  # any other address of the pool: another bottle's endpoint
        "127.0.0.1:9443",  # the daemon's own TLS control listener
        "127.0.0.1:9100",  # ... and its metrics listener
    ],
)
def test_target_never_loops_into_the_daemons_own_listeners(target: str) -> None:
    """Issue 13 item 9 (forward loops): the pool and the daemon's TCP listeners are refused."""
    from bottlenet.forward.spec import parse_target

    table = ForwardTable(Clock(), registry_with(("b1", OWN)), state_dir="/nonexistent")
    table.own_sockets.add_tcp("127.0.0.1", 9443)
    table.own_sockets.add_tcp("127.0.0.1", 9100)
    spec = ForwardSpec(
        "b1", "loop", TCPListen(ipaddress.IPv4Address(OWN), 7300), parse_target(target)
    )
    f = failure_of(table.add(spec))
    assert f.check(InvalidArgument), f
    assert "alias pool" in f.value.message or "daemon's own sockets" in f.value.message
    assert table.list() == []


class _HeldListen:
    """A server endpoint whose ``listen`` the test settles: the forward stays pending till then."""

    def __init__(self) -> None:
        self.d: Deferred[Any] = Deferred()

    def listen(self, factory: Any) -> Deferred[Any]:
        return self.d


def test_a_forward_still_binding_holds_its_key_until_its_bind_settles() -> None:
    """Pending: add again is AlreadyExists, remove is Busy, queries and listings skip it; a
    failed bind frees the key, and remove_bottle leaves a pending forward to its add."""
    from bottlenet.forward.table import ForwardPhase

    table = ForwardTable(Clock(), registry_with(("b1", OWN)), state_dir="/nonexistent")
    held = _HeldListen()
    table._server_endpoint = lambda spec: held  # type: ignore[assignment,method-assign,return-value]
    spec = ForwardSpec("b1", "web", TCPListen(ipaddress.IPv4Address(OWN), 0), TCPTarget(LOOP, 9))
    adding = table.add(spec)
    assert failure_of(table.add(spec)).check(AlreadyExists)
    assert failure_of(table.remove("b1", "web")).check(Busy)
    with pytest.raises(NotFound):
        table.get("b1", "web")
    assert table.list() == [] and table.list("b1") == [] and table.keys() == []
    assert table._forwards["b1", "web"].phase is ForwardPhase.PENDING
    assert (table.budget._listeners(), table.budget._bottles()) == (0, 0)
    assert table.remove_bottle("b1").called  # nothing listening, nothing closing
    held.d.errback(OSError(98, "Address already in use"))
    assert failure_of(adding).check(BindRefused)
    held.d = Deferred()
    assert not table.add(spec).called  # the key is free again


def test_refusal_logs_are_rate_limited() -> None:
    clock = Clock()
    table = ForwardTable(clock, registry_with(("b1", OWN)), state_dir="/nonexistent")
    spec = ForwardSpec("b1", "web", TCPListen(ipaddress.IPv4Address(OWN), 0), TCPTarget(LOOP, 9), 1)
    from bottlenet.forward.table import _ForwardFactory

    fwd = _ForwardFactory(table, spec, table._target_endpoint(spec), table.engine_factory)
    with capturedLogs() as events:
        assert fwd.buildProtocol(None) is not None
        for _ in range(100):
            assert fwd.buildProtocol(None) is None
        clock.advance(1.0)
        assert fwd.buildProtocol(None) is None
    refusals = [e for e in events if "refused" in e.get("log_format", "")]
    assert len(refusals) == 2
    assert refusals[1]["suppressed"] == 99
    assert (fwd.accepted, fwd.refused) == (1, 101)
    for e in refusals:
        assert set(e) >= {"bottle", "label", "max_connections", "suppressed"}


def test_a_closing_forward_refuses_even_when_diverted() -> None:
    """CLOSING: a late connection is refused and logged as "the forward is closing"."""
    from bottlenet.forward.table import ForwardPhase, _ForwardFactory

    table = ForwardTable(Clock(), registry_with(("b1", OWN)), state_dir="/nonexistent")
    spec = ForwardSpec("b1", "web", TCPListen(ipaddress.IPv4Address(OWN), 0), TCPTarget(LOOP, 9))
    fwd = _ForwardFactory(table, spec, table._target_endpoint(spec), table.engine_factory)
    fwd.diverted = Factory.forProtocol(Protocol)
    fwd.phase = ForwardPhase.CLOSING
    with capturedLogs() as events:
        assert fwd.buildProtocol(None) is None
    assert [e["why"] for e in events] == ["the forward is closing"]
    assert (fwd.accepted, fwd.refused) == (0, 1)


class BindTests(unittest.TestCase):
    def setUp(self) -> None:
        self.table = ForwardTable(
            reactor, registry_with(("b1", OWN), ("b2", OTHER)), state_dir=tempdir(self)
        )
        self.table.startService()
        self.addCleanup(self.table.stopService)
        self.alias = ipaddress.IPv4Address(OWN)

    def spec(self, label: str, port: int = 0) -> ForwardSpec:
        return ForwardSpec("b1", label, TCPListen(self.alias, port), TCPTarget(LOOP, 9))

    async def test_duplicate_label_already_exists(self) -> None:
        await self.table.add(self.spec("web"))
        with self.assertRaises(AlreadyExists):
            await self.table.add(self.spec("web"))
        assert [i.spec.label for i in self.table.list()] == ["web"]

    async def test_address_in_use_is_bind_refused_without_traceback(self) -> None:
        squatter = socket.socket()
        self.addCleanup(squatter.close)
        squatter.bind((OWN, 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with self.assertRaises(BindRefused) as cm:
            await self.table.add(self.spec("web", port))
        message = str(cm.exception)
        assert f"{OWN}:{port}" in message and "EADDRINUSE" in message
        assert "Traceback" not in message
        assert self.table.list() == []
        # Nothing half-created: the same label can be added once the port is free.
        squatter.close()
        info = await self.table.add(self.spec("web", port))
        assert info.bound == TCPListen(self.alias, port)

    async def test_list_sorted_and_remove_bottle(self) -> None:
        await self.table.add(self.spec("zeta"))
        await self.table.add(self.spec("alpha"))
        other = ForwardSpec(
            "b2", "web", TCPListen(ipaddress.IPv4Address(OTHER), 0), TCPTarget(LOOP, 9)
        )
        await self.table.add(other)
        keys = [(i.spec.bottle, i.spec.label) for i in self.table.list()]
        assert keys == [("b1", "alpha"), ("b1", "zeta"), ("b2", "web")]
        assert [i.spec.label for i in self.table.list("b2")] == ["web"]
        await self.table.remove_bottle("b1")
        assert [(i.spec.bottle, i.spec.label) for i in self.table.list()] == [("b2", "web")]
        await self.table.remove_bottle("nobody")  # fine: nothing to remove

    async def test_remove_bottle_waits_for_a_removal_already_under_way(self) -> None:
        """A forward being removed blocks its key (Busy) and holds remove_bottle until closed."""
        await self.table.add(self.spec("web"))
        first = self.table.remove("b1", "web")
        assert not first.called  # the listener closes on a later reactor turn
        assert self.table.keys() == []
        waiting = self.table.remove_bottle("b1")
        assert not waiting.called
        with self.assertRaises(Busy):
            await self.table.add(self.spec("web"))
        await first
        assert waiting.called
        await self.table.add(self.spec("web"))
        assert self.table.keys() == [("b1", "web")]

    async def test_the_budget_counts_listening_forwards_and_their_bottles(self) -> None:
        """One listener fd per listening forward, a fair share per bottle that has one."""
        budget = self.table.budget
        await self.table.add(self.spec("web"))
        await self.table.add(self.spec("api"))
        other = TCPListen(ipaddress.IPv4Address(OTHER), 0)
        await self.table.add(ForwardSpec("b2", "web", other, TCPTarget(LOOP, 9)))
        assert (budget._listeners(), budget._bottles()) == (3, 2)
        removing = self.table.remove("b2", "web")
        assert (budget._listeners(), budget._bottles()) == (2, 1)  # closing: listener stopped
        await removing
        await self.table.remove_bottle("b1")
        assert (budget._listeners(), budget._bottles()) == (0, 0)

    async def test_stop_service_removes_everything(self) -> None:
        info = await self.table.add(self.spec("web"))
        assert isinstance(info.bound, TCPListen)
        await self.table.stopService()
        assert self.table.list() == []
        probe = socket.socket()
        self.addCleanup(probe.close)
        assert probe.connect_ex((OWN, info.bound.port)) != 0
        self.table.startService()


def test_bottle_dir_not_owned_refused(tmp_path: Any) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown")
    from bottlenet.forward.spec import unix_listen_for

    state = str(tmp_path)
    listen = unix_listen_for(state, "b1", "agent")
    os.makedirs(os.path.dirname(listen.path), mode=0o700)
    os.chown(os.path.dirname(listen.path), 12345, 12345)
    table = ForwardTable(Clock(), AliasRegistry(POOL), state_dir=state)
    f = failure_of(table.add(ForwardSpec("b1", "agent", listen, TCPTarget(LOOP, 9))))
    assert f.check(InvalidArgument), f
