"""Stopping the daemon on an error it must not run on with (no socket, half a config)."""

from __future__ import annotations

import os
import sys
from typing import Any

from twisted.logger import Logger

log = Logger(namespace="bottlenet.ops.fatal")


def _exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def fatal_stop(reactor: Any, message: str, code: int = 1) -> None:
    """Log ``message`` as one line, stop the reactor, and exit with ``code`` after shutdown.

    twistd and twist always exit 0 once the reactor stops, so the status is set from an
    "after shutdown" trigger, once every service has stopped and released what it held.

    Logged at ``error``, not ``critical``: ``twist`` starts the services before its log
    begins, and until then Twisted copies every critical event to stderr, which would print
    the line a second time next to the ``bottlenet: error:`` one written here.
    """
    log.error("fatal: {message}", message=message)
    # twist/twistd redirect sys.stderr into the log once running: write to the real fd 2.
    try:
        os.write(2, f"bottlenet: error: {message}\n".encode("utf-8", "replace"))
    except OSError:
        pass
    reactor.addSystemEventTrigger("after", "shutdown", _exit, code)
    if reactor.running:
        reactor.stop()
    else:
        reactor.callWhenRunning(reactor.stop)


class FatalStopper:
    """:func:`fatal_stop` bound to ``reactor``: the ``on_fatal`` every listener is given.

    ``stopping`` says a fatal stop is under way, so the start that is still running starts
    nothing more and logs no start-up advice for a daemon that will not run (newcomer-3 trap
    15: a VM warning after the one error line). Only the first message stops the daemon.
    """

    def __init__(self, reactor: Any, code: int = 1) -> None:
        self.reactor = reactor
        self.code = code
        self.stopping = False

    def __call__(self, message: str) -> None:
        if self.stopping:
            log.error("fatal: {message}", message=message)
            return
        self.stopping = True
        fatal_stop(self.reactor, message, self.code)


def fatal_stopper(reactor: Any, code: int = 1) -> FatalStopper:
    """The ``on_fatal`` of a daemon on ``reactor`` (:class:`FatalStopper`)."""
    return FatalStopper(reactor, code)
