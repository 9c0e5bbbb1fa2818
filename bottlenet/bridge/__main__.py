"""``python -m bottlenet.bridge script PORT=PATH ...``: the bridge the daemon runs, by hand.

Prints the exact script the daemon feeds an agent VM for those services. Its first line
says how it is run (``#!/bin/sh``: fed to ``sh -s``); it binds only ``127.0.0.1`` and runs
in the foreground until killed, e.g. ``sh -s < bridge.sh &`` in the guest.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bottlenet.bridge.script import Bridge, render
from bottlenet.errors import BottlenetError
from bottlenet.probe.__main__ import EXIT_BAD_INPUT, _Parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="python -m bottlenet.bridge", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    script = sub.add_parser("script", help="print the bridge script for PORT=PATH services")
    script.add_argument("bridges", nargs="+", metavar="PORT=PATH")
    ns = parser.parse_args(argv)
    try:
        text = render([Bridge.parse(b) for b in ns.bridges])
    except BottlenetError as e:
        sys.stderr.write(f"error: {e.message}\n")
        return EXIT_BAD_INPUT
    sys.stdout.buffer.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
