"""systemd readiness notification (``sd_notify``) without a dependency.

Twisted only parses ``LISTEN_FDS``; it has no ``sd_notify``. The protocol is one datagram of
``KEY=VALUE`` lines sent to the ``AF_UNIX`` socket named by ``$NOTIFY_SOCKET`` (a leading ``@``
means the Linux abstract namespace). Outside systemd the variable is unset and every call here
is a cheap no-op, so the daemon calls these unconditionally.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.logger import Logger

log = Logger(namespace="bottlenet.ops.sdnotify")


def _clean(text: str) -> str:
    # A STATUS= value is one line: a newline would start a new (forged) assignment.
    return "".join(c if c.isprintable() else " " for c in text)


def notify(message: str, env: Mapping[str, str] = os.environ) -> bool:
    """Send ``message`` to ``$NOTIFY_SOCKET``; False if unset or the send failed.

    Never blocks and never raises: readiness is advisory, the daemon must not die of it.
    """
    address = env.get("NOTIFY_SOCKET")
    if not address or address[0] not in "/@":
        return False
    if address[0] == "@":
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.sendto(message.encode("utf-8"), address)
    except OSError as e:
        log.warn("sd_notify failed: {error}", error=e.strerror or type(e).__name__)
        return False
    return True


def ready(status: str | None = None, env: Mapping[str, str] = os.environ) -> bool:
    """``READY=1`` (plus ``STATUS=``): the control socket and restored listeners are up."""
    message = "READY=1" if status is None else f"READY=1\nSTATUS={_clean(status)}"
    return notify(message, env)


def stopping(env: Mapping[str, str] = os.environ) -> bool:
    """``STOPPING=1``: shutdown has begun (systemd then expects the main process to exit)."""
    return notify("STOPPING=1", env)


def status(text: str, env: Mapping[str, str] = os.environ) -> bool:
    """``STATUS=...``: a one-line state shown by ``systemctl status``."""
    return notify(f"STATUS={_clean(text)}", env)


class SystemdNotifier(Service):
    """Sends ``READY=1`` when ``when_ready`` fires and ``STOPPING=1`` when stopped.

    Add it to the root service **last**: ``MultiService`` stops children in reverse order,
    so this one stops first and systemd hears ``STOPPING=1`` before the slow part of the
    shutdown (draining relays, stopping VMs) begins. If ``when_ready`` fails, nothing is
    sent: the caller's own fatal path stops the daemon and systemd sees the start fail.
    """

    def __init__(
        self,
        when_ready: Deferred[Any],
        status: str | Callable[[], str] = "ready",
        env: Mapping[str, str] = os.environ,
    ) -> None:
        self._when_ready = when_ready
        self._status = status
        self._env = env
        self.sent: list[str] = []  # what was sent, for tests and debugging

    def startService(self) -> None:
        super().startService()
        # Observe without changing the result: the Deferred belongs to the caller.
        self._when_ready.addCallback(self._ready)

    def _ready(self, result: object) -> object:
        if self.running:
            # a callable is asked now: what was restored is known only once recovery is done
            status = self._status if isinstance(self._status, str) else self._status()
            ready(status, self._env)
            self.sent.append("READY=1")
            log.info("ready: {status}", status=status)
        return result

    def stopService(self) -> None:
        if self.running:
            stopping(self._env)
            self.sent.append("STOPPING=1")
        super().stopService()
