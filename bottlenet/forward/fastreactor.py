"""An epoll reactor without the per-event logging context (opt-in, Linux only).

Twisted's ``EPollReactor.doPoll`` dispatches every ready descriptor through
``log.callWithLogger``: a ``logPrefix()`` call and a context push/pop around each event, so
that legacy ``twisted.python.log`` messages emitted inside a callback carry the descriptor's
prefix as ``system``. For a relay that is a large share of the Python work per message (the
prototypes measured 7 µs of RTT p50 for it). :class:`QuietEPollReactor` is a subclass that
calls ``_doReadOrWrite`` directly and logs an escaping exception itself. Everything else
(timers, threads, signal handling, readers/writers) is the stock reactor's.

The cost: log events emitted from inside a read/write callback no longer get the
descriptor's log prefix as ``system`` (bottlenet's own events use ``Logger`` namespaces and
structured fields, so its logs do not change). Entry points install it: the standalone
benchmark (``benchmarks/standalone.py --reactor quiet``, its default) and the daemon, whose
plugin options call :func:`install_unless_chosen` so that ``twist bottlenet`` and ``twistd
bottlenet`` run on it without a flag; ``--reactor NAME`` (e.g. ``epoll``, or
``bottlenet-epoll`` through the reactor plugin) still chooses another.
"""

from __future__ import annotations

import errno
import select
import sys
from collections.abc import Callable

from twisted.internet.base import _topHandler
from twisted.internet.epollreactor import EPollReactor
from twisted.internet.posixbase import _NO_FILEDESC
from twisted.logger import Logger
from twisted.python.failure import Failure

_IN_ONLY = getattr(select, "EPOLLIN", 1)
#: The longest epoll timeout Twisted uses (2**31 ms, in seconds).
_LONGEST_WAIT = 2147483.0


class QuietEPollReactor(EPollReactor):
    """``EPollReactor`` whose ``doPoll`` skips ``log.callWithLogger`` per event."""

    _log = Logger(namespace="bottlenet.reactor")

    def __init__(self) -> None:
        super().__init__()
        self._after_batch: list[Callable[[], object]] = []
        self._dispatching = False

    def call_after_batch(self, f: Callable[[], object]) -> bool:
        """Run ``f`` once the events of the current epoll batch are all dispatched.

        Returns False (and does nothing) outside a batch: the caller then uses
        ``callLater(0, f)``. This is what a relay needs to close sockets safely (no stale event
        of the same batch can reach a descriptor that reused the number) without paying for an
        extra reactor iteration per connection.
        """
        if not self._dispatching:
            return False
        self._after_batch.append(f)
        return True

    def forget_until_closed(self, descriptor: object) -> bool:
        """Drop ``descriptor`` from the reactor without an ``epoll_ctl`` call, during a batch.

        Only for a caller that closes the descriptor's fd (its only one: no ``dup``) from a
        :meth:`call_after_batch` call: closing it removes it from the epoll set, and until then
        an event for the fd finds no descriptor and is skipped (so no stale event can reach
        anything, trap 4). Returns False (and does nothing) outside a batch: the caller then
        removes it as usual. Saves two syscalls per relay.
        """
        if not self._dispatching:
            return False
        fileno = descriptor.fileno  # type: ignore[attr-defined]
        fd = fileno()
        if self._selectables.get(fd) is not descriptor:
            return True  # not registered: nothing to drop
        self._reads.discard(fd)
        self._writes.discard(fd)
        del self._selectables[fd]
        return True

    def doPoll(self, timeout: float | None) -> None:
        if timeout is None:
            timeout = -1
        try:
            events = self._poller.poll(timeout, len(self._selectables))
        except OSError as err:
            if err.errno == errno.EINTR:
                return
            raise
        self._dispatching = True
        try:
            self._dispatch(events)
        finally:
            self._dispatching = False
        after = self._after_batch
        while after:
            f = after.pop(0)
            try:
                f()
            except Exception:
                self._log.failure("error in an after-batch call", Failure())

    def _dispatch(self, events: list[tuple[int, int]]) -> None:
        selectables = self._selectables
        drdw = self._doReadOrWrite
        for fd, event in events:
            selectable = selectables.get(fd)
            if selectable is None:
                continue
            try:
                if event == _IN_ONLY:
                    # The common event: readable, no hang-up or error. What _doReadOrWrite
                    # does for it, without its flag tests (same fileno and error handling).
                    try:
                        if selectable.fileno() == -1:
                            why: object = _NO_FILEDESC
                        else:
                            why = selectable.doRead()
                    except BaseException:
                        why = sys.exc_info()[1]
                        self._log.failure(
                            "error in doRead of {selectable!r}", Failure(), selectable=selectable
                        )
                    if why:
                        self._disconnectSelectable(selectable, why, True)
                    continue
                drdw(selectable, fd, event)
            except Exception:
                # _doReadOrWrite catches the descriptor's own errors; this is an error in
                # connectionLost. callWithLogger would log it and carry on: so do we.
                self._log.failure(
                    "error while handling an event on {selectable!r}",
                    Failure(),
                    selectable=selectable,
                )

    doIteration = doPoll

    def mainLoop(self) -> None:
        """``ReactorBase.mainLoop``, minus the timer bookkeeping when no timer is due.

        An iteration with no call from a thread, no new timed call, no stop under way and no
        pending timed call that is due goes straight to epoll, with the time to the first
        pending call as its timeout: ``runUntilCurrent`` and ``timeout`` would only find that
        out, at several method calls per event. Otherwise the iteration is the stock one
        (which also compacts cancelled calls). Errors are handled as the stock loop does.
        """
        poll = self.doPoll
        seconds = self.seconds
        while self._started:
            with _topHandler:
                while self._started:
                    pending = self._pendingTimedCalls
                    if (
                        self.threadCallQueue
                        or self._newTimedCalls
                        or self._justStopped
                        or self._cancellations > 50
                    ):
                        t = None
                        due = True
                    elif pending:
                        t = pending[0].time - seconds()
                        due = t <= 0
                    else:
                        t = None
                        due = False
                    if due:
                        self.runUntilCurrent()
                        t2 = self.timeout()
                        t = self.running and t2
                    elif not self.running:
                        t = 0
                    elif t is not None:
                        t = min(t, _LONGEST_WAIT)
                    poll(t)
        self._log.info("Main loop terminated.")


def install() -> QuietEPollReactor:
    """Install a :class:`QuietEPollReactor` as the global reactor (entry points only)."""
    from twisted.internet.main import installReactor

    reactor = QuietEPollReactor()
    installReactor(reactor)
    return reactor


def install_unless_chosen() -> QuietEPollReactor | None:
    """Install a :class:`QuietEPollReactor` unless a reactor is installed already.

    For the daemon's plugin options (``postOptions``): ``twist`` and ``twistd`` install a
    reactor chosen with ``--reactor`` while parsing their own options, before the plugin's, and
    their default one only after the plugin's options are parsed, by importing
    ``twisted.internet.reactor``, which then returns the one installed here. Returns None (and
    does nothing) when a reactor is installed already or the platform has no epoll.
    """
    if "twisted.internet.reactor" in sys.modules or not hasattr(select, "epoll"):
        return None
    return install()


__all__ = ["QuietEPollReactor", "install", "install_unless_chosen"]
