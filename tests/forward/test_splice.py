"""splice() engine specifics on real sockets: producer pausing, pipes, take-over, fallback."""

from __future__ import annotations

import errno
import os
import socket
from typing import Any

from twisted.internet import defer, reactor

from benchmarks.standalone import TwistedConnectTable
from bottlenet.forward.listen import HeldTCPServer
from bottlenet.forward.splice import (
    PINNED_SOFT_MAX,
    PIPE_MAX,
    POOL_MAX,
    STALL_WINDOW,
    SpliceEngines,
    SpliceRelay,
    splice_supported,
)
from tests.forward.netutil import Collector, Echo, pattern, sha
from tests.forward.test_loopback import Base, MiB, sleep

SKIP = None if splice_supported() else "splice() is Linux-only"


def pipe_fds() -> int:
    return sum(1 for n in os.listdir("/proc/self/fd") if _link(n).startswith("pipe:"))


def _link(n: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{n}")
    except OSError:
        return ""


class Silent(Collector):
    """A target that never reads: whatever is sent to it piles up in the relay's pipe."""

    def connectionMade(self) -> None:
        self.transport.pauseProducing()  # type: ignore[union-attr]


class SpliceTests(Base):
    engine = "splice"
    skip = SKIP

    @property
    def engines(self) -> SpliceEngines:
        e = self.table.engine_factory
        assert isinstance(e, SpliceEngines)
        return e

    async def echo_client(self, info: Any) -> Collector:
        c = Collector(b"x", fin=False)
        got: defer.Deferred[None] = defer.Deferred()
        c.on_data = lambda col: got.called or got.callback(None)
        await self.client(info, c)
        await got
        return c

    async def test_pause_stops_reading_both_sockets_until_resumed(self) -> None:
        info = await self.forward(self.target(Echo))
        c = await self.echo_client(info)
        (s,) = self.sessions()
        engine = s.engine
        assert isinstance(engine, SpliceRelay) and engine.spliced
        ends = {engine._up.src, engine._down.src}  # type: ignore[union-attr]
        assert ends <= set(reactor.getReaders())
        s.pauseProducing()
        assert not (ends & set(reactor.getReaders()))
        c.transport.write(b"y")  # type: ignore[union-attr]
        await sleep(0.05)  # reactor passes in which a reader would have forwarded "y"
        assert engine.bytes_in == 1  # only the first byte went through
        got: defer.Deferred[None] = defer.Deferred()
        c.on_data = lambda col: got.called or got.callback(None)
        s.resumeProducing()
        await got
        assert bytes(c.received) == b"xy" and engine.bytes_in == 2
        c.transport.loseConnection()  # type: ignore[union-attr]
        await c.done

    async def test_pause_resume_while_the_destination_blocks_keeps_order(self) -> None:
        """A resume must not read a source whose pipe still holds bytes (trap 3).

        The target stops reading, so the relay's pipe fills and the source is left unread;
        a pause and resume from outside (the session's producer) must keep it unread until
        the pipe drains, else later bytes overtake (or overwrite) the held ones.
        """
        silent = Silent(fin=False)
        info = await self.forward(self.target(lambda: silent))
        data = pattern(8 * MiB, seed=21)
        c = await self.client(info, Collector(data, fin=False))
        await self.until(
            lambda: any(s.engine and s.engine._up and s.engine._up.inpipe for s in self.sessions()),
            "bytes held in a pipe",
        )
        (s,) = self.sessions()
        up = s.engine._up
        assert up.inpipe and not up.src.reading
        s.pauseProducing()
        s.resumeProducing()
        assert not up.src.reading, "resumed reading a source whose pipe still holds bytes"
        await sleep(0.02)  # reactor passes in which a wrongly enabled reader would pump
        silent.transport.resumeProducing()  # type: ignore[union-attr]
        await self.until(lambda: len(silent.received) >= len(data), "all bytes at the target")
        assert sha(bytes(silent.received)) == sha(data)
        c.transport.loseConnection()  # type: ignore[union-attr]
        await c.done

    async def stalled_upload(self) -> tuple[Any, Collector]:
        """One relay whose target never reads: its upload stalls, bytes held in its pipe."""
        silent = Silent(fin=False)
        info = await self.forward(self.target(lambda: silent))
        c = await self.client(info, Collector(pattern(8 * MiB), fin=False))
        await self.until(
            lambda: any(s.engine._up and s.engine._up.inpipe for s in self.sessions()),
            "bytes held in a pipe",
        )
        (s,) = self.sessions()
        return s, c

    async def test_t4_a_stalled_relay_ends_when_the_agent_resets(self) -> None:
        """T4: the target never reads, so the relay stops reading the agent and (the target
        sending nothing) polls its socket for nothing: the agent's reset still ends the relay
        at once (it lingered until the idle timeout, holding its fds)."""
        s, c = await self.stalled_upload()
        agent = s.engine._up.src
        assert not (agent.reading or agent.writing)  # in no epoll set of the reactor
        c.transport.abortConnection()  # type: ignore[union-attr]
        await self.until(lambda: not self.sessions(), "the relay's end after the agent's reset")
        assert not self.engines.hangups._ends

    async def test_t4_a_stall_pins_at_most_one_read_counted_and_released(self) -> None:
        """T4: what a stalled direction holds in its pipe is one read (at most PIPE_MAX),
        counted in ``pinned``; its next reads start again at STALL_WINDOW; the relay's end
        releases the count."""
        s, c = await self.stalled_upload()
        up = s.engine._up
        assert 0 < up.inpipe <= PIPE_MAX and self.engines.pinned == up.inpipe
        assert up.window == STALL_WINDOW
        c.transport.abortConnection()  # type: ignore[union-attr]
        await self.until(lambda: not self.sessions(), "relay end")
        assert self.engines.pinned == 0

    async def test_t4_drained_bytes_are_no_longer_counted_as_pinned(self) -> None:
        """T4: once the target reads again and the stalled pipe drains, ``pinned`` is back
        to 0 while the relay is still open (tests-3 F09: drained bytes stayed counted, and
        past PINNED_SOFT_MAX in all every relay's reads stayed at STALL_WINDOW)."""
        silent = Silent(fin=False)
        info = await self.forward(self.target(lambda: silent))
        data = pattern(8 * MiB)
        c = await self.client(info, Collector(data, fin=False))
        await self.until(
            lambda: any(s.engine._up and s.engine._up.inpipe for s in self.sessions()),
            "bytes held in a pipe",
        )
        assert self.engines.pinned > 0
        silent.transport.resumeProducing()  # type: ignore[union-attr]
        await self.until(lambda: len(silent.received) == len(data), "every byte delivered")
        assert len(self.sessions()) == 1  # the relay is still open (no FIN either way)
        assert self.engines.pinned == 0
        c.transport.abortConnection()  # type: ignore[union-attr]
        await self.until(lambda: not self.sessions(), "relay end")

    async def bulk_window(self, pinned: int) -> int:
        """The upload window of a 4 MiB bulk relay once every byte is through, while
        ``pinned`` bytes are counted as if other relays held them in stalled pipes."""
        self.engines.pinned += pinned
        try:
            sink = Collector(b"", fin=False)
            info = await self.forward(self.target(lambda: sink))
            data = pattern(4 * MiB, seed=3)
            c = await self.client(info, Collector(data, fin=False))
            await self.until(lambda: len(sink.received) == len(data), "every byte delivered")
            (s,) = self.sessions()
            window: int = s.engine._up.window
            c.transport.abortConnection()  # type: ignore[union-attr]
            await self.until(lambda: not self.sessions(), "relay end")
        finally:
            self.engines.pinned -= pinned
        return window

    async def test_t4_past_the_soft_cap_of_pinned_bytes_windows_stay_small(self) -> None:
        """T4: while PINNED_SOFT_MAX bytes are pinned a bulk transfer's reads stay at
        STALL_WINDOW (tests-3 F07)."""
        assert await self.bulk_window(PINNED_SOFT_MAX) == STALL_WINDOW

    async def test_t4_below_the_soft_cap_windows_grow(self) -> None:
        """T4: the control case of the test above: nothing pinned, the window grows."""
        assert await self.bulk_window(0) > STALL_WINDOW

    def test_engine_fds_is_what_the_engine_holds_at_most(self) -> None:
        """The budget's ENGINE_FDS (tests-3 F04) is every fd the engine itself can hold: a
        full pool, the scratch pipe and the hang-up watch's epoll; one pipe more is closed."""
        from twisted.internet.testing import MemoryReactor

        from bottlenet.forward.splice import ENGINE_FDS, _End, _Pipe

        engines = SpliceEngines(MemoryReactor())
        a, b = socket.socketpair()
        before = len(os.listdir("/proc/self/fd"))
        try:
            engines.scratch()  # first: taken later, it would come out of the pool
            for _ in range(POOL_MAX + 1):
                engines.release(_Pipe())
            engines.hangups.track(_End(None, a))  # type: ignore[arg-type]
            assert len(os.listdir("/proc/self/fd")) - before == ENGINE_FDS
        finally:
            engines.close()
            a.close()
            b.close()
        assert len(os.listdir("/proc/self/fd")) == before - 2

    async def test_pipes_grow_under_bulk_and_are_pooled(self) -> None:
        data = pattern(16 * MiB, seed=5)
        info = await self.forward(self.target(Echo))
        warm = await self.echo_client(info)  # the reactor may open its own pipes lazily
        warm.transport.loseConnection()  # type: ignore[union-attr]
        await self.until(lambda: not self.sessions(), "warm-up relay end")
        before = pipe_fds() - 2 * self.engines.pipes_open()
        c = await self.client(info, Collector(data, fin=True))
        await c.done
        assert sha(bytes(c.received)) == sha(data)
        await self.until(lambda: not self.sessions(), "relay end")
        pipes = list(self.engines._pool)
        if self.engines._scratch is not None:
            pipes.append(self.engines._scratch)
        assert max(p.size for p in pipes) > 64 * 1024, [p.size for p in pipes]
        assert len(self.engines._pool) <= POOL_MAX
        # Every pipe fd belongs to the engine's scratch/pool: none leaked with the relay.
        assert pipe_fds() - before == 2 * self.engines.pipes_open()

    async def test_aborted_relay_never_returns_a_full_pipe_to_the_pool(self) -> None:
        """Trap 6: bytes left in a pipe must not leak into the next relay."""
        silent = Silent(fin=False)
        info = await self.forward(self.target(lambda: silent))
        c = await self.client(info, Collector(pattern(8 * MiB), fin=False))
        await self.until(
            lambda: any(
                d.inpipe for s in self.sessions() for d in (s.engine._up, s.engine._down) if d
            ),
            "bytes held in a pipe",
        )
        (s,) = self.sessions()
        held = s.engine._up.pipe
        assert held is not None
        await self.table.remove("b1", "web")
        await c.done
        assert held not in self.engines._pool and held is not self.engines._scratch
        # A fresh relay through a fresh forward sees exactly its own bytes.
        info = await self.forward(self.target(Echo), label="next")
        data = pattern(3 * MiB, seed=11)
        c2 = await self.client(info, Collector(data, fin=True))
        await c2.done
        assert sha(bytes(c2.received)) == sha(data) and c2.clean

    async def test_end_is_reported_after_the_sockets_are_closed(self) -> None:
        """Trap 4: sockets close on a later pass than the one that ended the relay."""
        info = await self.forward(self.target(Echo))
        c = await self.echo_client(info)
        (s,) = self.sessions()
        socks = s.engine.sockets()
        seen: list[list[int]] = []
        real_report = s._report

        def spy(outcome: str) -> None:
            seen.append([sk.fileno() for sk in socks])
            real_report(outcome)

        s._report = spy
        c.transport.loseConnection()  # type: ignore[union-attr]
        await c.done
        await s.when_ended()
        assert seen == [[-1, -1]]

    async def test_accepted_socket_goes_straight_to_the_relay(self) -> None:
        """The accept fast path: a target that connects at once gets no transport, protocol
        or Deferred for the connection, only the relay on the two sockets."""
        info = await self.forward(self.target(Echo))
        c = await self.echo_client(info)
        (s,) = self.sessions()
        assert s._inbound is None  # no Leg (and so no tcp.Server) was built
        assert isinstance(s.engine, SpliceRelay) and s.engine.spliced
        assert all(sk.gettimeout() == 0.0 for sk in s.engine.sockets())  # trap 5
        c.transport.loseConnection()  # type: ignore[union-attr]
        await c.done

    async def test_connect_in_progress_continues_on_the_transport_path(self) -> None:
        """When the target's connect does not complete inside the call, the accepted socket
        is wrapped in the paused transport and the *same* connect goes on: one connection
        reaches the target, and the relay still ends up spliced."""
        accepted: list[object] = []

        class Counting(Echo):
            def connectionMade(self) -> None:
                accepted.append(self)
                super().connectionMade()

        info = await self.forward(self.target(Counting))
        endpoint: Any = self.table.target("b1", "web")
        real_open = endpoint.open

        def in_progress() -> tuple[socket.socket | None, int]:
            sock, err = real_open()
            return sock, (errno.EINPROGRESS if sock is not None else err)

        endpoint.open = in_progress  # type: ignore[method-assign]
        data = pattern(MiB, seed=4)
        c = await self.client(info, Collector(data, fin=True))
        await c.done
        assert sha(bytes(c.received)) == sha(data) and c.clean
        assert len(accepted) == 1  # the started connect was used, not a second one
        assert (self.engines.taken_over, self.engines.fallbacks) == (1, 0)
        counters = self.table.get("b1", "web").counters
        assert counters.accepted == 1 and counters.failed == 0
        # The endpoint's shared timeout timer (armed for the attempt) is not needed any more.
        if endpoint._timer is not None and endpoint._timer.active():
            endpoint._timer.cancel()

    async def test_refused_target_on_the_fast_path_resets_and_counts(self) -> None:
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()  # nothing listens there: the connect fails inside the accept
        info = await self.forward(port)
        await self.assert_reset(info)

        def counted() -> bool:
            c = self.table.get("b1", "web").counters
            return c.failed == 1 and c.active == 0

        await self.until(counted, "connect failure counted")
        assert self.table.get("b1", "web").counters.accepted == 1

    async def test_transport_that_cannot_hand_over_falls_back_to_portable(self) -> None:
        # Twisted's client transports (the benchmarks' table) have no detach_socket
        self.table = self.start_table(TwistedConnectTable)
        info = await self.forward(self.target(Echo))
        data = pattern(MiB, seed=2)
        c = await self.client(info, Collector(data, fin=True))
        await c.done
        assert sha(bytes(c.received)) == sha(data) and c.clean
        assert (self.engines.fallbacks, self.engines.taken_over) == (1, 0)


def test_detach_refused_once_a_transport_has_read() -> None:
    a, b = socket.socketpair()
    try:
        t = HeldTCPServer(a, Collector(), ("127.0.0.1", 1), None, 1, reactor)
        t.resumeProducing()  # it may have read now: never hand it over
        t.stopReading()
        assert t.detach_socket() is None
        assert t.socket is a and t.connected
    finally:
        a.close()
        b.close()


def test_detached_transport_is_inert() -> None:
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        t = HeldTCPServer(a, Collector(), ("127.0.0.1", 1), None, 1, reactor)
        assert t.detach_socket() is a
        assert t.fileno() == -1 and not t.connected
        t.write(b"nothing")
        t.loseConnection()
        t.abortConnection()
        t.resumeProducing()
        a.send(b"still ours")  # Twisted neither shut down nor closed it
        assert b.recv(20) == b"still ours"
    finally:
        a.close()
        b.close()
