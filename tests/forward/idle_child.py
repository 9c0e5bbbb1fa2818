"""Child process for the idle test: forwards and idle relays on a reactor that counts wakeups.

argv: engine. Prints "ready PORT..." once its forwards listen; then on each stdin line
"count" prints "polls N" (how many times the reactor has returned from epoll_wait).
"""

from __future__ import annotations

import ipaddress
import sys
from typing import Any

from bottlenet.forward.fastreactor import QuietEPollReactor

ALIASES = [f"127.77.1.{i}" for i in range(1, 5)]


class CountingReactor(QuietEPollReactor):
    """Counts every reactor iteration, i.e. every return from epoll_wait."""

    polls = 0

    def doIteration(self, timeout: float | None) -> None:
        self.polls += 1
        super().doIteration(timeout)


def main() -> None:
    engine = sys.argv[1]
    from twisted.internet.main import installReactor

    reactor: Any = CountingReactor()
    installReactor(reactor)
    from twisted.internet import defer, stdio
    from twisted.protocols.basic import LineReceiver

    from bottlenet.forward.aliases import AliasRegistry
    from bottlenet.forward.spec import AliasPool, ForwardSpec, TCPListen, TCPTarget
    from bottlenet.forward.table import ForwardTable
    from tests.forward.netutil import Echo, factory_of

    reg = AliasRegistry(AliasPool.parse("127.77.0.0/16"))
    table = ForwardTable(reactor, reg, state_dir="/nonexistent", engine=engine)
    table.log_clean_relay_ends = False
    table.startService()
    target = reactor.listenTCP(0, factory_of(Echo), interface="127.0.0.1")

    class Commands(LineReceiver):
        delimiter = b"\n"

        def lineReceived(self, line: bytes) -> None:
            if line == b"count":
                self.sendLine(f"polls {reactor.polls}".encode())

    async def setup() -> None:
        ports = []
        for i, alias in enumerate(ALIASES):
            reg.claim(f"b{i}", alias)
            spec = ForwardSpec(
                f"b{i}",
                "web",
                TCPListen(ipaddress.IPv4Address(alias), 0),
                TCPTarget(ipaddress.IPv4Address("127.0.0.1"), target.getHost().port),
            )
            info = await table.add(spec)
            ports.append(str(info.bound.port))  # type: ignore[union-attr]
        stdio.StandardIO(Commands(), reactor=reactor)
        print("ready " + " ".join(ports), flush=True)

    reactor.callWhenRunning(lambda: defer.Deferred.fromCoroutine(setup()))
    reactor.run()


if __name__ == "__main__":
    main()
