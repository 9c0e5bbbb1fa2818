"""Security-2 T13 (control side): DestroyBottle ends the destroyed bottle's exec sessions."""

from __future__ import annotations

from twisted.internet.task import Clock

from bottlenet.control import commands as C
from bottlenet.control.execbroker import ExecBridge

from .fakes import Conn, make_factory


class _Child:
    """The process transport of a session's smolvm child: records the signals it gets."""

    def __init__(self) -> None:
        self.signals: list[str] = []

    def signalProcess(self, name: str) -> None:
        self.signals.append(name)

    def closeStdin(self) -> None:
        pass


def _session(bottle: str, clock: Clock) -> tuple[ExecBridge, _Child]:
    bridge = ExecBridge(
        bottle=bottle, peer="uid=0", tty=False, stdin=False, clock=clock, resize=lambda *_: None
    )
    child = _Child()
    bridge.makeConnection(child)  # type: ignore[arg-type]
    return bridge, child


def test_destroy_bottle_ends_its_exec_sessions() -> None:
    """T13: sessions used to keep streaming after their bottle's DestroyBottle answered."""
    clock = Clock()
    conn = Conn(make_factory(clock=clock))
    conn.call(C.CreateBottle, name="b1")
    conn.call(C.CreateBottle, name="b2")
    doomed, doomed_child = _session("b1", clock)
    other, other_child = _session("b2", clock)
    conn.factory.exec_sessions.update({doomed, other})
    assert conn.call(C.DestroyBottle, name="b1") == {}
    assert doomed_child.signals == ["TERM"]
    clock.advance(10)  # the grace period: then SIGKILL
    assert doomed_child.signals == ["TERM", "KILL"]
    assert other_child.signals == []  # another bottle's session is left alone
