"""``python -m bottlenet.cli``: what the ``bottlenetctl`` console script runs."""

from __future__ import annotations

import sys

from bottlenet.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
