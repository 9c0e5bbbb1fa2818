"""QuietEPollReactor dispatches events like EPollReactor, minus the logging context."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from twisted.internet import epollreactor, error
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure

from bottlenet.forward.fastreactor import QuietEPollReactor


class PipeReader:
    def __init__(self, fd: int, fail_on_lost: bool = False) -> None:
        self.fd = fd
        self.reads: list[bytes] = []
        self.lost: list[Failure] = []
        self.fail_on_lost = fail_on_lost

    def fileno(self) -> int:
        return self.fd

    def logPrefix(self) -> str:
        return "test"

    def doRead(self) -> object:
        data = os.read(self.fd, 100)
        self.reads.append(data)
        return None if data else error.ConnectionDone()

    def connectionLost(self, reason: Failure) -> None:
        self.lost.append(reason)
        if self.fail_on_lost:
            raise RuntimeError("broken connectionLost")


@pytest.fixture
def r() -> Iterator[Any]:
    reactor = QuietEPollReactor()
    yield reactor
    reactor.removeAll()


def test_is_an_epoll_reactor_without_call_with_logger(r: Any) -> None:
    assert isinstance(r, epollreactor.EPollReactor)
    assert type(r).doIteration is QuietEPollReactor.doPoll


def test_dispatches_reads_and_disconnects(r: Any) -> None:
    rd, wr = os.pipe()
    reader = PipeReader(rd)
    r.addReader(reader)
    os.write(wr, b"abc")
    r.doIteration(0)
    assert reader.reads == [b"abc"]
    os.close(wr)
    r.doIteration(0)
    assert reader.lost and reader.lost[0].check(error.ConnectionDone)
    assert reader not in r.getReaders()
    os.close(rd)


def test_an_error_in_one_callback_does_not_stop_the_batch(r: Any) -> None:
    fds = [os.pipe() for _ in range(2)]
    bad = PipeReader(fds[0][0], fail_on_lost=True)
    good = PipeReader(fds[1][0])
    r.addReader(bad)
    r.addReader(good)
    os.close(fds[0][1])  # bad sees EOF and raises from connectionLost
    os.write(fds[1][1], b"ok")
    events: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(events.append)
    try:
        r.doIteration(0)
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert bad.lost and good.reads == [b"ok"]
    assert any(e.get("log_failure") is not None for e in events)  # logged, not raised
    r.removeReader(good)
    for rd, wr in fds:
        os.close(rd)
        if wr != fds[0][1]:
            os.close(wr)


def test_call_after_batch_runs_once_the_whole_batch_is_dispatched(r: Any) -> None:
    order: list[str] = []
    pipes = [os.pipe() for _ in range(2)]

    class Reader(PipeReader):
        def doRead(self) -> object:
            order.append(f"read{self.fd}")
            assert r.call_after_batch(lambda: order.append(f"after{self.fd}"))
            os.read(self.fd, 100)
            return None

    readers = [Reader(rd) for rd, _ in pipes]
    for reader in readers:
        r.addReader(reader)
    for _, wr in pipes:
        os.write(wr, b"x")
    r.doIteration(0)
    assert sorted(order[:2]) == sorted(f"read{rd}" for rd, _ in pipes)
    assert sorted(order[2:]) == sorted(f"after{rd}" for rd, _ in pipes)
    assert r.call_after_batch(lambda: None) is False  # outside a batch: use callLater
    for reader in readers:
        r.removeReader(reader)
    for rd, wr in pipes:
        os.close(rd)
        os.close(wr)
