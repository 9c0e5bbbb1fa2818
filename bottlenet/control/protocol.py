"""A hardened AMP protocol for the control socket.

What stock ``amp.AMP`` does that we must not (reliability catalogue finding 5, tests B1-B6):
- an unterminated box grows without bound: we parse with :class:`BoxParser` under fixed caps;
- a wrong-type argument logs a traceback containing the peer's value, and a stray
  ``_answer`` raises an unhandled ``KeyError``: we decode arguments ourselves into typed
  ``INVALID_ARGUMENT`` errors and treat unknown tags as a protocol violation;
- an unknown command echoes the peer's bytes back: we describe it with ``safe_repr``;
- a flood of pipelined commands whose answers are never read fills the output buffer: we
  register as the transport's producer and stop reading while it is full;
- ``StartTLS`` and ``amp_*`` string responders are reachable: only our own commands are.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from automat import TypeMachineBuilder
from twisted.internet.defer import Deferred, fail, maybeDeferred
from twisted.internet.interfaces import IConsumer, IPushProducer, ISystemHandle, ITCPTransport
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.protocols import amp
from twisted.python.failure import Failure
from zope.interface import implementer

import twisted
from bottlenet.control.commands import InternalError
from bottlenet.control.framing import BoxParser, FramingError
from bottlenet.errors import BottlenetError, InvalidArgument, safe_repr

# At most this many commands of one connection run at once; more are left unparsed.
MAX_IN_FLIGHT = 16
# While parsing is paused on a transport we keep reading (TLS), at most this much input waits.
MAX_UNPARSED = 1024 * 1024

_INTERNAL = InternalError.code.encode("ascii")

#: Twisted versions whose private AMP names this module was checked against (see
#: ``tests/control/test_amp_pin.py``). It overrides ``CommandLocator._wrapWithSerialization``,
#: reads ``BoxDispatcher._outstandingRequests``, calls ``BoxDispatcher._safeEmit`` and sets
#: ``_transportPeer``/``_transportHost`` as ``AMP.makeConnection`` does (without its log line).
AMP_VERIFIED_TWISTED = frozenset({"26.10.0"})
#: The class-level private names of ``twisted.protocols.amp`` used here, with their owners.
AMP_PRIVATE_NAMES = (
    ("CommandLocator", "_wrapWithSerialization"),
    ("BoxDispatcher", "_outstandingRequests"),
    ("BoxDispatcher", "_safeEmit"),
)


def amp_private_names_verified() -> bool:
    """This Twisted is one the private AMP names were checked against, and it has them."""
    return twisted.__version__ in AMP_VERIFIED_TWISTED and all(
        hasattr(getattr(amp, owner), name) for owner, name in AMP_PRIVATE_NAMES
    )


class IControlTransport(ITCPTransport, IConsumer, IPushProducer, ISystemHandle):
    """What a control connection's transport provides (UNIX, TCP and TLS all do)."""


def describe_failure(failure: Failure) -> str:
    """Exception type and code locations, without the exception's message or locals.

    Exception messages may carry values a peer sent, so logs get only where it happened.
    """
    frames = [f"{fn}:{line}({func})" for func, fn, line, _l, _g in failure.frames[-4:]]
    name = getattr(failure.type, "__qualname__", "?")
    return f"{name} at {' <- '.join(reversed(frames)) or '?'}"


def parse_arguments(command: type[amp.Command], box: amp.AmpBox) -> dict[str, Any]:
    """Decode ``box`` with ``command``'s schema; any problem is a typed, value-free error."""
    objects: dict[str, Any] = {}
    strings = box.copy()
    for name, argument in command.arguments:
        label = name.decode("ascii")
        try:
            argument.fromBox(name, strings, objects, None)
        except KeyError:
            raise InvalidArgument(f"argument {label!r} is missing") from None
        except UnicodeDecodeError:
            raise InvalidArgument(f"argument {label!r} is not valid UTF-8") from None
        except Exception:
            raise InvalidArgument(f"argument {label!r} has the wrong type") from None
    return objects


#: Told ``(command, result)`` once per handled command: its class name and "OK" or the code.
CommandObserver = Callable[[str, str], None]


class SafeCommandLocator(amp.CommandLocator):
    """A CommandLocator whose responders can only fail with typed, value-free errors.

    Every responder runs through :meth:`_wrapWithSerialization`, so that is also the one place
    where ``on_command`` (the daemon's metrics) hears how each command ended.
    """

    log = Logger()
    on_command: CommandObserver | None = None

    def _wrapWithSerialization(
        self, aCallable: Callable[..., Any], command: type[amp.Command]
    ) -> Callable[[amp.AmpBox], Deferred[amp.AmpBox]]:
        def run(kw: dict[str, Any]) -> Deferred[Any]:
            return maybeDeferred(aCallable, **kw)

        def respond(objects: dict[str, Any]) -> amp.AmpBox:
            return command.makeResponse(objects, None)

        def to_remote(failure: Failure) -> Failure:
            exc = failure.value
            # A subclass of a wire error (e.g. statedir.PrivateDirError) travels as its base.
            known = [c for c in type(exc).__mro__ if c in command.errors]
            if isinstance(exc, BottlenetError) and known:
                code = command.errors[known[0]]
                return Failure(amp.RemoteAmpError(code, exc.message, False))
            self.log.error(
                "control: internal error in {command}: {where}",
                command=command.__name__,
                where=describe_failure(failure),
            )
            return Failure(amp.RemoteAmpError(_INTERNAL, "internal error", False))

        def observe(outcome: amp.AmpBox | Failure) -> amp.AmpBox | Failure:
            if self.on_command is None:
                return outcome
            code = "OK"
            if isinstance(outcome, Failure):
                raw = getattr(outcome.value, "errorCode", _INTERNAL)
                code = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
            try:
                self.on_command(command.__name__, code)
            except Exception:
                self.log.failure("control: command observer failed")
            return outcome

        def doit(box: amp.AmpBox) -> Deferred[amp.AmpBox]:
            d: Deferred[Any] = maybeDeferred(parse_arguments, command, box)
            d.addCallback(run)
            d.addCallback(respond)
            d.addErrback(to_remote)
            d.addBoth(observe)
            return d

        return doit


class StreamSink(Protocol):
    """Where a switched connection's bytes go (see :meth:`HardenedAMP.switch_after_answer`)."""

    def attach(self, transport: Any, leftover: bytes) -> None: ...

    def client_data(self, data: bytes) -> None: ...

    def client_lost(self) -> None: ...


class ConnectionMode(enum.StrEnum):
    """What a control connection is doing with the bytes it reads."""

    #: Connected, peer not yet authenticated: any byte from it drops the connection.
    AUTHENTICATING = "authenticating"
    #: Parsing AMP boxes and answering commands.
    AMP = "amp"
    #: A command asked to switch to a stream: still AMP until its answer is written.
    SWITCH_PENDING = "switch_pending"
    #: Every byte goes to the stream sink; none is parsed as a box.
    SWITCHED = "switched"
    #: Dropped, stopped or lost: nothing more is parsed, paused or forwarded.
    CLOSING = "closing"


class _ModeInputs(Protocol):
    """The inputs of a connection's mode machine (see ``docs/architecture.md``)."""

    def authenticated(self) -> None:
        """The peer is who it may be: its boxes are parsed from now on."""

    def switch_after_answer(self, sink: StreamSink) -> None:
        """The command being handled hands the connection to ``sink`` once answered."""

    def answer_sent(self) -> StreamSink | None:
        """A command's answer was written; returns the sink to attach, if one waits."""

    def close(self) -> None:
        """The connection is being dropped or stopped: parse and forward nothing more."""

    def connection_lost(self) -> None:
        """The transport is gone; a sink that was handed the connection is told."""


@dataclass
class _ModeCore:
    """The mode machine's data: the state it entered last, and the stream sink once a
    command asked for a switch.

    Only the machine's outputs write it. The protocol reads ``mode`` here on every box and
    read (an automat input per read would cost a scan of every transition), and does the
    rest (attaching, pausing) after an input returns, so no output re-enters the machine.
    """

    mode: ConnectionMode = ConnectionMode.AUTHENTICATING
    sink: StreamSink | None = None

    def tell_lost(self) -> None:
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.client_lost()


def _entering(mode: ConnectionMode) -> Callable[[_ModeInputs, _ModeCore], None]:
    """The output of a transition whose only effect is the state it enters."""

    def enter(inputs: _ModeInputs, core: _ModeCore) -> None:
        core.mode = mode

    return enter


def _build_mode_machine() -> Callable[[_ModeCore], _ModeInputs]:
    builder = TypeMachineBuilder(_ModeInputs, _ModeCore)
    authenticating = builder.state("authenticating")
    amp_ = builder.state("amp")
    switch_pending = builder.state("switch_pending")
    switched = builder.state("switched")
    closing = builder.state("closing")

    authenticating.upon(_ModeInputs.authenticated).to(amp_)(_entering(ConnectionMode.AMP))
    for state in (authenticating, amp_, switch_pending, switched):
        state.upon(_ModeInputs.close).to(closing)(_entering(ConnectionMode.CLOSING))
    for state in (authenticating, amp_):
        state.upon(_ModeInputs.connection_lost).to(closing)(_entering(ConnectionMode.CLOSING))
    amp_.upon(_ModeInputs.answer_sent).loop().returns(None)
    switched.upon(_ModeInputs.answer_sent).loop().returns(None)
    closing.upon(_ModeInputs.authenticated).loop().returns(None)
    closing.upon(_ModeInputs.close).loop().returns(None)

    @amp_.upon(_ModeInputs.switch_after_answer).to(switch_pending)
    def hold(inputs: _ModeInputs, core: _ModeCore, sink: StreamSink) -> None:
        core.mode = ConnectionMode.SWITCH_PENDING
        core.sink = sink

    @closing.upon(_ModeInputs.switch_after_answer).loop()
    def hold_orphan(inputs: _ModeInputs, core: _ModeCore, sink: StreamSink) -> None:
        core.sink = sink  # told client_lost once answered, or at connection_lost

    @switch_pending.upon(_ModeInputs.answer_sent).to(switched)
    def hand_over(inputs: _ModeInputs, core: _ModeCore) -> StreamSink | None:
        core.mode = ConnectionMode.SWITCHED
        return core.sink

    @closing.upon(_ModeInputs.answer_sent).loop()
    def orphaned(inputs: _ModeInputs, core: _ModeCore) -> StreamSink | None:
        core.tell_lost()  # the switch never happens: the sink's client is gone
        return None

    @switch_pending.upon(_ModeInputs.connection_lost).to(closing)
    @switched.upon(_ModeInputs.connection_lost).to(closing)
    def lost(inputs: _ModeInputs, core: _ModeCore) -> None:
        core.mode = ConnectionMode.CLOSING
        core.tell_lost()

    @closing.upon(_ModeInputs.connection_lost).loop()
    def lost_while_closing(inputs: _ModeInputs, core: _ModeCore) -> None:
        core.tell_lost()

    return builder.build()


_ModeMachine = _build_mode_machine()
#: The modes in which boxes are parsed.
_PARSING = frozenset({ConnectionMode.AMP, ConnectionMode.SWITCH_PENDING})


@implementer(IPushProducer)
class HardenedAMP(amp.AMP):
    """AMP with bounded parsing, value-free errors and read back-pressure.

    Its connection mode is a declared state (:class:`ConnectionMode`); why reading is paused
    is data (:attr:`pause_reasons`), a set of reasons, not a state.
    """

    log = Logger()

    def __init__(
        self, locator: amp.IResponderLocator | None = None, *, pause_reading: bool = True
    ) -> None:
        """``pause_reading=False`` for TLS: pausing the TLS transport's reading while it
        buffers our writes would stall its own handshake (a deadlock), so there we only
        stop parsing, and drop a peer whose unparsed input passes ``MAX_UNPARSED``.
        """
        super().__init__(boxReceiver=self, locator=locator or SafeCommandLocator())
        self._pause_reading = pause_reading
        self._parser = BoxParser()
        self._pause_reasons: set[str] = set()
        self._in_flight = 0
        self._core = _ModeCore()
        self._mode = _ModeMachine(self._core)

    # -- read-outs -------------------------------------------------------------------

    @property
    def mode(self) -> ConnectionMode:
        """The connection's state: authenticating, amp, switch_pending, switched, closing."""
        return self._core.mode

    @property
    def pause_reasons(self) -> frozenset[str]:
        """Why parsing (and, off TLS, reading) is paused: "write", "in-flight", or none."""
        return frozenset(self._pause_reasons)

    @property
    def unparsed(self) -> int:
        """Bytes received and not yet parsed into boxes."""
        return self._parser.buffered

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # -- connection life -------------------------------------------------------------

    @property
    def ctransport(self) -> IControlTransport:
        """The transport, typed as what UNIX/TCP/TLS transports really provide."""
        assert self.transport is not None
        return cast(IControlTransport, self.transport)

    def makeConnection(self, transport: Any) -> None:
        # Stock AMP logs "connection established" and "lost" at INFO for every connection,
        # before any peer check: whoever can connect (a refused uid, a TLS peer without a
        # certificate) could fill the disk. What matters is logged by us: commands of
        # authenticated peers, and refusals rate-limited.
        self._transportPeer = transport.getPeer()
        self._transportHost = transport.getHost()
        amp.BinaryBoxProtocol.makeConnection(self, transport)

    def connectionMade(self) -> None:
        """Whoever connected may talk (the client's side); the server checks first."""
        self.ctransport.registerProducer(self, True)
        self.peer_authenticated()

    def peer_authenticated(self) -> None:
        """The peer is authenticated: its boxes are parsed from now on."""
        self._mode.authenticated()

    def close(self) -> None:
        """Close cleanly. Unregister first: TLS waits for that before its close_notify."""
        if self.transport is None:
            return
        self.ctransport.unregisterProducer()
        self.ctransport.loseConnection()

    def drop(self, why: str) -> None:
        """Close this connection now, for a reason we wrote (never peer bytes)."""
        if self.mode is ConnectionMode.CLOSING:
            return
        self.log.warn("control: closing connection ({peer}): {why}", why=why, **self.log_fields())
        self.abort()

    def abort(self) -> None:
        """Close this connection now; whoever calls this has logged why (or must not)."""
        self._mode.close()
        if self.transport is not None:
            self.ctransport.abortConnection()

    def log_fields(self) -> dict[str, object]:
        """Structured fields naming the peer (at least ``peer``) for log lines about it."""
        return {"peer": "unauthenticated"}

    # -- switching away from AMP (exec sessions) -----------------------------------------

    def switch_after_answer(self, sink: StreamSink) -> None:
        """Once the answer of the command being handled is written, the connection stops
        speaking AMP: every later byte goes to ``sink`` (and none is parsed as a box)."""
        self._mode.switch_after_answer(sink)

    def _answer_sent(self) -> None:
        sink = self._mode.answer_sent()
        if sink is None:
            return
        self.ctransport.unregisterProducer()
        if self._pause_reading and self._pause_reasons:
            self.ctransport.resumeProducing()
        self._pause_reasons.clear()
        sink.attach(self.transport, self._parser.take_rest())

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._mode.connection_lost()
        if self._parser.mid_box and self._parser.failed is None:
            self.log.info("control: connection closed mid-box (truncated frame)")
        amp.BinaryBoxProtocol.connectionLost(self, reason)  # not AMP's: it logs a line
        self.transport = None

    # -- producer (the transport pauses us when its write buffer is full) ---------------

    def _set_paused(self, reason: str, paused: bool) -> None:
        mode = self.mode
        if mode is ConnectionMode.SWITCHED:
            return
        was_paused = bool(self._pause_reasons)
        if paused:
            self._pause_reasons.add(reason)
        else:
            self._pause_reasons.discard(reason)
        # While the mode is not closing the transport reads exactly when no reason is left.
        if (
            not self._pause_reading
            or self.transport is None
            or mode is ConnectionMode.CLOSING
            or was_paused == bool(self._pause_reasons)
        ):
            return
        if self._pause_reasons:
            self.ctransport.pauseProducing()
        else:
            self.ctransport.resumeProducing()

    def pauseProducing(self) -> None:
        self._set_paused("write", True)

    def resumeProducing(self) -> None:
        self._set_paused("write", False)
        self._drain()

    def stopProducing(self) -> None:
        self._mode.close()

    # -- input ------------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        mode = self.mode
        if mode is ConnectionMode.SWITCHED:
            assert self._core.sink is not None
            self._core.sink.client_data(data)
            return
        if mode is ConnectionMode.CLOSING:
            return
        if mode is ConnectionMode.AUTHENTICATING:
            self.drop("data before authentication")
            return
        self._parser.feed(data)
        if self._pause_reasons and self._parser.buffered > MAX_UNPARSED:
            self.drop("peer sends commands faster than it reads the answers")
            return
        self._drain()

    def _drain(self) -> None:
        while not self._pause_reasons and self.mode in _PARSING:
            if self._in_flight >= MAX_IN_FLIGHT:
                self._set_paused("in-flight", True)
                return
            try:
                box = self._parser.next_box()
            except FramingError as e:
                self.drop(f"framing error: {e}")
                return
            if box is None:
                return
            self._box_received(box)

    def _box_received(self, box: amp.AmpBox) -> None:
        if amp.ANSWER in box or amp.ERROR in box:
            tag = box.get(amp.ANSWER, box.get(amp.ERROR))
            outstanding: dict[bytes, object] = self._outstandingRequests or {}
            if tag not in outstanding:
                self.drop("answer or error for an unknown request")
                return
            if amp.ERROR in box and (amp.ERROR_CODE not in box or amp.ERROR_DESCRIPTION not in box):
                self.drop("malformed error box")
                return
            amp.BoxDispatcher.ampBoxReceived(self, box)
        elif amp.COMMAND in box:
            if amp.ASK not in box:
                self.drop("command without _ask")
                return
            self._command_received(box)
        else:
            self.drop("box is neither a command nor an answer")

    def _command_received(self, box: amp.AmpBox) -> None:
        tag = box[amp.ASK]
        self._in_flight += 1

        def answer(response: amp.AmpBox) -> amp.AmpBox:
            response[amp.ANSWER] = tag
            return response

        def error(failure: Failure) -> amp.AmpBox:
            out = amp.AmpBox()
            if failure.check(amp.RemoteAmpError):
                exc = failure.value
                desc = exc.description
                out[amp.ERROR_CODE] = exc.errorCode
                out[amp.ERROR_DESCRIPTION] = (
                    desc.encode("utf-8", "replace") if isinstance(desc, str) else desc
                )
            else:
                self.log.error(
                    "control: unexpected failure: {where}", where=describe_failure(failure)
                )
                out[amp.ERROR_CODE] = _INTERNAL
                out[amp.ERROR_DESCRIPTION] = b"internal error"
            out[amp.ERROR] = tag
            return out

        def done(_: object) -> None:
            self._in_flight -= 1
            if "in-flight" in self._pause_reasons and self._in_flight < MAX_IN_FLIGHT:
                self._set_paused("in-flight", False)
                self._drain()

        def switch(_: object) -> None:
            if self._core.mode is not ConnectionMode.AMP:  # amp loops: skipped per command
                self._answer_sent()

        d = self.dispatchCommand(box)
        d.addCallbacks(answer, error)
        d.addCallback(self._safeEmit)
        d.addCallback(switch)
        d.addErrback(self.unhandledError)
        d.addBoth(done)

    def dispatchCommand(self, box: amp.AmpBox) -> Deferred[amp.AmpBox]:
        responder = self.locator.locateResponder(box[amp.COMMAND])
        if responder is None:
            return fail(
                amp.RemoteAmpError(
                    amp.UNHANDLED_ERROR_CODE,
                    f"unhandled command {safe_repr(box[amp.COMMAND])}",
                    False,
                )
            )
        return maybeDeferred(responder, box)

    def locateResponder(self, name: bytes) -> Any:
        """Only the locator's commands: no ``StartTLS``, no ``amp_*`` string responders."""
        return self.locator.locateResponder(name)

    def ampBoxReceived(self, box: amp.AmpBox) -> None:
        self._box_received(box)

    def unhandledError(self, failure: Failure) -> None:
        self.log.error(
            "control: unhandled failure, dropping connection: {where}",
            where=describe_failure(failure),
        )
        self.drop("unhandled failure")
