"""A blocking control client for launchers that run no reactor.

Plain ``socket`` (AF_UNIX, or TCP with TLS and a client certificate), socket timeouts, the
same Command definitions and the same bounded box parser as the daemon; ``_error`` boxes come
back as the typed exceptions of :mod:`bottlenet.errors` (by code).

Every call has a timeout: ``timeout=`` on the call, else the command's default (calls that
wait on smolvm, :data:`VM_COMMANDS`, get ``vm_timeout``: 300 s), else ``timeout``.
"""

from __future__ import annotations

import collections
import os
import socket
import ssl
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import IO, Any

from twisted.protocols import amp

from bottlenet import __version__
from bottlenet.control import codec
from bottlenet.control import commands as C
from bottlenet.control.address import ControlAddress, TLSCredentials, parse_control_address
from bottlenet.control.clienterrors import ControlConnectionError, DaemonUnreachable
from bottlenet.control.execsession import ExecSession
from bottlenet.control.framing import BoxParser, FramingError
from bottlenet.control.records import BottleRecord, EventRecord, ForwardRecord, StatsRecord
from bottlenet.control.results import AgentEndpoint, HelloResult, Page
from bottlenet.errors import InvalidArgument

CLIENT_VERSION = f"bottlenet-blocking/{__version__}"
DEFAULT_TIMEOUT = 10.0
#: Calls that wait on smolvm (create with a spec, destroy, verify, egress, exec's start).
VM_TIMEOUT = 300.0
__all__ = ["BlockingControlClient", "ControlConnectionError", "DaemonUnreachable", "ExecSession"]
VM_COMMANDS: frozenset[type[amp.Command]] = frozenset(
    {C.DestroyBottle, C.VerifyBottle, C.SetEgressPolicy, C.Exec}
)


class BlockingControlClient:
    """One connection to the control socket; use as a context manager.

    ``control`` is a socket path, ``unix:PATH`` or ``tls:HOST:PORT`` (then ``tls`` gives
    the client certificate, key and CA; without it they come from the environment).
    """

    def __init__(
        self,
        control: str | ControlAddress,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        vm_timeout: float = VM_TIMEOUT,
        tls: TLSCredentials | None = None,
    ) -> None:
        self.address: ControlAddress = (
            control if isinstance(control, ControlAddress) else parse_control_address(control)
        )
        self.path = self.address.describe()
        self.timeout = timeout
        self.vm_timeout = vm_timeout
        if self.address.kind == "tls" and tls is None:
            tls = TLSCredentials.from_env(os.environ)
            if tls is None:
                raise InvalidArgument(
                    "a tls: control address needs a client certificate, key and CA"
                    " (--cert/--key/--ca or BOTTLENET_CONTROL_CERT/_KEY/_CA)"
                )
        self.tls = tls
        self._sock: socket.socket | None = None
        self._parser = BoxParser()
        self._tag = 0
        self._events: collections.deque[EventRecord] = collections.deque()

    # -- connection ------------------------------------------------------------------------

    def _open(self, timeout: float) -> socket.socket:
        a = self.address
        try:
            if a.kind == "unix":
                assert a.path is not None
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                try:
                    sock.connect(a.path)
                except BaseException:
                    sock.close()
                    raise
                return sock
            assert a.host is not None and a.port is not None and self.tls is not None
            context = self.tls.context()
            raw = socket.create_connection((a.host, a.port), timeout=timeout)
            try:
                return context.wrap_socket(raw, server_hostname=a.host)
            except BaseException:
                raw.close()
                raise
        except TimeoutError:
            raise DaemonUnreachable(self.path, "timed out") from None
        except ssl.SSLError as e:
            raise DaemonUnreachable(self.path, f"TLS failed: {e.reason or e}") from None
        except OSError as e:
            raise DaemonUnreachable(self.path, e.strerror or type(e).__name__) from None

    def connect(self) -> BlockingControlClient:
        self._sock = self._open(self.timeout)
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

    def timeout_for(self, command: type[amp.Command], arguments: dict[str, Any]) -> float:
        if command in VM_COMMANDS or (command is C.CreateBottle and arguments.get("spec")):
            return self.vm_timeout
        return self.timeout

    # -- one request ---------------------------------------------------------------------------

    def call(
        self, command: type[amp.Command], *, timeout: float | None = None, **arguments: Any
    ) -> dict[str, Any]:
        """Send one command and wait for its answer (or raise its typed error)."""
        if self._sock is None:
            self.connect()
        assert self._sock is not None
        limit = self.timeout_for(command, arguments) if timeout is None else timeout
        self._tag += 1
        tag = b"%x" % self._tag
        data = codec.encode_request(command, tag, arguments)
        try:
            self._sock.settimeout(limit)
            self._sock.sendall(data)
            while True:
                box = self._next_box(self._sock)
                if box is not None and box.get(amp.ANSWER, box.get(amp.ERROR)) == tag:
                    return codec.decode_answer(command, box)
        except TimeoutError:
            self.close()
            raise ControlConnectionError(f"no answer within {limit:g}s") from None
        except FramingError as e:
            self.close()
            raise ControlConnectionError(f"bad answer from the daemon: {e}") from None
        except OSError as e:
            self.close()
            raise ControlConnectionError(f"connection failed: {e.strerror or e}") from None

    def _next_box(self, sock: socket.socket, *, until_event: bool = False) -> amp.AmpBox | None:
        """The next answer box; pushed events are answered and queued on the way (with
        ``until_event``, None as soon as one is queued)."""
        while True:
            box = self._parser.next_box()
            if box is None:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ControlConnectionError("the daemon closed the connection")
                self._parser.feed(chunk)
                continue
            if box.get(amp.COMMAND) == C.Event.commandName and amp.ASK in box:
                self._queue_event(sock, box)
                if until_event:
                    return None
                continue
            return box

    def _queue_event(self, sock: socket.socket, box: amp.AmpBox) -> None:
        try:
            event = C.Event.parseArguments(box, None)["event"]
        except Exception:
            raise FramingError("malformed event from the daemon") from None
        self._events.append(event)
        answer = amp.AmpBox()
        answer[amp.ANSWER] = box[amp.ASK]
        sock.sendall(answer.serialize())

    # -- events ------------------------------------------------------------------------------

    def watch(self, bottle: str | None = None) -> int:
        """Start receiving bottle events on this connection; the daemon's current seq."""
        seq: int = self.call(C.Watch, bottle=bottle)["seq"]
        return seq

    def events(
        self, bottle: str | None = None, *, idle: float | None = None
    ) -> Iterator[EventRecord]:
        """Watch, then yield every event as it comes (forever, or until ``idle`` seconds
        pass without one: then TimeoutError). Other calls may be made between events."""
        self.watch(bottle)
        while True:
            while self._events:
                yield self._events.popleft()
            assert self._sock is not None
            try:
                self._sock.settimeout(idle)
                self._next_box(self._sock, until_event=True)
            except FramingError as e:
                self.close()
                raise ControlConnectionError(f"bad data from the daemon: {e}") from None
            except TimeoutError:
                raise
            except OSError as e:
                self.close()
                raise ControlConnectionError(f"connection failed: {e.strerror or e}") from None

    # -- exec --------------------------------------------------------------------------------

    def open_exec(
        self,
        bottle: str,
        argv: Sequence[str],
        *,
        env: Sequence[str] = (),
        user: str | None = None,
        workdir: str | None = None,
        stdin: bool = False,
        tty: bool = False,
        size: tuple[int, int] | None = None,
        timeout: float | None = None,
        fds: bool = True,
        time_limit: int | None = None,
    ) -> ExecSession:
        """Start ``argv`` in the bottle's agent VM on a connection of its own.

        ``fds``: on a UNIX socket without a terminal, take the command's stdio pipes from the
        daemon (False: frames through the daemon). ``time_limit``: the daemon ends the
        command after that many seconds (exit code 124)."""
        rows, cols = size if size is not None else (None, None)
        return self._open_stream(
            C.Exec,
            timeout,
            tty=tty,
            stdin=stdin,
            bottle=bottle,
            argv=list(argv),
            env=list(env) if env else None,
            user=user,
            workdir=workdir,
            rows=rows,
            cols=cols,
            fds=fds,
            time_limit=time_limit,
        )

    def _open_stream(
        self,
        command: type[amp.Command],
        timeout: float | None,
        *,
        tty: bool,
        stdin: bool,
        **arguments: Any,
    ) -> ExecSession:
        """Send ``command`` on a connection of its own; its answer switches it to frames."""
        limit = self.vm_timeout if timeout is None else timeout
        session = BlockingControlClient(
            self.address, self.timeout, vm_timeout=self.vm_timeout, tls=self.tls
        )
        session._sock = self._open(limit)
        assert session._sock is not None
        if command is C.Exec:
            # File descriptors travel only over a UNIX socket (the daemon checks it too).
            local = session._sock.family == socket.AF_UNIX and not tty
            arguments.update(stdin=stdin, tty=tty, fds=(arguments.get("fds") and local) or None)
        try:
            answer = session.call(command, timeout=limit, **arguments)
        except BaseException:
            session.close()
            raise
        assert session._sock is not None
        return ExecSession(
            session._sock,
            session._parser.take_rest(),
            tty=tty,
            stdin=stdin,
            fds=bool(answer.get("fds")),
        )

    def logs(
        self,
        bottle: str,
        *,
        stdout: IO[bytes] | None = None,
        stderr: IO[bytes] | None = None,
        tail: int | None = None,
        follow: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Write the workload's output (its last ``tail`` lines, default 200) to ``stdout``;
        with ``follow``, keep writing until the connection is closed. ``tail``'s exit code."""
        session = self._open_stream(
            C.Logs, timeout, tty=False, stdin=False, bottle=bottle, tail=tail, follow=follow
        )
        with session:
            return session.run(None, stdout, stderr)

    def exec(
        self,
        bottle: str,
        argv: Sequence[str],
        *,
        stdin: IO[bytes] | None = None,
        stdout: IO[bytes] | None = None,
        stderr: IO[bytes] | None = None,
        env: Sequence[str] = (),
        user: str | None = None,
        workdir: str | None = None,
        tty: bool = False,
        size: tuple[int, int] | None = None,
        timeout: float | None = None,
        fds: bool = True,
        time_limit: int | None = None,
    ) -> int:
        """Run ``argv`` in the bottle's agent VM and return its exit code (``fds``,
        ``time_limit``: as :meth:`open_exec`).

        Its output is written to ``stdout``/``stderr`` (binary files; None discards it);
        ``stdin`` (a binary file, None for no input) is forwarded until its end.
        """
        session = self.open_exec(
            bottle,
            argv,
            env=env,
            user=user,
            workdir=workdir,
            stdin=stdin is not None,
            tty=tty,
            size=size,
            timeout=timeout,
            fds=fds,
            time_limit=time_limit,
        )
        with session:
            return session.run(stdin, stdout, stderr)

    # -- one typed method per command ---------------------------------------------------

    def hello(self, client_version: str = CLIENT_VERSION) -> HelloResult:
        answer = self.call(
            C.Hello, client_version=client_version, protocols=list(C.SUPPORTED_PROTOCOLS)
        )
        return HelloResult.from_answer(answer)

    def ping(self, *, timeout: float | None = None) -> None:
        self.call(C.Ping, timeout=timeout)

    def create_bottle(
        self,
        name: str,
        alias: str | None = None,
        spec: str | None = None,
        *,
        timeout: float | None = None,
    ) -> BottleRecord:
        """``spec`` is the bottle spec as JSON text (None: a forward-only bottle)."""
        answer = self.call(C.CreateBottle, timeout=timeout, name=name, alias=alias, spec=spec)
        bottle: BottleRecord = answer["bottle"]
        return bottle

    def verify_bottle(self, name: str, *, timeout: float | None = None) -> tuple[BottleRecord, str]:
        answer = self.call(C.VerifyBottle, timeout=timeout, name=name)
        return answer["bottle"], answer["result"]

    def set_egress_policy(
        self, bottle: str, hosts: list[str], *, timeout: float | None = None
    ) -> tuple[str, ...]:
        answer = self.call(
            C.SetEgressPolicy, timeout=timeout, bottle=bottle, allow_hosts=list(hosts)
        )
        return tuple(answer["allow_hosts"])

    def destroy_bottle(self, name: str, *, timeout: float | None = None) -> None:
        self.call(C.DestroyBottle, timeout=timeout, name=name)

    def list_bottles(
        self, offset: int = 0, limit: int | None = None, *, timeout: float | None = None
    ) -> Page[BottleRecord]:
        answer = self.call(C.ListBottles, timeout=timeout, offset=offset, limit=limit)
        return Page.from_answer(answer, "bottles")

    def bottle_status(self, name: str, *, timeout: float | None = None) -> BottleRecord:
        bottle: BottleRecord = self.call(C.BottleStatus, timeout=timeout, name=name)["bottle"]
        return bottle

    def add_forward(
        self,
        bottle: str,
        label: str,
        target: str,
        port: int = 0,
        *,
        timeout: float | None = None,
    ) -> AgentEndpoint:
        answer = self.call(
            C.AddForward, timeout=timeout, bottle=bottle, label=label, target=target, port=port
        )
        return AgentEndpoint.from_answer(answer)

    def remove_forward(self, bottle: str, label: str, *, timeout: float | None = None) -> None:
        self.call(C.RemoveForward, timeout=timeout, bottle=bottle, label=label)

    def list_forwards(
        self,
        bottle: str | None = None,
        offset: int = 0,
        limit: int | None = None,
        *,
        timeout: float | None = None,
    ) -> Page[ForwardRecord]:
        answer = self.call(
            C.ListForwards, timeout=timeout, bottle=bottle, offset=offset, limit=limit
        )
        return Page.from_answer(answer, "forwards")

    def stats(
        self,
        bottle: str | None = None,
        offset: int = 0,
        limit: int | None = None,
        *,
        timeout: float | None = None,
    ) -> Page[StatsRecord]:
        answer = self.call(C.Stats, timeout=timeout, bottle=bottle, offset=offset, limit=limit)
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
