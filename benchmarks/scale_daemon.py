"""Run the real daemon (``python -m twisted ARGS``) with a chosen relay engine.

The engine comes from ``BOTTLENET_RELAY_ENGINE`` (auto/splice/portable) and is passed to the
daemon as its ``--relay-engine`` option. Benchmark tooling only.
"""

from __future__ import annotations

import os
import sys

from twisted.application.twist._twist import Twist

if __name__ == "__main__":
    argv = list(sys.argv[1:])
    engine = os.environ.get("BOTTLENET_RELAY_ENGINE", "auto")
    if "bottlenet" in argv and "--relay-engine" not in argv:
        at = argv.index("bottlenet") + 1
        argv[at:at] = ["--relay-engine", engine]
    Twist.main([sys.argv[0], *argv])
