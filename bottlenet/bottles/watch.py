"""Notice cheaply when a recorded VM process exits: no smolvm polling at all.

On Linux a pidfd (``os.pidfd_open``) is registered with the reactor as a reader; it becomes
readable when the process exits, so the daemon is woken exactly once. Elsewhere (or when the
reactor cannot watch a pidfd) a slow timer checks the pid with ``os.kill(pid, 0)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IReadDescriptor
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from vmctl.ports import pid_alive

FALLBACK_INTERVAL = 5.0

__all__ = ["PidWatcher", "Watch", "pid_alive"]


@implementer(IReadDescriptor)
class _PidfdReader:
    def __init__(self, fd: int, on_exit: Callable[[], None]) -> None:
        self.fd = fd
        self.on_exit = on_exit

    def fileno(self) -> int:
        return self.fd

    def doRead(self) -> None:
        self.on_exit()

    def connectionLost(self, reason: Failure) -> None:
        pass

    def logPrefix(self) -> str:
        return "pidfd"


class Watch:
    """One watched pid; ``cancel()`` stops watching (idempotent)."""

    def __init__(self, stop: Callable[[], None]) -> None:
        self._stop: Callable[[], None] | None = stop

    def cancel(self) -> None:
        stop, self._stop = self._stop, None
        if stop is not None:
            stop()

    @property
    def active(self) -> bool:
        return self._stop is not None


class PidWatcher:
    """Calls ``on_exit()`` once when ``pid`` exits (immediately, soon, if it already has)."""

    log = Logger()

    def __init__(self, reactor: Any, *, interval: float = FALLBACK_INTERVAL) -> None:
        self.reactor = reactor
        self.interval = interval

    def watch(self, pid: int, on_exit: Callable[[], None]) -> Watch:
        fired = False

        def fire() -> None:
            nonlocal fired
            if fired:
                return
            fired = True
            watch.cancel()
            on_exit()

        pidfd = getattr(os, "pidfd_open", None)
        if pidfd is not None and hasattr(self.reactor, "addReader"):
            try:
                fd = pidfd(pid)
            except ProcessLookupError:
                watch = Watch(lambda: None)
                self.reactor.callLater(0, fire)
                return watch
            except OSError:
                fd = -1
            if fd >= 0:
                reader = _PidfdReader(fd, fire)

                def stop_reader() -> None:
                    self.reactor.removeReader(reader)
                    os.close(fd)

                watch = Watch(stop_reader)
                try:
                    self.reactor.addReader(reader)
                    return watch
                except Exception:  # a reactor that cannot poll this fd: use the timer
                    os.close(fd)
        loop = LoopingCall(lambda: None if pid_alive(pid) else fire())
        loop.clock = self.reactor
        watch = Watch(lambda: loop.stop() if loop.running else None)
        loop.start(self.interval, now=False)
        return watch
