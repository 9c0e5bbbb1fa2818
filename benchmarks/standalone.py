"""Run only the forward table, for benchmarks and manual tests (benchmark tooling only).

    python3 benchmarks/standalone.py --listen 127.77.0.1:9000 --to 127.0.0.1:8000

Uses the epoll reactor (by default its quiet subclass, see ``fastreactor``) and the same
:class:`ForwardTable` code path as the daemon (alias registry check, bind, relay; ``--engine``
picks the relay engine). Logs warnings and errors only: no per-connection log lines.

``--twisted-connect`` connects through Twisted's own client endpoints instead of the daemon's
``connect.FastClientEndpoint`` (:class:`TwistedConnectTable`): the "previous state" row of
docs/performance.md, kept here to measure against. It is no daemon option: the fast endpoint
needs only a reactor with ``IReactorFDSet`` and a non-blocking socket, which every platform
bottlenet runs on (Linux, macOS) has, so the wheel does not ship this path.
"""

from __future__ import annotations

import argparse
import ipaddress
import resource
import socket
import sys
import tempfile
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP6ClientEndpoint, UNIXClientEndpoint
from twisted.internet.interfaces import IProtocol, IProtocolFactory, IStreamClientEndpoint
from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)
from zope.interface import implementer

from bottlenet.errors import BottlenetError
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import (
    DEFAULT_POOL,
    AliasPool,
    ForwardSpec,
    TargetSpec,
    TCPListen,
    UNIXTarget,
    parse_target,
)
from bottlenet.forward.table import ForwardTable


@implementer(IStreamClientEndpoint)
class _Tuned:
    """A Twisted client endpoint whose TCP sockets get TCP_NODELAY and keepalive once
    connected (the fast endpoint sets both before connecting; accepted sockets inherit them)."""

    def __init__(self, endpoint: IStreamClientEndpoint) -> None:
        self._endpoint = endpoint

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[IProtocol]:
        return self._endpoint.connect(protocolFactory).addCallback(_tune)


def _tune(protocol: IProtocol) -> IProtocol:
    sock = protocol.transport.getHandle()  # type: ignore[attr-defined]
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return protocol


class TwistedConnectTable(ForwardTable):
    """The forward table connecting through ``TCP4ClientEndpoint``/``TCP6ClientEndpoint``/
    ``UNIXClientEndpoint``. Their transports cannot hand a socket over, so relays run on the
    portable engine whatever ``engine`` says."""

    def client_endpoint(self, target: TargetSpec) -> IStreamClientEndpoint:
        timeout = self.connect_timeout
        if isinstance(target, UNIXTarget):
            return UNIXClientEndpoint(self.reactor, target.path, timeout=timeout)
        if isinstance(target.host, ipaddress.IPv6Address):
            tcp6 = TCP6ClientEndpoint(self.reactor, str(target.host), target.port, timeout)
            return _Tuned(tcp6)
        return _Tuned(TCP4ClientEndpoint(self.reactor, str(target.host), target.port, timeout))


def _raise_nofile() -> None:
    """Lift the soft fd limit to the hard one (two fds per relay)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--listen", required=True, help="ALIAS:PORT (an alias of the pool)")
    parser.add_argument("--to", required=True, help="target HOST:PORT (loopback literal)")
    parser.add_argument("--alias-pool", default=DEFAULT_POOL)
    parser.add_argument("--max-connections", type=int, default=16384)
    parser.add_argument("--bottle", default="bench")
    parser.add_argument("--label", default="fwd")
    parser.add_argument(
        "--engine", choices=("auto", "splice", "portable"), default="auto", help="relay engine"
    )
    parser.add_argument(
        "--reactor",
        choices=("quiet", "epoll"),
        default="quiet",
        help="quiet = fastreactor.QuietEPollReactor (no logging context per event)",
    )
    parser.add_argument(
        "--twisted-connect",
        action="store_true",
        help="connect with Twisted's TCP4ClientEndpoint (implies the portable engine; "
        "the daemon always uses the fast endpoint)",
    )
    return parser


def _install_reactor(which: str) -> Any:
    """Install the chosen epoll reactor (before anything imports one) and return it."""
    if which == "quiet":
        from bottlenet.forward import fastreactor

        fastreactor.install()
    else:
        from twisted.internet import epollreactor

        epollreactor.install()
    from twisted.internet import reactor

    return reactor


def _log_warnings_only() -> None:
    globalLogBeginner.beginLoggingTo(
        [
            FilteringLogObserver(
                textFileLogObserver(sys.stderr),
                [LogLevelFilterPredicate(defaultLogLevel=LogLevel.warn)],
            )
        ],
        redirectStandardIO=False,
    )


def _forward(args: argparse.Namespace) -> tuple[AliasRegistry, ForwardSpec]:
    """The alias registry and the one forward the arguments name (BottlenetError if bad)."""
    pool = AliasPool.parse(args.alias_pool)
    host, _, port_text = args.listen.rpartition(":")
    registry = AliasRegistry(pool)
    alias = registry.claim(args.bottle, host)
    if not port_text.isdigit():
        raise SystemExit(f"--listen: bad port in {args.listen!r}")
    spec = ForwardSpec(
        args.bottle,
        args.label,
        TCPListen(alias, int(port_text)),
        parse_target(args.to),
        max_connections=args.max_connections,
    )
    return registry, spec


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    reactor = _install_reactor(args.reactor)
    _log_warnings_only()
    _raise_nofile()
    try:
        registry, spec = _forward(args)
    except BottlenetError as e:
        print(f"standalone: {e}", file=sys.stderr)
        return 2

    state_dir = tempfile.mkdtemp(prefix="bottlenet-standalone-")
    table_class = TwistedConnectTable if args.twisted_connect else ForwardTable
    table = table_class(reactor, registry, state_dir=state_dir, engine=args.engine)
    table.log_clean_relay_ends = False
    table.startService()
    reactor.addSystemEventTrigger("before", "shutdown", table.stopService)
    status = {"code": 0}

    def ready(info: object) -> None:
        print(f"standalone: forwarding {table.list()[0].bound.describe()} -> {args.to}", flush=True)

    def failed(f: object) -> None:
        print(f"standalone: {getattr(f, 'value', f)}", file=sys.stderr, flush=True)
        status["code"] = 1
        reactor.stop()

    reactor.callWhenRunning(lambda: table.add(spec).addCallbacks(ready, failed))
    reactor.run()
    return status["code"]


if __name__ == "__main__":
    sys.exit(main())
