"""``python -m bottlenet.transparent ...``: the layer by hand (``layer.main``), or
``script --proxy PATH`` for the sh script the daemon feeds an image's python3."""

from __future__ import annotations

import sys

from bottlenet.transparent.layer import main

if __name__ == "__main__":
    sys.exit(main())
