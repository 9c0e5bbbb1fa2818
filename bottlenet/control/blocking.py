"""A blocking control client for launchers that run no reactor.

Plain ``socket`` (AF_UNIX, or TCP with TLS and a client certificate), socket timeouts, the
same Command definitions and the same bounded box parser as the daemon; ``_error`` boxes come
back as the typed exceptions of :mod:`bottlenet.errors` (by code).

Every call has a timeout: ``timeout=`` on the call, else the call's own (slow calls,
:func:`~bottlenet.control.calls.is_slow`: those that wait on smolvm, get ``vm_timeout``: 300 s),
else ``timeout``. ``call(c)`` runs a call of :mod:`bottlenet.control.calls`; the named methods
are one-line wrappers.
"""

from __future__ import annotations

import collections
import os
import socket
import ssl
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import IO, Any, TypeVar, overload

from twisted.protocols import amp

from bottlenet import __version__
from bottlenet.control import calls, codec
from bottlenet.control import commands as C
from bottlenet.control.address import ControlAddress, TLSCredentials, parse_control_address
from bottlenet.control.calls import DEFAULT_TIMEOUT, VM_TIMEOUT, Call, ExecOpener, ExecRequest
from bottlenet.control.clienterrors import ControlConnectionError, DaemonUnreachable, broken
from bottlenet.control.execsession import ExecSession
from bottlenet.control.framing import BoxParser, FramingError
from bottlenet.control.records import (
    BottleRecord,
    EventRecord,
    ForwardRecord,
    PoolRecord,
    StatsRecord,
)
from bottlenet.control.results import (
    AgentEndpoint,
    DrainResult,
    HelloResult,
    NodeInfoRecord,
    Page,
)
from bottlenet.errors import InvalidArgument

T = TypeVar("T")
CLIENT_VERSION = f"bottlenet-blocking/{__version__}"
__all__ = [
    "DEFAULT_TIMEOUT",
    "VM_TIMEOUT",
    "BlockingControlClient",
    "ControlConnectionError",
    "DaemonUnreachable",
    "ExecSession",
]


class BlockingControlClient(ExecOpener):
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
        capability: str | None = None,
    ) -> None:
        #: A scoped peer's capability, given with every call about bottles (``calls``).
        self.capability = capability
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
        #: Whether the daemon answered anything on this connection (else an end is a refusal).
        self._answered = False
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
        # over TLS a refusal is the handshake's; a UNIX daemon refuses by ending the connection
        self._answered = self.address.kind != "unix"
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
        """The default limit of ``command`` with ``arguments`` (the calls' slow rule)."""
        return calls.raw(C.short_name(command), arguments).limit(self.timeout, self.vm_timeout)

    # -- one request ---------------------------------------------------------------------------

    @overload
    def call(self, c: Call[T], *, timeout: float | None = None) -> T: ...

    @overload
    def call(
        self, c: type[amp.Command], *, timeout: float | None = None, **arguments: Any
    ) -> dict[str, Any]: ...

    def call(
        self, c: Call[Any] | type[amp.Command], *, timeout: float | None = None, **arguments: Any
    ) -> Any:
        """Send one call (or a Command with its arguments) and wait for its converted answer
        (or raise its typed error)."""
        if not isinstance(c, Call):
            c = calls.raw(C.short_name(c), arguments)
        c = calls.presenting(c, self.capability)
        if self._sock is None:
            self.connect()
        assert self._sock is not None
        command = C.BY_NAME[c.command]
        limit = c.limit(self.timeout, self.vm_timeout) if timeout is None else timeout
        self._tag += 1
        tag = b"%x" % self._tag
        data = codec.encode_request(command, tag, c.arguments)
        try:
            self._sock.settimeout(limit)
            self._sock.sendall(data)
            while True:
                box = self._next_box(self._sock)
                if box is not None and box.get(amp.ANSWER, box.get(amp.ERROR)) == tag:
                    self._answered = True
                    return c.convert(codec.decode_answer(command, box))
        except TimeoutError:
            self.close()
            raise ControlConnectionError(f"no answer within {limit:g}s") from None
        except FramingError as e:
            self.close()
            raise ControlConnectionError(f"bad answer from the daemon: {e}") from None
        except OSError as e:
            self.close()
            raise broken(self.path, self._answered, e.strerror or str(e)) from None

    def _next_box(self, sock: socket.socket, *, until_event: bool = False) -> amp.AmpBox | None:
        """The next answer box; pushed events are answered and queued on the way (with
        ``until_event``, None as soon as one is queued)."""
        while True:
            box = self._parser.next_box()
            if box is None:
                chunk = sock.recv(65536)
                if not chunk:
                    raise broken(self.path, self._answered, None)
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
        return self.call(calls.watch(bottle))

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

    def start_exec(self, request: ExecRequest, *, timeout: float | None = None) -> ExecSession:
        """Start an exec on a connection of its own (``open_exec``'s fields as one value)."""
        return self._open_stream(
            lambda local: request.call(local=local), timeout, tty=request.tty, stdin=request.stdin
        )

    def _open_stream(
        self,
        make: Callable[[bool], Call[bool]],
        timeout: float | None,
        *,
        tty: bool,
        stdin: bool,
    ) -> ExecSession:
        """Send ``make(local)`` on a connection of its own (``local``: a UNIX socket); its
        answer (whether the stdio came as file descriptors) switches it to frames."""
        session = BlockingControlClient(
            self.address,
            self.timeout,
            vm_timeout=self.vm_timeout,
            tls=self.tls,
            capability=self.capability,
        )
        c = make(self.address.kind == "unix")
        limit = c.limit(self.timeout, self.vm_timeout) if timeout is None else timeout
        session._sock = self._open(limit)
        try:
            fds = session.call(c, timeout=limit)
        except BaseException:
            session.close()
            raise
        assert session._sock is not None
        return ExecSession(
            session._sock, session._parser.take_rest(), tty=tty, stdin=stdin, fds=fds
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
        call = calls.logs(bottle, tail, follow)
        session = self._open_stream(lambda _: call, timeout, tty=False, stdin=False)
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

    # -- one typed method per call (calls.py declares each) -----------------------------

    def hello(self, client_version: str = CLIENT_VERSION) -> HelloResult:
        return self.call(calls.hello(client_version))

    def ping(self, *, timeout: float | None = None) -> None:
        self.call(calls.ping(), timeout=timeout)

    def create_bottle(
        self,
        name: str,
        alias: str | None = None,
        spec: str | None = None,
        *,
        owner: str | None = None,
        lease_seconds: float | None = None,
        pool: str | None = None,
        timeout: float | None = None,
    ) -> BottleRecord:
        """``spec`` is the bottle spec as JSON text (None: a forward-only bottle); ``owner``
        a label; ``lease_seconds``: the daemon destroys the bottle unless ``renew_lease``
        comes in time (plus its grace); ``pool``: ``auto`` (None), ``off`` or ``only``, whether
        it may take a warm pool's bottle of its spec."""
        call = calls.create_bottle(name, alias, spec, owner, lease_seconds, pool)
        return self.call(call, timeout=timeout)

    def renew_lease(
        self, name: str, seconds: float, *, timeout: float | None = None
    ) -> BottleRecord:
        return self.call(calls.renew_lease(name, seconds), timeout=timeout)

    def leftovers(self, name: str, *, timeout: float | None = None) -> tuple[str, ...]:
        return self.call(calls.leftovers(name), timeout=timeout)

    def verify_bottle(self, name: str, *, timeout: float | None = None) -> tuple[BottleRecord, str]:
        return self.call(calls.verify_bottle(name), timeout=timeout)

    def set_egress_policy(
        self, bottle: str, hosts: list[str], *, timeout: float | None = None
    ) -> tuple[str, ...]:
        return self.call(calls.set_egress_policy(bottle, hosts), timeout=timeout)

    def destroy_bottle(self, name: str, *, timeout: float | None = None) -> None:
        self.call(calls.destroy_bottle(name), timeout=timeout)

    def list_bottles(
        self, offset: int = 0, limit: int | None = None, *, timeout: float | None = None
    ) -> Page[BottleRecord]:
        return self.call(calls.list_bottles(offset, limit), timeout=timeout)

    def bottle_status(self, name: str, *, timeout: float | None = None) -> BottleRecord:
        return self.call(calls.bottle_status(name), timeout=timeout)

    def add_forward(
        self, bottle: str, label: str, target: str, port: int = 0, *, timeout: float | None = None
    ) -> AgentEndpoint:
        return self.call(calls.add_forward(bottle, label, target, port), timeout=timeout)

    def remove_forward(self, bottle: str, label: str, *, timeout: float | None = None) -> None:
        self.call(calls.remove_forward(bottle, label), timeout=timeout)

    def list_forwards(
        self,
        bottle: str | None = None,
        offset: int = 0,
        limit: int | None = None,
        *,
        timeout: float | None = None,
    ) -> Page[ForwardRecord]:
        return self.call(calls.list_forwards(bottle, offset, limit), timeout=timeout)

    def node_info(self, *, timeout: float | None = None) -> NodeInfoRecord:
        """This node for a placer: identity, labels, capacity, health, draining."""
        return self.call(calls.node_info(), timeout=timeout)

    def drain(self, *, wait: bool = False, timeout: float | None = None) -> DrainResult:
        """Refuse new bottles (``DRAINING``); ``wait``: answer once the node holds none, or
        ``timeout`` seconds passed (``empty`` says which)."""
        return self.call(calls.drain(wait, timeout))

    def undrain(self, *, timeout: float | None = None) -> None:
        self.call(calls.undrain(), timeout=timeout)

    def ensure_pool(self, spec: str, size: int, *, timeout: float | None = None) -> PoolRecord:
        """Keep ``size`` bottles of ``spec`` (JSON text) ready for creates of that spec."""
        return self.call(calls.ensure_pool(spec, size), timeout=timeout)

    def list_pools(self, *, timeout: float | None = None) -> tuple[PoolRecord, ...]:
        return self.call(calls.list_pools(), timeout=timeout)

    def remove_pool(self, spec_hash: str, *, timeout: float | None = None) -> int:
        """Forget the pool of ``spec_hash``; how many of its bottles were destroyed."""
        return self.call(calls.remove_pool(spec_hash), timeout=timeout)

    def stats(
        self,
        bottle: str | None = None,
        offset: int = 0,
        limit: int | None = None,
        *,
        timeout: float | None = None,
    ) -> Page[StatsRecord]:
        return self.call(calls.stats(bottle, offset, limit), timeout=timeout)

    # -- every page ----------------------------------------------------------------------

    def all_bottles(self) -> Iterator[BottleRecord]:
        return calls.every_item(lambda o: self.list_bottles(o))

    def all_forwards(self, bottle: str | None = None) -> Iterator[ForwardRecord]:
        return calls.every_item(lambda o: self.list_forwards(bottle, o))

    def all_stats(self, bottle: str | None = None) -> Iterator[StatsRecord]:
        return calls.every_item(lambda o: self.stats(bottle, o))
