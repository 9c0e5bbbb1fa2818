"""Reactor plugin: ``twist --reactor bottlenet-epoll`` (epoll without a log context per event)."""

from __future__ import annotations

from twisted.application.reactors import Reactor

bottlenet_epoll = Reactor(
    "bottlenet-epoll",
    "bottlenet.forward.fastreactor",
    "epoll reactor without a log context per event (bottlenet's relay fast path).",
)
