"""The optional capabilities the data plane probes for are provided where they are declared."""

from __future__ import annotations

import ipaddress

from twisted.internet.task import Clock

from bottlenet.forward.capabilities import (
    BatchingReactor,
    ClosableEngines,
    DetachableTransport,
    ExhaustiblePort,
    FdBudgetedEngines,
    PeerCheckingFactory,
    SocketAcceptingFactory,
    SocketStartingEngine,
    SocketStartingEngines,
)
from bottlenet.forward.connect import HeldClient
from bottlenet.forward.fastreactor import QuietEPollReactor
from bottlenet.forward.listen import BackoffTCPPort, BackoffUNIXPort, HeldTCPServer, HeldUNIXServer
from bottlenet.forward.relay import TransportRelay
from bottlenet.forward.spec import ForwardSpec, TCPListen, TCPTarget, unix_listen_for
from bottlenet.forward.splice import SpliceEngines, SpliceRelay
from bottlenet.forward.table import ForwardTable, _ForwardFactory
from tests.forward.netutil import registry_with

OWN = "127.77.0.2"
LOOP = ipaddress.IPv4Address("127.0.0.1")


def test_the_splice_engines_offer_what_the_table_probes_and_the_portable_one_does_not() -> None:
    """SpliceEngines: socket start, close, fd budget; TransportRelay (a class): none of them."""
    engines = SpliceEngines(Clock())
    for capability in (SocketStartingEngines, ClosableEngines, FdBudgetedEngines):
        assert isinstance(engines, capability)
        assert not isinstance(TransportRelay, capability)
    assert issubclass(SpliceRelay, SocketStartingEngine)
    assert not issubclass(TransportRelay, SocketStartingEngine)


def test_ports_transports_and_the_quiet_reactor_provide_their_declared_extras() -> None:
    """The backoff ports can be told of EMFILE, the held transports detach, the quiet reactor
    batches: the names the probes look for exist on the classes that offer them."""
    for port in (BackoffTCPPort, BackoffUNIXPort):
        assert issubclass(port, ExhaustiblePort)
    for transport in (HeldTCPServer, HeldUNIXServer, HeldClient):
        assert issubclass(transport, DetachableTransport)
    assert issubclass(QuietEPollReactor, BatchingReactor)


def test_a_forward_factory_declares_the_accept_and_peer_hooks_by_listener_kind() -> None:
    """Both hooks are attributes of every forward's factory; admit_peer is set on UNIX only."""
    clock = Clock()
    table = ForwardTable(clock, registry_with(("b1", OWN)), state_dir="/nonexistent")
    tcp = ForwardSpec("b1", "web", TCPListen(ipaddress.IPv4Address(OWN), 0), TCPTarget(LOOP, 9))
    unix = ForwardSpec("b1", "sock", unix_listen_for("/nonexistent", "b1", "sock"), tcp.target)
    for spec in (tcp, unix):
        fwd = _ForwardFactory(table, spec, table._target_endpoint(spec), table.engine_factory)
        assert isinstance(fwd, SocketAcceptingFactory) and isinstance(fwd, PeerCheckingFactory)
        assert (fwd.admit_peer is None) == (spec is tcp)
