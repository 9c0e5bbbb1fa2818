"""bottlenet: the host daemon that runs, wires and isolates bottles (agent VM + sidecar VM)."""

from __future__ import annotations

__version__ = "0.1.0"
