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

from collections.abc import Callable
from typing import Any, Protocol, cast

from twisted.internet.defer import Deferred, fail, maybeDeferred
from twisted.internet.interfaces import IConsumer, IPushProducer, ISystemHandle, ITCPTransport
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.protocols import amp
from twisted.python.failure import Failure
from zope.interface import implementer

from bottlenet.control.commands import InternalError
from bottlenet.control.framing import BoxParser, FramingError
from bottlenet.errors import BottlenetError, InvalidArgument, safe_repr

# At most this many commands of one connection run at once; more are left unparsed.
MAX_IN_FLIGHT = 16
# While parsing is paused on a transport we keep reading (TLS), at most this much input waits.
MAX_UNPARSED = 1024 * 1024

_INTERNAL = InternalError.code.encode("ascii")


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


@implementer(IPushProducer)
class HardenedAMP(amp.AMP):
    """AMP with bounded parsing, value-free errors and read back-pressure."""

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
        self._closing = False
        self._reading_enabled = True
        self._pending_switch: StreamSink | None = None
        self._switched: StreamSink | None = None

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
        self.ctransport.registerProducer(self, True)

    def close(self) -> None:
        """Close cleanly. Unregister first: TLS waits for that before its close_notify."""
        if self.transport is None:
            return
        self.ctransport.unregisterProducer()
        self.ctransport.loseConnection()

    def drop(self, why: str) -> None:
        """Close this connection now, for a reason we wrote (never peer bytes)."""
        if self._closing:
            return
        self._closing = True
        self.log.warn("control: closing connection ({peer}): {why}", why=why, **self.log_fields())
        if self.transport is not None:
            self.ctransport.abortConnection()

    def log_fields(self) -> dict[str, object]:
        """Structured fields naming the peer (at least ``peer``) for log lines about it."""
        return {"peer": "unauthenticated"}

    # -- switching away from AMP (exec sessions) -----------------------------------------

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def switch_after_answer(self, sink: StreamSink) -> None:
        """Once the answer of the command being handled is written, the connection stops
        speaking AMP: every later byte goes to ``sink`` (and none is parsed as a box)."""
        self._pending_switch = sink

    def _switch(self) -> None:
        sink, self._pending_switch = self._pending_switch, None
        if sink is None or self.transport is None or self._closing:
            if sink is not None:
                sink.client_lost()
            return
        self._switched = sink
        self.ctransport.unregisterProducer()
        if not self._reading_enabled:
            self._reading_enabled = True
            self.ctransport.resumeProducing()
        self._pause_reasons.clear()
        sink.attach(self.transport, self._parser.take_rest())

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._closing = True
        sink, self._switched = self._switched, None
        if sink is not None:
            sink.client_lost()
        pending, self._pending_switch = self._pending_switch, None
        if pending is not None:
            pending.client_lost()
        if self._parser.mid_box and self._parser.failed is None:
            self.log.info("control: connection closed mid-box (truncated frame)")
        amp.BinaryBoxProtocol.connectionLost(self, reason)  # not AMP's: it logs a line
        self.transport = None

    # -- producer (the transport pauses us when its write buffer is full) ---------------

    def _set_paused(self, reason: str, paused: bool) -> None:
        if self._switched is not None:
            return
        if paused:
            self._pause_reasons.add(reason)
        else:
            self._pause_reasons.discard(reason)
        want_reading = not self._pause_reasons
        if (
            not self._pause_reading
            or self.transport is None
            or self._closing
            or want_reading == self._reading_enabled
        ):
            return
        self._reading_enabled = want_reading
        if want_reading:
            self.ctransport.resumeProducing()
        else:
            self.ctransport.pauseProducing()

    def pauseProducing(self) -> None:
        self._set_paused("write", True)

    def resumeProducing(self) -> None:
        self._set_paused("write", False)
        self._drain()

    def stopProducing(self) -> None:
        self._closing = True

    # -- input ------------------------------------------------------------------------

    def may_parse(self) -> bool:
        """Subclasses refuse parsing until the peer is authenticated."""
        return True

    def dataReceived(self, data: bytes) -> None:
        if self._switched is not None:
            self._switched.client_data(data)
            return
        if self._closing or not self.may_parse():
            return
        self._parser.feed(data)
        if self._pause_reasons and self._parser.buffered > MAX_UNPARSED:
            self.drop("peer sends commands faster than it reads the answers")
            return
        self._drain()

    def _drain(self) -> None:
        while not self._closing and not self._pause_reasons and self._switched is None:
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
            if self._pending_switch is not None:
                self._switch()

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
