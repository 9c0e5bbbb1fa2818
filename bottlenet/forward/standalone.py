"""Run only the forward table, for benchmarks and manual tests.

    python -m bottlenet.forward.standalone --listen 127.77.0.1:9000 --to 127.0.0.1:8000

Uses the epoll reactor (by default its quiet subclass, see ``fastreactor``) and the same
:class:`ForwardTable` code path as the daemon (alias registry check, bind, relay; ``--engine``
picks the relay engine). Logs warnings and errors only: no per-connection log lines. This is
the only module of the forward package that installs or imports a global reactor.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
from typing import Any

from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)

from bottlenet.errors import BottlenetError
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import DEFAULT_POOL, AliasPool, ForwardSpec, TCPListen, parse_target


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
        help="connect with Twisted's TCP4ClientEndpoint (implies the portable engine)",
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

    from bottlenet.forward.table import ForwardTable

    _log_warnings_only()
    _raise_nofile()
    try:
        registry, spec = _forward(args)
    except BottlenetError as e:
        print(f"standalone: {e}", file=sys.stderr)
        return 2

    state_dir = tempfile.mkdtemp(prefix="bottlenet-standalone-")
    table = ForwardTable(
        reactor,
        registry,
        state_dir=state_dir,
        engine=args.engine,
        fast_connect=not args.twisted_connect,
    )
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
