"""Child process for the EMFILE test: a forward table under a tiny RLIMIT_NOFILE.

argv: target_port nofile. Prints "port N" once listening, then "stats EXHAUSTED" every 0.2 s.
"""

from __future__ import annotations

import ipaddress
import resource
import sys


def main() -> None:
    target_port, nofile = int(sys.argv[1]), int(sys.argv[2])
    from twisted.internet import epollreactor

    epollreactor.install()
    from twisted.internet import reactor, task

    from bottlenet.forward.aliases import AliasRegistry
    from bottlenet.forward.spec import AliasPool, ForwardSpec, TCPListen, TCPTarget
    from bottlenet.forward.table import ForwardTable

    reg = AliasRegistry(AliasPool.parse("127.77.0.0/16"))
    reg.claim("b1", "127.77.0.9")
    # A budget above the tiny fd limit: this test is about the kernel's limit, not ours.
    table = ForwardTable(reactor, reg, state_dir="/nonexistent", max_connections=10_000)
    table.log_clean_relay_ends = False
    spec = ForwardSpec(
        "b1",
        "web",
        TCPListen(ipaddress.IPv4Address("127.77.0.9"), 0),
        TCPTarget(ipaddress.IPv4Address("127.0.0.1"), target_port),
    )

    def listening(info: object) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        port = table.port("b1", "web")
        print(f"port {table.get('b1', 'web').bound.port}", flush=True)  # type: ignore[union-attr]
        task.LoopingCall(
            lambda: print(f"stats {port.exhausted_count}", flush=True)  # type: ignore[union-attr]
        ).start(0.2)

    reactor.callWhenRunning(lambda: table.add(spec).addCallback(listening))  # type: ignore[attr-defined]
    reactor.run()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
