"""QuietEPollReactor dispatches events like EPollReactor, minus the logging context."""

from __future__ import annotations

import os
import threading
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


def test_main_loop_skips_timer_bookkeeping_until_a_timer_is_due() -> None:
    """Events with no due timer go straight to epoll; timers, thread calls and stop still work."""
    r = QuietEPollReactor()
    rounds = {"bookkeeping": 0, "reads": 0}
    stock = r.runUntilCurrent

    def counted() -> None:
        rounds["bookkeeping"] += 1
        stock()

    r.runUntilCurrent = counted  # type: ignore[method-assign]
    rd, wr = os.pipe()
    fired: list[str] = []

    class PingPong(PipeReader):
        def doRead(self) -> object:
            os.read(self.fd, 1)
            rounds["reads"] += 1
            if rounds["reads"] < 300:
                os.write(wr, b"x")  # the next event: one iteration each
            else:
                r.callLater(0.01, timer)
            return None

    def timer() -> None:
        fired.append("timer")
        threading.Thread(target=r.callFromThread, args=(from_thread,)).start()

    def from_thread() -> None:
        fired.append("thread")
        r.stop()

    r.callLater(3600, fired.append, "far")  # pending all along, never due
    reader = PingPong(rd)
    r.addReader(reader)
    r.callWhenRunning(os.write, wr, b"x")
    r.run(installSignalHandlers=False)
    assert fired == ["timer", "thread"]
    assert rounds["reads"] == 300
    # A handful of iterations had something due (start, the timer, the thread call, stop),
    # not the 300 with only an event.
    assert rounds["bookkeeping"] < 30
    os.close(rd)
    os.close(wr)


def test_forget_until_closed_only_inside_a_batch(r: Any) -> None:
    rd, wr = os.pipe()
    reader = PipeReader(rd)
    r.addReader(reader)
    assert r.forget_until_closed(reader) is False  # outside a batch: nothing done
    assert reader in r.getReaders()
    seen: list[bool] = []

    class Forgetter(PipeReader):
        def doRead(self) -> object:
            os.read(self.fd, 1)
            seen.append(r.forget_until_closed(self))
            assert r.call_after_batch(lambda: os.close(self.fd))
            return None

    r.removeReader(reader)
    forgetter = Forgetter(rd)
    r.addReader(forgetter)
    os.write(wr, b"xx")  # still readable after the first byte (level-triggered)
    r.doIteration(0)
    assert seen == [True]
    assert forgetter not in r.getReaders()
    r.doIteration(0)  # closed: the kernel dropped it from the epoll set; no event, no error
    assert seen == [True]
    os.close(wr)
