"""A fake process reactor (modelled on procmon's DummyProcessReactor) driven by a Clock."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from twisted.internet.error import ProcessDone, ProcessExitedAlready, ProcessTerminated
from twisted.internet.interfaces import IProcessProtocol, IReactorProcess, IReactorTime
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from zope.interface import implementer

SIGNALS = {"TERM": 15, "KILL": 9}


class FakeProcess:
    """Records what the runner does to its child; the test decides when it exits."""

    def __init__(
        self,
        reactor: FakeProcessReactor,
        proto: IProcessProtocol,
        executable: str,
        args: Sequence[str],
        env: Mapping[str, str] | None,
        path: str | None,
        usePTY: bool,
    ) -> None:
        self.reactor = reactor
        self.proto = proto
        self.executable = executable
        self.args = list(args)
        self.env = env
        self.path = path
        self.usePTY = usePTY
        self.pid: int | None = 4242 + len(reactor.spawned)
        self.signals: list[str] = []
        self.stdin = b""
        self.stdin_closed = False
        self.lost = False
        self.exited = False
        self.ended = False
        self.ignore_term = False

    # IProcessTransport bits the runner uses
    def write(self, data: bytes) -> None:
        assert not self.stdin_closed
        self.stdin += data

    def closeStdin(self) -> None:
        self.stdin_closed = True

    def loseConnection(self) -> None:
        self.lost = True
        if self.exited and not self.ended:
            self.end_only()

    def signalProcess(self, sig: str) -> None:
        if self.exited:
            raise ProcessExitedAlready()
        self.signals.append(sig)
        if sig == "TERM" and self.ignore_term:
            return
        self.finish(signal=SIGNALS[sig])

    # test controls
    def output(self, out: bytes = b"", err: bytes = b"") -> None:
        if out:
            self.proto.childDataReceived(1, out)
        if err:
            self.proto.childDataReceived(2, err)

    def _reason(self) -> Failure:
        if self._signal is not None:
            return Failure(ProcessTerminated(None, self._signal, None))
        if self._code == 0:
            return Failure(ProcessDone(0))
        return Failure(ProcessTerminated(self._code, None, None))

    def exit_only(self, code: int | None = 0, signal: int | None = None) -> None:
        """The child is reaped but its pipes stay open (a grandchild holds them)."""
        self._code, self._signal = code, signal
        self.exited = True
        self.pid = None
        self.proto.processExited(self._reason())

    def end_only(self) -> None:
        self.ended = True
        self.proto.processEnded(self._reason())

    def finish(
        self, code: int | None = 0, signal: int | None = None, out: bytes = b"", err: bytes = b""
    ) -> None:
        self.output(out, err)
        self.exit_only(code, signal)
        self.end_only()


Responder = Callable[[FakeProcess], None]


@implementer(IReactorProcess, IReactorTime)
class FakeProcessReactor(Clock):
    """spawnProcess records a FakeProcess; an optional responder finishes it right away."""

    def __init__(self, responder: Responder | None = None) -> None:
        super().__init__()
        self.spawned: list[FakeProcess] = []
        self.responder = responder
        self.spawn_error: OSError | None = None

    def spawnProcess(
        self,
        processProtocol: IProcessProtocol,
        executable: bytes | str,
        args: Sequence[bytes | str],
        env: Mapping[bytes | str, bytes | str] | None = None,
        path: bytes | str | None = None,
        uid: int | None = None,
        gid: int | None = None,
        usePTY: bool = False,
        childFDs: Mapping[int, int | str] | None = None,
    ) -> Any:
        if self.spawn_error is not None:
            raise self.spawn_error
        proc = FakeProcess(
            self,
            processProtocol,
            str(executable),
            [str(a) for a in args],
            None if env is None else {str(k): str(v) for k, v in env.items()},
            None if path is None else str(path),
            usePTY,
        )
        self.spawned.append(proc)
        processProtocol.makeConnection(proc)  # type: ignore[arg-type]
        if self.responder is not None:
            self.responder(proc)
        return proc


def scripted(table: Callable[[list[str]], tuple[int, bytes, bytes]]) -> Responder:
    """A responder that answers every spawn from ``table(args_after_binary)``."""

    def respond(proc: FakeProcess) -> None:
        code, out, err = table(proc.args[1:])
        proc.finish(code, out=out, err=err)

    return respond
