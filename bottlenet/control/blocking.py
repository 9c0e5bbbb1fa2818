"""A blocking control client for launchers that run no reactor.

Plain ``socket`` (AF_UNIX), socket timeouts, the same Command definitions and the same
bounded box parser as the daemon; ``_error`` boxes come back as the typed exceptions of
:mod:`bottlenet.errors` (by code).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from twisted.protocols import amp

from bottlenet import __version__
from bottlenet.control import codec
from bottlenet.control import commands as C
from bottlenet.control.framing import BoxParser, FramingError
from bottlenet.control.records import BottleRecord, ForwardRecord, StatsRecord
from bottlenet.control.results import AgentEndpoint, HelloResult, Page

CLIENT_VERSION = f"bottlenet-blocking/{__version__}"


class ControlConnectionError(Exception):
    """The daemon could not be reached, or the connection broke mid-call."""


class DaemonUnreachable(ControlConnectionError):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot reach the bottlenet daemon at {path}: {reason}")
        self.path = path
        self.reason = reason


class BlockingControlClient:
    """One connection to the control socket; use as a context manager."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._parser = BoxParser()
        self._tag = 0

    def connect(self) -> BlockingControlClient:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except TimeoutError:
            sock.close()
            raise DaemonUnreachable(self.path, "timed out") from None
        except OSError as e:
            sock.close()
            raise DaemonUnreachable(self.path, e.strerror or type(e).__name__) from None
        self._sock = sock
        return self

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> BlockingControlClient:
        if self._sock is None:
            self.connect()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def call(self, command: type[amp.Command], **arguments: Any) -> dict[str, Any]:
        """Send one command and wait for its answer (or raise its typed error)."""
        if self._sock is None:
            self.connect()
        assert self._sock is not None
        self._tag += 1
        tag = b"%x" % self._tag
        data = codec.encode_request(command, tag, arguments)
        try:
            self._sock.sendall(data)
            while True:
                box = self._parser.next_box()
                if box is None:
                    chunk = self._sock.recv(65536)
                    if not chunk:
                        raise ControlConnectionError("the daemon closed the connection")
                    self._parser.feed(chunk)
                    continue
                if box.get(amp.ANSWER, box.get(amp.ERROR)) == tag:
                    return codec.decode_answer(command, box)
        except TimeoutError:
            self.close()
            raise ControlConnectionError(f"no answer within {self.timeout}s") from None
        except FramingError as e:
            self.close()
            raise ControlConnectionError(f"bad answer from the daemon: {e}") from None
        except OSError as e:
            self.close()
            raise ControlConnectionError(f"connection failed: {e.strerror}") from None

    # -- one typed method per command ---------------------------------------------------

    def hello(self, client_version: str = CLIENT_VERSION) -> HelloResult:
        answer = self.call(
            C.Hello, client_version=client_version, protocols=list(C.SUPPORTED_PROTOCOLS)
        )
        return HelloResult.from_answer(answer)

    def ping(self) -> None:
        self.call(C.Ping)

    def create_bottle(
        self, name: str, alias: str | None = None, spec: str | None = None
    ) -> BottleRecord:
        """``spec`` is the bottle spec as JSON text (None: a forward-only bottle)."""
        answer = self.call(C.CreateBottle, name=name, alias=alias, spec=spec)
        bottle: BottleRecord = answer["bottle"]
        return bottle

    def verify_bottle(self, name: str) -> tuple[BottleRecord, str]:
        answer = self.call(C.VerifyBottle, name=name)
        return answer["bottle"], answer["result"]

    def set_egress_policy(self, bottle: str, hosts: list[str]) -> tuple[str, ...]:
        answer = self.call(C.SetEgressPolicy, bottle=bottle, allow_hosts=list(hosts))
        return tuple(answer["allow_hosts"])

    def destroy_bottle(self, name: str) -> None:
        self.call(C.DestroyBottle, name=name)

    def list_bottles(self, offset: int = 0, limit: int | None = None) -> Page[BottleRecord]:
        answer = self.call(C.ListBottles, offset=offset, limit=limit)
        return Page.from_answer(answer, "bottles")

    def bottle_status(self, name: str) -> BottleRecord:
        bottle: BottleRecord = self.call(C.BottleStatus, name=name)["bottle"]
        return bottle

    def add_forward(self, bottle: str, label: str, target: str, port: int = 0) -> AgentEndpoint:
        answer = self.call(C.AddForward, bottle=bottle, label=label, target=target, port=port)
        return AgentEndpoint.from_answer(answer)

    def remove_forward(self, bottle: str, label: str) -> None:
        self.call(C.RemoveForward, bottle=bottle, label=label)

    def list_forwards(
        self, bottle: str | None = None, offset: int = 0, limit: int | None = None
    ) -> Page[ForwardRecord]:
        answer = self.call(C.ListForwards, bottle=bottle, offset=offset, limit=limit)
        return Page.from_answer(answer, "forwards")

    def stats(
        self, bottle: str | None = None, offset: int = 0, limit: int | None = None
    ) -> Page[StatsRecord]:
        answer = self.call(C.Stats, bottle=bottle, offset=offset, limit=limit)
        return Page.from_answer(answer, "stats")

    # -- every page ----------------------------------------------------------------------

    def all_bottles(self) -> Iterator[BottleRecord]:
        offset: int | None = 0
        while offset is not None:
            page = self.list_bottles(offset)
            yield from page.items
            offset = page.next_offset

    def all_forwards(self, bottle: str | None = None) -> Iterator[ForwardRecord]:
        offset: int | None = 0
        while offset is not None:
            page = self.list_forwards(bottle, offset)
            yield from page.items
            offset = page.next_offset

    def all_stats(self, bottle: str | None = None) -> Iterator[StatsRecord]:
        offset: int | None = 0
        while offset is not None:
            page = self.stats(bottle, offset)
            yield from page.items
            offset = page.next_offset
