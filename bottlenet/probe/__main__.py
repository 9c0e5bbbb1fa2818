"""``python -m bottlenet.probe script|judge``: the gate's guest script and verdict, by hand.

``script`` prints the exact POSIX sh script the gate would send to a guest for the plan given
by the arguments; run it in any VM (``sh -s < script``) and feed what it prints to ``judge``
with the same arguments. ``judge`` prints PASS, or FAIL and one line per leak, and exits 0
(PASS), 1 (FAIL) or 2 (bad input). Without a host-side witness (the daemon's listener seeing
the nonce), pass ``--witnessed ENDPOINT`` for each own endpoint you saw on the host, or
``--no-witness`` to take the guest's word for its own endpoints.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bottlenet.errors import BottlenetError
from bottlenet.probe.judge import judge
from bottlenet.probe.plan import (
    DEFAULT_DNS_NAME,
    DEFAULT_OUTSIDE,
    MODES,
    ProbePlan,
    Target,
    new_nonce,
)
from bottlenet.probe.script import render

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_BAD_INPUT)


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=MODES, default="socket")
    p.add_argument(
        "--own",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="an endpoint that must connect: tcp:HOST:PORT or unix:PATH",
    )
    p.add_argument(
        "--deny",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="an endpoint that must not connect",
    )
    p.add_argument(
        "--port",
        action="append",
        type=int,
        default=[],
        dest="ports",
        help="a host port that must be closed on every path to the host",
    )
    p.add_argument(
        "--outside",
        default=DEFAULT_OUTSIDE,
        metavar="HOST:PORT",
        help=f"an address outside the host (default {DEFAULT_OUTSIDE})",
    )
    p.add_argument(
        "--dns",
        action="append",
        default=None,
        metavar="NAME",
        help=f"a name that must not resolve (default {DEFAULT_DNS_NAME})",
    )
    p.add_argument(
        "--absent",
        action="append",
        default=[],
        metavar="PATH",
        help="a host file that must not be visible in the guest",
    )
    p.add_argument(
        "--host-id",
        action="append",
        default=[],
        metavar="SHA256",
        help="sha256 of NONCE:VALUE of a host machine-id or hostname",
    )
    p.add_argument(
        "--ro", action="append", default=[], metavar="PATH", help="guest path of a read-only volume"
    )
    p.add_argument(
        "--rw",
        action="append",
        default=[],
        metavar="PATH",
        help="guest path of a read-write volume",
    )
    p.add_argument(
        "--no-witness",
        action="store_true",
        help="do not require a host-side witness of the own endpoints",
    )
    p.add_argument("--nonce", help="the run's nonce (hex; script makes one if omitted)")


def _plan(ns: argparse.Namespace, nonce: str) -> ProbePlan:
    return ProbePlan(
        mode=ns.mode,
        nonce=nonce,
        own=tuple(Target.parse(e) for e in ns.own),
        deny=tuple(Target.parse(e) for e in ns.deny),
        host_ports=tuple(ns.ports),
        outside=ns.outside,
        dns=tuple(ns.dns) if ns.dns is not None else (DEFAULT_DNS_NAME,),
        absent=tuple(ns.absent),
        host_ids=tuple(ns.host_id),
        ro=tuple(ns.ro),
        rw=tuple(ns.rw),
        witness=not ns.no_witness,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="python -m bottlenet.probe", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    script = sub.add_parser("script", help="print the guest script for a plan")
    _plan_args(script)
    verdict = sub.add_parser("judge", help="judge a guest transcript (stdin) for a plan")
    _plan_args(verdict)
    verdict.add_argument(
        "--witnessed",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="an own endpoint whose host listener saw the nonce",
    )
    verdict.add_argument(
        "--exit-code",
        type=int,
        default=None,
        help="the script's exit status in the guest, if known",
    )
    ns = parser.parse_args(argv)
    try:
        if ns.command == "script":
            nonce = ns.nonce or new_nonce()
            if ns.nonce is None:
                sys.stderr.write(f"nonce: {nonce}\n")
            sys.stdout.buffer.write(render(_plan(ns, nonce)))
            return 0
        if not ns.nonce:
            sys.stderr.write("error: judge needs --nonce (the one the script was made with)\n")
            return EXIT_BAD_INPUT
        plan = _plan(ns, ns.nonce)
        witnessed = [str(Target.parse(e)) for e in ns.witnessed]
    except BottlenetError as e:
        sys.stderr.write(f"error: {e.message}\n")
        return EXIT_BAD_INPUT
    try:
        data = sys.stdin.buffer.read()
    except OSError as e:
        sys.stderr.write(f"error: cannot read the transcript: {e.strerror}\n")
        return EXIT_BAD_INPUT
    v = judge(
        plan,
        data,
        exit_code=ns.exit_code,
        witnessed=None if ns.no_witness else witnessed,
    )
    sys.stdout.write("\n".join(v.lines()) + "\n")
    return 0 if v.passed else 1


if __name__ == "__main__":
    sys.exit(main())
