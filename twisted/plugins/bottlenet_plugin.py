"""twistd/twist plugin for bottlenet: only a lazy ServiceMaker, no heavy imports."""

from __future__ import annotations

from twisted.application.service import ServiceMaker

bottlenet = ServiceMaker(
    "bottlenet",
    "bottlenet.tap",
    "Host daemon for bottles: agent-endpoint forwarders, smolvm driver, AMP control socket.",
    "bottlenet",
)
