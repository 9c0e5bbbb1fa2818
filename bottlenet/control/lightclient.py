"""A small blocking client for the simple calls on the UNIX control socket, without Twisted.

``bottlenetctl status``, ``ping`` and ``bottle ls`` are what a launcher and a person call most;
importing AMP (and through it Twisted's TLS and Deferreds) costs several times more than the
call itself. This client speaks the same AMP boxes for a few commands (Hello, Ping,
ListBottles, NodeInfo, and Exec, after which the connection carries exec frames), from a small
table of their argument kinds; ``tests/control/test_lightclient.py`` checks that table against
the Command definitions of :mod:`bottlenet.control.commands` and the bytes against
:mod:`bottlenet.control.codec`, so the wire format stays one. Everything else (TLS, events,
mutating calls) goes through :class:`~bottlenet.control.blocking.BlockingControlClient`.

It does not grow: each command here is a mirror kept by hand, so its callers run
``call(calls.x(...))`` (as AMP's one ``callRemote``) and it has no named method but
``hello`` (its own version); the same test pins its command set and its methods.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from enum import StrEnum
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from bottlenet import __version__
from bottlenet.control import calls
from bottlenet.control.calls import VM_TIMEOUT, Call, ExecOpener, ExecRequest, presenting
from bottlenet.control.clienterrors import (
    ControlConnectionError,
    DaemonUnreachable,
    broken,
    error_for,
)
from bottlenet.control.framing import BoxParser, FramingError, encode_box
from bottlenet.control.results import BottleRow, HelloResult, PoolRow, record_objects
from bottlenet.errors import ALL_ERRORS, BottlenetError

if TYPE_CHECKING:  # imported by open_exec: status and ls need no exec machinery (nor ssl)
    from bottlenet.control.execsession import ExecSession

T = TypeVar("T")
CLIENT_VERSION = f"bottlenet-light/{__version__}"
_ERRORS: dict[str, type[BottlenetError]] = {e.code: e for e in ALL_ERRORS}


class Kind(StrEnum):
    """How one AMP argument is written (the subset the light commands use)."""

    UNICODE = "unicode"
    INTEGER = "integer"
    BOOLEAN = "boolean"
    UNICODE_LIST = "unicode-list"
    INTEGER_LIST = "integer-list"
    BOTTLE_RECORDS = "bottle-records"
    POOL_RECORDS = "pool-records"


#: name -> (arguments, response), each ``{key: (kind, optional)}``.
Schema = dict[str, tuple[Kind, bool]]
COMMANDS: dict[str, tuple[Schema, Schema]] = {
    "Hello": (
        {"client_version": (Kind.UNICODE, False), "protocols": (Kind.INTEGER_LIST, False)},
        {
            "server_version": (Kind.UNICODE, False),
            "protocol": (Kind.INTEGER, False),
            "features": (Kind.UNICODE_LIST, False),
            "smolvm_available": (Kind.BOOLEAN, False),
            "smolvm_version": (Kind.UNICODE, True),
            "smolvm_source": (Kind.UNICODE, True),
            "smolvm_tested": (Kind.BOOLEAN, True),
            "smolvm_tested_versions": (Kind.UNICODE_LIST, True),
            "vm_uids": (Kind.UNICODE, True),
            "vm_uids_basis": (Kind.UNICODE, True),
            "guest_kit": (Kind.UNICODE, True),
            "guest_kit_argv": (Kind.UNICODE_LIST, True),
        },
    ),
    "Ping": ({}, {}),
    "NodeInfo": (
        {"capability": (Kind.UNICODE, True)},
        {
            "server_version": (Kind.UNICODE, False),
            "protocol": (Kind.INTEGER, False),
            "host": (Kind.UNICODE, False),
            "labels": (Kind.UNICODE_LIST, False),
            "privilege": (Kind.UNICODE, False),
            "smolvm": (Kind.UNICODE, True),
            "smolvm_tested": (Kind.BOOLEAN, True),
            "vm_possible": (Kind.BOOLEAN, False),
            "vm_why_not": (Kind.UNICODE, True),
            "kvm": (Kind.UNICODE, False),
            "max_bottles": (Kind.INTEGER, False),
            "bottles": (Kind.INTEGER, False),
            "vm_bottles": (Kind.INTEGER, False),
            "connections_used": (Kind.INTEGER, False),
            "connections_total": (Kind.INTEGER, False),
            "health": (Kind.UNICODE, False),
            "health_reasons": (Kind.UNICODE_LIST, False),
            "draining": (Kind.BOOLEAN, False),
            "vm_uids_left": (Kind.INTEGER, True),
            "vm_uids": (Kind.UNICODE, True),
            "pools": (Kind.POOL_RECORDS, True),
        },
    ),
    "Exec": (
        {
            "bottle": (Kind.UNICODE, False),
            "argv": (Kind.UNICODE_LIST, False),
            "env": (Kind.UNICODE_LIST, True),
            "user": (Kind.UNICODE, True),
            "workdir": (Kind.UNICODE, True),
            "stdin": (Kind.BOOLEAN, True),
            "tty": (Kind.BOOLEAN, True),
            "rows": (Kind.INTEGER, True),
            "cols": (Kind.INTEGER, True),
            "fds": (Kind.BOOLEAN, True),
            "time_limit": (Kind.INTEGER, True),
            "capability": (Kind.UNICODE, True),
        },
        {"tty": (Kind.BOOLEAN, False), "fds": (Kind.BOOLEAN, True)},
    ),
    "ListBottles": (
        {
            "offset": (Kind.INTEGER, True),
            "limit": (Kind.INTEGER, True),
            "capability": (Kind.UNICODE, True),
        },
        {
            "bottles": (Kind.BOTTLE_RECORDS, False),
            "total": (Kind.INTEGER, False),
            "next_offset": (Kind.INTEGER, True),
        },
    ),
}


def _list(items: list[bytes]) -> bytes:
    return b"".join(len(i).to_bytes(2, "big") + i for i in items)


def _unlist(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        end = pos + 2 + int.from_bytes(data[pos : pos + 2], "big")
        if pos + 2 > len(data) or end > len(data):
            raise ValueError("truncated list")
        out.append(data[pos + 2 : end])
        pos = end
    return out


def _integer(data: bytes) -> int:
    text = data.decode("ascii")
    if text != str(int(text)) or abs(int(text)) >= 2**63:
        raise ValueError("not a canonical decimal integer")
    return int(text)


def encode_value(kind: Kind, value: Any) -> bytes:
    if kind is Kind.UNICODE:
        return str(value).encode("utf-8")
    if kind is Kind.INTEGER:
        return b"%d" % value
    if kind is Kind.BOOLEAN:
        return b"True" if value else b"False"
    if kind is Kind.UNICODE_LIST:
        return _list([str(v).encode("utf-8") for v in value])
    if kind is Kind.INTEGER_LIST:
        return _list([b"%d" % v for v in value])
    raise ValueError(f"{kind} is an answer-only kind")


def decode_value(kind: Kind, data: bytes) -> Any:
    if kind is Kind.UNICODE:
        return data.decode("utf-8")
    if kind is Kind.INTEGER:
        return _integer(data)
    if kind is Kind.BOOLEAN:
        if data not in (b"True", b"False"):
            raise ValueError("not a boolean")
        return data == b"True"
    if kind is Kind.UNICODE_LIST:
        return [i.decode("utf-8") for i in _unlist(data)]
    if kind is Kind.INTEGER_LIST:
        return [_integer(i) for i in _unlist(data)]
    row = PoolRow if kind is Kind.POOL_RECORDS else BottleRow
    return [row.from_json(i) for i in record_objects(data)]  # RecordError: a ValueError


def request_bytes(name: str, tag: bytes, arguments: Mapping[str, Any]) -> bytes:
    """The request box of command ``name`` (None values are left out, as optional)."""
    schema = COMMANDS[name][0]
    box = {
        key.encode("ascii"): encode_value(schema[key][0], value)
        for key, value in arguments.items()
        if value is not None
    }
    box[b"_command"] = b"bottlenet." + name.encode("ascii")
    box[b"_ask"] = tag
    return encode_box(box)


def decode_answer(name: str, box: Mapping[bytes, bytes]) -> dict[str, Any]:
    """The answer's values by key, or raise the typed error the box carries."""
    if b"_error" in box:
        code = box.get(b"_error_code", b"").decode("ascii", "replace")
        message = box.get(b"_error_description", b"").decode("utf-8", "replace")
        raise error_for(code, message, _ERRORS)
    out: dict[str, Any] = {}
    for key, (kind, optional) in COMMANDS[name][1].items():
        raw = box.get(key.encode("ascii"))
        if raw is None:
            if not optional:
                raise FramingError(f"answer lacks {key}")
            out[key] = None
            continue
        try:
            out[key] = decode_value(kind, raw)
        except ValueError:
            raise FramingError(f"answer's {key} is malformed") from None
    return out


class LightControlClient(ExecOpener):
    """One connection to a UNIX control socket for Hello, Ping, ListBottles and Exec."""

    def __init__(
        self,
        path: str,
        timeout: float,
        *,
        vm_timeout: float = VM_TIMEOUT,
        capability: str | None = None,
    ) -> None:
        self.path = path
        #: A scoped peer's capability, given with every call about bottles (``calls``).
        self.capability = capability
        self.timeout = timeout
        self.vm_timeout = vm_timeout
        self._sock: socket.socket | None = None
        self._parser = BoxParser(box_type=dict)
        self._tag = 0
        #: Whether the daemon answered anything on this connection (else an end is a refusal).
        self._answered = False

    def __enter__(self) -> LightControlClient:
        self.connect()
        return self

    def connect(self) -> None:
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
        self._answered = False

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def call(self, c: Call[T], *, timeout: float | None = None) -> T:
        """Send one call, wait for its converted answer (or raise its typed error)."""
        c = presenting(c, self.capability)
        if self._sock is None:
            self.connect()
        assert self._sock is not None
        limit = c.limit(self.timeout, self.vm_timeout) if timeout is None else timeout
        self._sock.settimeout(limit)
        self._tag += 1
        tag = b"%x" % self._tag
        try:
            self._sock.sendall(request_bytes(c.command, tag, c.arguments))
            while True:
                box = self._parser.next_box()
                if box is None:
                    chunk = self._sock.recv(65536)
                    if not chunk:
                        raise broken(self.path, self._answered, None)
                    self._parser.feed(chunk)
                elif box.get(b"_answer", box.get(b"_error")) == tag:
                    self._answered = True
                    return c.convert(decode_answer(c.command, box))
        except TimeoutError:
            raise ControlConnectionError(f"no answer within {limit:g}s") from None
        except FramingError as e:
            raise ControlConnectionError(f"bad answer from the daemon: {e}") from None
        except OSError as e:
            raise broken(self.path, self._answered, e.strerror or str(e)) from None

    def hello(self) -> HelloResult:
        """Hello with this client's own version (every other call: ``call(calls.x(...))``)."""
        return self.call(calls.hello(CLIENT_VERSION))

    def start_exec(self, request: ExecRequest, *, timeout: float | None = None) -> ExecSession:
        """Start an exec; this connection becomes the session's (with ``fds`` and no
        terminal, the command's stdio pipes are handed to us)."""
        try:
            fds = self.call(request.call(local=True), timeout=timeout)
        except BaseException:
            self.close()
            raise
        from bottlenet.control.execsession import ExecSession

        sock, self._sock = self._sock, None
        assert sock is not None
        return ExecSession(
            sock, self._parser.take_rest(), tty=request.tty, stdin=request.stdin, fds=fds
        )
