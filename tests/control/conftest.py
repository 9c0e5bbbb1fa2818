"""Fixtures shared by the control tests: captured log events and a server connection."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from twisted.logger import LogEvent, globalLogPublisher

from .fakes import Conn


@pytest.fixture
def logs() -> Iterator[list[LogEvent]]:
    """Every event logged while the test runs."""
    events: list[LogEvent] = []
    globalLogPublisher.addObserver(events.append)
    yield events
    globalLogPublisher.removeObserver(events.append)


@pytest.fixture
def conn() -> Iterator[Conn]:
    """A control server protocol over a string transport, with a fake backend."""
    c = Conn()
    yield c
    c.close()
