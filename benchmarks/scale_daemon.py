"""Run the real daemon (``python -m twisted ARGS``) with a chosen relay engine.

Until ``twist bottlenet`` has its own ``--relay-engine`` option, the engine comes from
``BOTTLENET_RELAY_ENGINE`` (auto/splice/portable): this launcher binds it into the
``ForwardTable`` that ``bottlenet.tap`` builds. Benchmark tooling only.
"""

from __future__ import annotations

import functools
import os
import sys

from twisted.application.twist._twist import Twist

import bottlenet.tap
from bottlenet.forward.table import ForwardTable

engine = os.environ.get("BOTTLENET_RELAY_ENGINE", "auto")
bottlenet.tap.ForwardTable = functools.partial(ForwardTable, engine=engine)  # type: ignore[misc]

if __name__ == "__main__":
    Twist.main([sys.argv[0], *sys.argv[1:]])
