"""Synchronous relay tests on fake transports: chunking, interleavings, connect phase."""

from __future__ import annotations

import errno

from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from twisted.internet.error import ConnectionRefusedError, TimeoutError, getConnectError
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from bottlenet.forward.relay import (
    OUTCOME_ABORTED,
    OUTCOME_CLOSED,
    OUTCOME_CONNECT_FAILED,
    OUTCOME_RESET,
    Outcome,
    Phase,
    RelayFailure,
    RelaySession,
)
from tests.forward.fakes import FakeEndpoint, FakeTransport, RecordingOwner


class Rig:
    """A session wired to two fake legs: A = agent side (accepted), B = target side."""

    def __init__(self, limit: int = 8) -> None:
        self.ticks: list = []
        self.endpoint = FakeEndpoint()
        self.owner = RecordingOwner()
        self.session = RelaySession(Clock(), self.endpoint, self.owner)
        self.A = FakeTransport(self.ticks, limit)
        self.B = FakeTransport(self.ticks, limit)
        self.A.makeConnection(self.session.inbound)

    def connect(self) -> None:
        self.endpoint.succeed(self.B)

    def tick(self) -> None:
        while self.ticks:
            self.ticks.pop(0)()


def test_accepted_leg_is_paused_until_connected() -> None:
    rig = Rig()
    assert rig.A.reading is False
    assert len(rig.endpoint.attempts) == 1
    rig.connect()
    assert rig.A.reading is True
    assert rig.A.producer is not None and rig.B.producer is not None


@given(chunks=st.lists(st.binary(min_size=1, max_size=40), max_size=30), data=st.data())
def test_chunking_invariance(chunks: list[bytes], data: st.DataObject) -> None:
    """However the stream is cut and whenever the far end drains, the bytes come out intact."""
    rig = Rig(limit=16)
    rig.connect()
    for chunk in chunks:
        # The relay only gets data while its leg is reading (backpressure pauses it).
        while not rig.A.reading:
            rig.B.flush()
        rig.session.inbound.dataReceived(chunk)
        if data.draw(st.booleans()):
            rig.B.flush()
    rig.B.flush()
    assert bytes(rig.B.delivered) == b"".join(chunks)
    assert rig.session.bytes_in == sum(map(len, chunks))


def test_half_close_agent_first_then_reply() -> None:
    rig = Rig()
    rig.connect()
    rig.session.inbound.dataReceived(b"request")
    rig.A.reading = False
    rig.session.inbound.readConnectionLost()
    rig.B.flush()
    assert rig.B.write_shut and bytes(rig.B.delivered) == b"request"
    # The target still answers after the agent's FIN.
    out = rig.B.protocol
    out.dataReceived(b"reply")
    out.readConnectionLost()
    rig.A.flush()
    rig.tick()
    assert bytes(rig.A.delivered) == b"reply"
    assert rig.A.closed and rig.B.closed
    assert [e[1] for e in rig.owner.ends] == [OUTCOME_CLOSED]


def test_fin_waits_for_paused_producer_trap() -> None:
    """Trap 1: a FIN requested while the writer's producer is paused must still go out."""
    rig = Rig(limit=4)
    rig.connect()
    rig.session.inbound.dataReceived(b"0123456789")  # over the limit: A gets paused
    assert rig.A.reading is False
    rig.session.inbound.readConnectionLost()
    rig.B.flush()
    assert rig.B.write_shut, "FIN must be sent once the buffer drained"
    assert rig.A.reading is False, "a leg at EOF must not be resumed"


def test_reset_on_one_leg_aborts_the_other() -> None:
    rig = Rig()
    rig.connect()
    rig.B.remote_reset()
    rig.tick()
    assert rig.A.close_how == "abort"
    assert [e[1] for e in rig.owner.ends] == [OUTCOME_RESET]


def test_reset_after_half_close_still_aborts_peer() -> None:
    """The peer is reset, not closed cleanly, even when its write side is already shut."""
    rig = Rig()
    rig.connect()
    rig.session.inbound.readConnectionLost()
    rig.B.flush()
    assert rig.B.write_shut
    rig.A.remote_reset()
    rig.tick()
    assert rig.B.close_how == "abort"
    assert [e[1] for e in rig.owner.ends] == [OUTCOME_RESET]


def test_connect_failure_resets_client() -> None:
    rig = Rig()
    _, d = rig.endpoint.attempts[0]
    d.errback(Failure(ConnectionRefusedError()))
    rig.tick()
    assert rig.A.close_how == "abort"
    ((_, outcome, reason),) = rig.owner.ends
    assert outcome == OUTCOME_CONNECT_FAILED
    assert reason is not None and "ConnectionRefused" in reason.describe()


def test_connect_timeout_is_a_connect_failure() -> None:
    rig = Rig()
    _, d = rig.endpoint.attempts[0]
    d.errback(Failure(TimeoutError()))
    rig.tick()
    assert [(e[1], e[2]) for e in rig.owner.ends] == [
        (OUTCOME_CONNECT_FAILED, RelayFailure("TimeoutError"))
    ]


def test_connect_failure_carries_the_errno_as_a_value() -> None:
    """EMFILE reaches the owner as errno.EMFILE (the listener backs off on it), not a string."""
    rig = Rig()
    _, d = rig.endpoint.attempts[0]
    # (what FastClientEndpoint and Twisted's endpoints fail with when socket() hits EMFILE)
    d.errback(Failure(getConnectError((errno.EMFILE, "Too many open files"))))
    rig.tick()
    ((_, outcome, reason),) = rig.owner.ends
    assert outcome == OUTCOME_CONNECT_FAILED
    assert reason == RelayFailure("ConnectError", errno.EMFILE)
    assert reason.describe() == "ConnectError:EMFILE"
    assert RelayFailure.of(Failure(OSError(errno.ENFILE, "x"))).errno == errno.ENFILE


def test_abort_while_connecting_cancels_the_connect() -> None:
    rig = Rig()
    rig.session.abort()
    assert rig.endpoint.cancelled == 1
    rig.tick()
    assert rig.A.close_how == "abort"
    assert [e[1] for e in rig.owner.ends] == [OUTCOME_ABORTED]
    assert rig.session.ended


def test_client_gone_while_connecting_cancels_the_connect() -> None:
    rig = Rig()
    rig.A.remote_reset()
    assert rig.endpoint.cancelled == 1
    assert [e[1] for e in rig.owner.ends] == [OUTCOME_RESET]


def test_abort_running_relay() -> None:
    rig = Rig()
    rig.connect()
    rig.session.abort()
    rig.tick()
    assert rig.A.close_how == rig.B.close_how == "abort"
    assert [e[1] for e in rig.owner.ends] == [OUTCOME_ABORTED]


def test_outcomes_keep_the_strings_logs_and_counters_show() -> None:
    """The Outcome StrEnum is today's strings (logs, rate-limit keys and tests read them)."""
    assert [str(o) for o in Outcome] == ["closed", "reset", "connect-failed", "aborted"]
    assert OUTCOME_CONNECT_FAILED == "connect-failed" and f"{OUTCOME_RESET}" == "reset"


def test_a_session_goes_connecting_relaying_ended() -> None:
    """The phase read-out follows the connection: connecting, relaying, then ended once."""
    rig = Rig()
    assert rig.session.phase is Phase.CONNECTING and not rig.session.ended
    rig.connect()
    assert rig.session.phase is Phase.RELAYING
    rig.session.abort()
    rig.tick()
    assert rig.session.phase is Phase.ENDED and rig.session.ended
    assert [e[1] for e in rig.owner.ends] == [OUTCOME_ABORTED]


def test_when_ended_fires_for_early_and_late_waiters() -> None:
    """A waiter from before the end and one from after both fire, each with its own Deferred."""
    rig = Rig()
    early = rig.session.when_ended()
    assert not early.called
    rig.A.remote_reset()
    late = rig.session.when_ended()
    assert early.called and late.called and early is not late
    assert rig.session.phase is Phase.ENDED


class RelayMachine(RuleBasedStateMachine):
    """Interleavings of data, backpressure, FIN each way and RST on a connected relay."""

    @initialize()
    def start(self) -> None:
        self.rig = Rig(limit=8)
        self.rig.connect()
        self.legs = {"a": self.rig.A, "b": self.rig.B}
        self.protos = {"a": self.rig.session.inbound, "b": self.rig.B.protocol}
        self.sent = {"a": bytearray(), "b": bytearray()}  # what each remote end sent
        self.inbox = {"a": bytearray(), "b": bytearray()}  # sent but not yet read by the relay
        self.fin = {"a": False, "b": False}
        self.eof = {"a": False, "b": False}
        self.rst = False

    def _other(self, side: str) -> str:
        return "b" if side == "a" else "a"

    @rule(side=st.sampled_from("ab"), data=st.binary(min_size=1, max_size=12))
    def send(self, side: str, data: bytes) -> None:
        if not self.fin[side] and not self.legs[side].closed:
            self.sent[side] += data
            self.inbox[side] += data

    @rule(side=st.sampled_from("ab"), n=st.integers(1, 16))
    def read(self, side: str, n: int) -> None:
        leg = self.legs[side]
        if leg.closed or not leg.reading:
            return
        if self.inbox[side]:
            chunk = bytes(self.inbox[side][:n])
            del self.inbox[side][:n]
            self.protos[side].dataReceived(chunk)
        elif self.fin[side] and not self.eof[side]:
            self.eof[side] = True
            leg.reading = False  # the reactor stops reading a descriptor at EOF
            self.protos[side].readConnectionLost()

    @rule(side=st.sampled_from("ab"))
    def send_fin(self, side: str) -> None:
        self.fin[side] = True

    @rule(side=st.sampled_from("ab"))
    def drain(self, side: str) -> None:
        self.legs[side].flush()

    @precondition(lambda self: not self.rst)
    @rule(side=st.sampled_from("ab"))
    def reset(self, side: str) -> None:
        if not self.legs[side].closed:
            self.rst = True
            self.legs[side].remote_reset()

    @rule()
    def tick(self) -> None:
        self.rig.tick()

    @invariant()
    def bytes_in_order_and_intact(self) -> None:
        for side in "ab":
            out = self.legs[self._other(side)]
            written = bytes(out.delivered + out.pending)
            assert bytes(self.sent[side]).startswith(written)

    @invariant()
    def nothing_written_after_fin(self) -> None:
        assert self.rig.A.writes_after_fin == 0 and self.rig.B.writes_after_fin == 0

    @invariant()
    def closed_only_when_finished(self) -> None:
        if self.rig.A.closed and self.rig.B.closed and not self.rst:
            assert self.eof["a"] and self.eof["b"]
            assert bytes(self.rig.B.delivered) == bytes(self.sent["a"])
            assert bytes(self.rig.A.delivered) == bytes(self.sent["b"])

    def _settle(self) -> None:
        for _ in range(50):
            self.rig.tick()
            self.rig.A.flush()
            self.rig.B.flush()
        self.rig.tick()

    @rule()
    def no_producer_left_paused(self) -> None:
        """Once everything drained, every open leg that has not seen EOF is reading."""
        self._settle()
        for side in "ab":
            leg = self.legs[side]
            if not leg.closed and not self.eof[side]:
                assert leg.reading, f"leg {side} left paused"

    def teardown(self) -> None:
        if not hasattr(self, "rig"):
            return
        # Let both ends finish: read everything, FIN both ways, drain.
        for side in "ab":
            self.fin[side] = True
        for _ in range(200):
            for side in "ab":
                self.read(side, 64)
            self._settle()
        assert self.rig.A.closed and self.rig.B.closed, "closed iff both FINs and drained"
        outcomes = [e[1] for e in self.rig.owner.ends]
        if self.rst:
            assert outcomes == [OUTCOME_RESET]
        else:
            assert outcomes == [OUTCOME_CLOSED]
            assert bytes(self.rig.B.delivered) == bytes(self.sent["a"])
            assert bytes(self.rig.A.delivered) == bytes(self.sent["b"])


TestRelayMachine = RelayMachine.TestCase
