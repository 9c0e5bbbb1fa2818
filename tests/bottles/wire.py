"""A launcher's control calls answered in process: the daemon's own control server factory
over a rig's registry (``memsmolvm.Rig``, the in-memory smolvm TEST DOUBLE), on the rig's clock.

Each call is the AMP box a client sends (``bottlenet.control.calls``), fed to the server
protocol on a string transport; the rig is settled and the answer box decoded as the clients
decode it, typed error included. No socket, no reactor, no daemon.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

from twisted.protocols import amp

from bottlenet.control import codec
from bottlenet.control import commands as C
from bottlenet.control.calls import Call
from tests.bottles.memsmolvm import Rig
from tests.control.fakes import Conn, make_factory

T = TypeVar("T")


class Wire:
    """``wire(call)``: send it, settle the rig, return the converted answer (or raise)."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.conn = Conn(make_factory(cast(Any, rig.registry), clock=rig.clock))
        self.tag = 0
        self._answers: dict[bytes, amp.AmpBox] = {}

    def close(self) -> None:
        self.conn.close()

    def send(self, c: Call[Any]) -> bytes:
        """Send ``c`` and settle the rig; its tag (for :meth:`answer`)."""
        self.tag += 1
        tag = b"%x" % self.tag
        self.conn.send(codec.encode_request(C.BY_NAME[c.command], tag, c.arguments))
        self.rig.settle()
        return tag

    def answered(self, tag: bytes) -> bool:
        for box in self.conn.boxes():
            self._answers[box.get(amp.ANSWER) or box[amp.ERROR]] = box
        return tag in self._answers

    def answer(self, tag: bytes, c: Call[T]) -> T:
        """The answer to the call sent as ``tag`` (it must have come)."""
        self.rig.settle()
        assert self.answered(tag), f"no answer to {c.command} yet"
        box = self._answers.pop(tag)
        return c.convert(codec.decode_answer(C.BY_NAME[c.command], box))

    def __call__(self, c: Call[T]) -> T:
        return self.answer(self.send(c), c)
