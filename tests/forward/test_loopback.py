"""Real loopback relays through a ForwardTable (trial TestCases on the real reactor)."""

from __future__ import annotations

import array
import errno
import ipaddress
import os
import shutil
import socket
import stat
import tempfile
from typing import Any

from twisted.internet import reactor, task, threads
from twisted.internet.error import (
    ConnectError,
    ConnectionDone,
    ConnectionLost,
    ConnectionRefusedError,
)
from twisted.logger import formatEvent
from twisted.trial import unittest

from benchmarks.standalone import TwistedConnectTable
from bottlenet.forward.relay import EAGER_SEND
from bottlenet.forward.spec import (
    ForwardSpec,
    HeldSocket,
    TCPListen,
    TCPTarget,
    UNIXListen,
    UNIXTarget,
    targets_dir,
    unix_listen_for,
)
from bottlenet.forward.splice import PIPE_MAX, SpliceRelay, splice_supported
from bottlenet.forward.table import ForwardInfo, ForwardTable, _ForwardFactory
from tests.forward.netutil import (
    Collector,
    Echo,
    ReplyAfterEOF,
    ResetAfter,
    SendThenFINThenRead,
    StreamOut,
    connect_tcp,
    connect_unix,
    factory_of,
    pattern,
    registry_with,
    sha,
)

MiB = 1024 * 1024
ALIAS = "127.77.0.2"
LOOP = ipaddress.IPv4Address("127.0.0.1")


def sleep(seconds: float) -> Any:
    return task.deferLater(reactor, seconds, lambda: None)


def tempdir(test: unittest.TestCase) -> str:
    """A short temp dir (UNIX socket paths are limited to ~100 bytes), removed after the test."""
    path = tempfile.mkdtemp(prefix="bn-")
    test.addCleanup(shutil.rmtree, path, True)
    return path


def fd_links(prefix: str = "socket:") -> set[str]:
    """What this process's fds point to (``socket:[inode]`` by default)."""
    links = set()
    for n in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{n}")
        except FileNotFoundError:
            continue  # the directory listing's own fd
        if link.startswith(prefix):
            links.add(link)
    return links


def buffered(t: Any) -> int:
    """Bytes waiting in a Twisted transport's user-space write buffer."""
    return len(t.dataBuffer) - t.offset + t._tempDataLen


def held_bytes(session: Any) -> int:
    """Bytes a relay holds between its sockets: write buffers, or what sits in its pipes."""
    engine = session.engine
    if isinstance(engine, SpliceRelay):
        return sum(d.inpipe for d in (engine._up, engine._down) if d is not None)
    return max(buffered(t) for t in (session.inbound.transport, engine._out.leg.transport))


def relay_socks(session: Any) -> list[Any]:
    """A live relay's two sockets, whichever engine runs it."""
    engine = session.engine
    if isinstance(engine, SpliceRelay):
        return engine.sockets()
    return [t.getHandle() for t in (session.inbound.transport, engine._out.leg.transport)]


class Base(unittest.TestCase):
    #: The relay engine under test; every real-socket test class runs once per engine.
    engine = "portable"
    #: The daemon's table; the benchmarks' TwistedConnectTable for the Twisted-endpoint rows.
    table_class: type[ForwardTable] = ForwardTable

    def setUp(self) -> None:
        self.state_dir = tempdir(self)
        self.aliases = registry_with(("b1", ALIAS), ("b2", "127.77.0.3"))
        self.table = self.start_table(self.table_class)

    def start_table(self, table_class: type[ForwardTable]) -> ForwardTable:
        """A started table of ``table_class`` on this class's engine, stopped at cleanup."""
        table = table_class(reactor, self.aliases, state_dir=self.state_dir, engine=self.engine)
        table.startService()
        self.addCleanup(table.stopService)
        return table

    def check_engine(self) -> None:
        """Every live relay runs on the engine this class is about."""
        for s in self.sessions():
            assert isinstance(s.engine, SpliceRelay) == (self.engine == "splice"), s.engine
            if self.engine == "splice":
                assert s.engine.spliced

    def target(self, build: Any) -> int:
        port = reactor.listenTCP(0, factory_of(build), interface="127.0.0.1")  # type: ignore[attr-defined]
        self.addCleanup(port.stopListening)
        return int(port.getHost().port)

    async def forward(self, target_port: int, label: str = "web", **kw: Any) -> ForwardInfo:
        spec = ForwardSpec(
            "b1",
            label,
            TCPListen(ipaddress.IPv4Address(ALIAS), 0),
            TCPTarget(LOOP, target_port),
            **kw,
        )
        return await self.table.add(spec)

    async def unix_echo_forward(self) -> UNIXListen:
        """b1's UNIX endpoint ``agent`` relaying to an echo server on a UNIX socket."""
        os.makedirs(targets_dir(self.state_dir, "b1"), mode=0o700)
        target_path = os.path.join(targets_dir(self.state_dir, "b1"), "sidecar.sock")
        tport = reactor.listenUNIX(target_path, factory_of(Echo))  # type: ignore[attr-defined]
        self.addCleanup(tport.stopListening)
        listen = unix_listen_for(self.state_dir, "b1", "agent")
        await self.table.add(ForwardSpec("b1", "agent", listen, UNIXTarget(target_path)))
        return listen

    async def client(self, info: ForwardInfo, proto: Collector) -> Collector:
        assert isinstance(info.bound, TCPListen)
        await connect_tcp(ALIAS, info.bound.port, proto)
        return proto

    async def assert_reset(self, info: ForwardInfo) -> None:
        """A new connection is reset: at connect time or right after, with no data."""
        c = Collector(b"x", fin=False)
        try:
            await self.client(info, c)
        except ConnectError as e:
            assert e.osError == errno.ECONNRESET, e
            return
        await c.done
        assert c.received == b""
        assert c.reason is not None and c.reason.check(ConnectionLost), c.reason

    def sessions(self, label: str = "web") -> list[Any]:
        return list(self.table.sessions("b1", label))

    async def until(self, cond: Any, what: str) -> None:
        for _ in range(500):
            if cond():
                return
            await sleep(0.01)
        self.fail(f"timed out waiting for {what}")


class TransferTests(Base):
    async def test_upload_then_half_close_reply(self) -> None:
        """Client sends 8 MiB and FIN; the target replies after EOF and the reply arrives."""
        data = pattern(8 * MiB)
        info = await self.forward(self.target(lambda: ReplyAfterEOF(b"!" * 100_000)))
        c = await self.client(info, Collector(data, fin=True))
        await c.done
        assert bytes(c.received) == sha(data).encode() + b"!" * 100_000
        assert c.clean
        await self.until(lambda: self.table.get("b1", "web").counters.active == 0, "relay end")
        counters = self.table.get("b1", "web").counters
        assert counters.bytes_in == len(data)
        assert counters.bytes_out == 64 + 100_000
        assert (counters.accepted, counters.failed) == (1, 0)

    async def test_download(self) -> None:
        server = StreamOut(8 * MiB)
        info = await self.forward(self.target(lambda: server))
        c = await self.client(info, Collector(fin=False))
        await c.done
        assert len(c.received) == 8 * MiB
        assert sha(bytes(c.received)) == server.digest.hexdigest()
        assert c.eof

    async def test_full_duplex(self) -> None:
        data = pattern(6 * MiB, seed=7)
        info = await self.forward(self.target(Echo))
        c = await self.client(info, Collector(data, fin=True))
        await c.done
        assert sha(bytes(c.received)) == sha(data)
        assert c.clean

    async def test_target_half_closes_first(self) -> None:
        """The target sends its reply and FIN first, then still receives the client's data."""
        got: Any = __import__("twisted.internet.defer", fromlist=["Deferred"]).Deferred()
        reply = pattern(MiB, seed=3)
        upload = pattern(2 * MiB, seed=4)
        info = await self.forward(self.target(lambda: SendThenFINThenRead(reply, got)))
        c = Collector(fin=False)
        c.after_eof = upload
        await self.client(info, c)
        received_by_target = await got
        await c.done
        assert bytes(c.received) == reply
        assert sha(received_by_target) == sha(upload)
        assert c.clean

    async def test_session_pause_holds_traffic_until_resumed(self) -> None:
        """Outside code (e.g. cutting a bottle off) pauses a live relay and resumes it."""
        info = await self.forward(self.target(Echo))
        c = Collector(b"a", fin=False)
        got: Any = __import__("twisted.internet.defer", fromlist=["Deferred"]).Deferred()
        c.on_data = lambda col: got.called or got.callback(None)
        await self.client(info, c)
        await got
        (s,) = self.sessions()
        self.check_engine()
        s.pauseProducing()
        c.transport.write(b"b")  # type: ignore[union-attr]
        await sleep(0.05)  # passes in which a reading relay would have moved "b"
        assert s.bytes_in == 1 and bytes(c.received) == b"a"
        got = __import__("twisted.internet.defer", fromlist=["Deferred"]).Deferred()
        c.on_data = lambda col: got.called or got.callback(None)
        s.resumeProducing()
        await got
        assert bytes(c.received) == b"ab" and s.bytes_in == 2
        c.transport.loseConnection()  # type: ignore[union-attr]
        await c.done


class FailureTests(Base):
    async def test_target_reset_after_small_request_reaches_client_as_reset(self) -> None:
        """A reset after a small, fully read request is a reset at the client, never a FIN.

        The older reset test leaves unread bytes on the agent-side socket, so the kernel
        resets it on close whatever the relay does; here nothing is left unread, so only the
        relay's own abort (SO_LINGER 0 / abortConnection) makes it a reset.
        """
        info = await self.forward(self.target(lambda: ResetAfter(5)))
        c = await self.client(info, Collector(b"hello", fin=False))
        await c.done
        assert not c.eof, "the client saw a clean EOF"
        assert c.reason is not None and c.reason.check(ConnectionLost), c.reason
        assert not c.reason.check(ConnectionDone), c.reason

    async def test_target_refuses(self) -> None:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
        s.close()  # nothing listens there now
        info = await self.forward(dead_port)
        c = await self.client(info, Collector(b"hello", fin=False))
        await c.done
        assert c.received == b""
        assert c.reason is not None and c.reason.check(ConnectionLost), c.reason
        await self.until(lambda: self.table.get("b1", "web").counters.failed == 1, "failed")

    async def test_target_resets_midstream(self) -> None:
        """The client must see a reset (ECONNRESET), never a clean EOF, on truncation."""
        info = await self.forward(self.target(lambda: ResetAfter(MiB, payload=b"partial")))
        c = await self.client(info, Collector(pattern(4 * MiB), fin=False))
        await c.done
        assert not c.eof
        assert c.reason is not None and c.reason.check(ConnectionLost), c.reason
        await self.until(lambda: self.table.get("b1", "web").counters.failed == 1, "failed")

    async def test_slow_reader_memory_stays_bounded(self) -> None:
        """The target pushes 64 MiB at a throttled reader: the relay's buffers stay small."""
        total = 64 * MiB
        server = StreamOut(total)
        info = await self.forward(self.target(lambda: server))
        c = Collector(fin=False)
        peak = [0]
        since_pause = [0]

        def sample() -> None:
            self.check_engine()
            for s in self.sessions():
                peak[0] = max(peak[0], held_bytes(s))

        def throttle(col: Collector) -> None:
            sample()
            since_pause[0] += 1
            if since_pause[0] >= 8:  # read a little, then stall the reader for a while
                since_pause[0] = 0
                col.transport.pauseProducing()  # type: ignore[union-attr]
                reactor.callLater(0.004, resume)  # type: ignore[attr-defined]

        def resume() -> None:
            sample()
            if c.reason is None:
                c.transport.resumeProducing()  # type: ignore[union-attr]

        c.on_data = throttle
        await self.client(info, c)
        await c.done
        assert len(c.received) == total
        assert sha(bytes(c.received)) == server.digest.hexdigest()
        # User-space buffers stay under ~512 KiB; a splice relay holds at most one full pipe.
        bound = PIPE_MAX if self.engine == "splice" else MiB - 1
        assert 0 < peak[0] <= bound, peak[0]


class LimitTests(Base):
    async def _echo_client(self, info: ForwardInfo) -> Collector:
        c = Collector(b"x", fin=False)
        got: Any = __import__("twisted.internet.defer", fromlist=["Deferred"]).Deferred()
        c.on_data = lambda col: got.called or got.callback(None)
        await self.client(info, c)
        await got
        return c

    async def test_connection_cap_is_exact(self) -> None:
        info = await self.forward(self.target(Echo), max_connections=3)
        live = [await self._echo_client(info) for _ in range(3)]
        await self.assert_reset(info)
        counters = self.table.get("b1", "web").counters
        assert (counters.accepted, counters.active, counters.refused) == (3, 3, 1)
        live[0].transport.loseConnection()  # type: ignore[union-attr]
        await self.until(lambda: self.table.get("b1", "web").counters.active == 2, "slot")
        again = await self._echo_client(info)
        assert self.table.get("b1", "web").counters.accepted == 4
        for c in [*live[1:], again]:
            c.transport.loseConnection()  # type: ignore[union-attr]
            await c.done

    async def test_remove_closes_listener_and_relays(self) -> None:
        target = self.target(Echo)
        before = fd_links()  # sockets only: the reactor may open unrelated pipes lazily
        info = await self.forward(target)
        assert isinstance(info.bound, TCPListen)
        clients = [await self._echo_client(info) for _ in range(2)]
        port = self.table.port("b1", "web")
        relay_sockets = {os.readlink(f"/proc/self/fd/{port.fileno()}")}  # type: ignore[union-attr]
        self.check_engine()
        for s in self.table.sessions("b1", "web"):
            for sk in relay_socks(s):
                relay_sockets.add(os.readlink(f"/proc/self/fd/{sk.fileno()}"))
        assert len(relay_sockets) == 5
        await self.table.remove("b1", "web")
        # Every listener and relay socket is closed by the time remove() fires.
        still_open = fd_links()
        assert not (relay_sockets & still_open)
        for c in clients:
            await c.done
            assert c.reason is not None and c.reason.check(ConnectionLost)  # reset, not EOF
        refused = Collector(fin=False)
        with self.assertRaises(ConnectionRefusedError):
            await connect_tcp(ALIAS, info.bound.port, refused)
        await self.until(lambda: fd_links() <= before, f"fds to close: {fd_links() - before}")
        assert self.table.list() == []


class SocketOptionTests(Base):
    async def test_port_zero_reuseport_and_tcp_options(self) -> None:
        info = await self.forward(self.target(Echo))
        assert isinstance(info.bound, TCPListen) and info.bound.port != 0
        assert info.bound.alias == ipaddress.IPv4Address(ALIAS)
        port = self.table.port("b1", "web")
        lsock = port.socket  # type: ignore[union-attr]
        assert lsock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0
        assert lsock.getsockname() == (ALIAS, info.bound.port)
        c = await LimitTests._echo_client(self, info)  # type: ignore[arg-type]
        (s,) = self.sessions()
        self.check_engine()
        for sk in relay_socks(s):
            assert sk.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            assert sk.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if self.engine == "portable":
            assert s.engine.eager is EAGER_SEND
        c.transport.loseConnection()  # type: ignore[union-attr]
        await c.done


class PeerCheckTests(Base):
    async def test_only_unix_listeners_ask_for_the_peer_uid(self) -> None:
        """SO_PEERCRED is asked on a UNIX endpoint's accept only; a TCP forward never calls it."""
        asked: list[str] = []
        real = _ForwardFactory._admit_peer

        def spy(fwd: _ForwardFactory, sock: socket.socket) -> bool:
            asked.append(fwd.spec.label)
            return real(fwd, sock)

        self.patch(_ForwardFactory, "_admit_peer", spy)
        self.table.admit_peers("b1", frozenset({os.getuid()}))
        info = await self.forward(self.target(Echo), label="tcp")
        c = await self.client(info, Collector(b"over tcp", fin=True))
        await c.done
        assert bytes(c.received) == b"over tcp" and asked == []
        listen = await self.unix_echo_forward()
        u = Collector(b"over unix", fin=True)
        await connect_unix(listen.path, u)
        await u.done
        assert bytes(u.received) == b"over unix" and asked == ["agent"]


class UnixTests(Base):
    async def test_unix_listen_and_unix_target(self) -> None:
        listen = await self.unix_echo_forward()
        assert self.table.get("b1", "agent").bound == listen
        mode = os.stat(listen.path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        bdir = os.path.dirname(listen.path)
        assert stat.S_IMODE(os.stat(bdir).st_mode) == 0o700
        data = pattern(2 * MiB, seed=9)
        c = Collector(data, fin=True)
        await connect_unix(listen.path, c)
        await c.done
        assert sha(bytes(c.received)) == sha(data) and c.clean
        await self.table.remove("b1", "agent")
        assert not os.path.lexists(listen.path)

    async def test_target_is_never_one_of_the_daemons_own_sockets(self) -> None:
        """Issue 13 item 1: not the control socket, not an agent endpoint, not by another path.

        The control socket sits in the state dir (its default without XDG_RUNTIME_DIR):
        outside the bottle's target dir, and refused by name even if placed inside it.
        """
        from bottlenet.errors import InvalidArgument

        tdir = targets_dir(self.state_dir, "b1")
        os.makedirs(tdir, mode=0o700)
        control = os.path.join(self.state_dir, "control.sock")
        cport = reactor.listenUNIX(control, factory_of(Echo))  # type: ignore[attr-defined]
        self.addCleanup(cport.stopListening)
        self.table.own_sockets.add_unix(control)
        listen = unix_listen_for(self.state_dir, "b1", "agent")
        with self.assertRaises(InvalidArgument) as info:
            await self.table.add(ForwardSpec("b1", "agent", listen, UNIXTarget(control)))
        assert "target directory" in info.exception.message
        # Another bottle's target dir is not this bottle's either.
        other = os.path.join(targets_dir(self.state_dir, "b2"), "x.sock")
        with self.assertRaises(InvalidArgument):
            await self.table.add(ForwardSpec("b1", "agent", listen, UNIXTarget(other)))
        inside = os.path.join(tdir, "ctl.sock")
        self.table.own_sockets.add_unix(inside)
        with self.assertRaises(InvalidArgument) as info:
            await self.table.add(ForwardSpec("b1", "agent", listen, UNIXTarget(inside)))
        assert "daemon's own sockets" in info.exception.message
        # A hard link to an agent endpoint (same inode, another name) is caught on disk.
        ep = await self.table.add(
            ForwardSpec("b2", "ep", unix_listen_for(self.state_dir, "b2", "ep"), TCPTarget(LOOP, 9))
        )
        assert isinstance(ep.bound, UNIXListen)
        alias_of_ep = os.path.join(tdir, "ep.sock")
        os.link(ep.bound.path, alias_of_ep)
        with self.assertRaises(InvalidArgument) as info:
            await self.table.add(ForwardSpec("b1", "agent", listen, UNIXTarget(alias_of_ep)))
        assert "daemon's own sockets" in info.exception.message
        assert self.table.list("b1") == []

    async def test_symlinked_target_is_refused_at_add_and_at_connect(self) -> None:
        """Issue 13 item 1: a symlink in the target dir never leads to a socket outside it."""
        from bottlenet.errors import InvalidArgument

        tdir = targets_dir(self.state_dir, "b1")
        os.makedirs(tdir, mode=0o700)
        outside = os.path.join(tempdir(self), "outside.sock")
        accepted: list[object] = []

        class Spy(Echo):
            def connectionMade(self) -> None:
                accepted.append(self)

        oport = reactor.listenUNIX(outside, factory_of(Spy))  # type: ignore[attr-defined]
        self.addCleanup(oport.stopListening)
        link = os.path.join(tdir, "link.sock")
        os.symlink(outside, link)
        listen = unix_listen_for(self.state_dir, "b1", "agent")
        with self.assertRaises(InvalidArgument) as info:
            await self.table.add(ForwardSpec("b1", "agent", listen, UNIXTarget(link)))
        assert "symlink" in info.exception.message
        # Planted after the forward was added: the connect-time re-check refuses it.
        later = os.path.join(tdir, "later.sock")
        info2 = await self.table.add(ForwardSpec("b1", "agent", listen, UNIXTarget(later)))
        assert isinstance(info2.bound, UNIXListen)
        os.symlink(outside, later)
        c = Collector(b"hello", fin=False)
        await connect_unix(info2.bound.path, c)
        await c.done
        assert c.received == b""
        await self.until(lambda: self.table.get("b1", "agent").counters.failed == 1, "failed")
        # A real directory swapped in by symlink is caught by the real-path check too.
        os.unlink(later)
        sub = os.path.join(tdir, "sub")
        os.symlink(os.path.dirname(outside), sub)
        spec3 = ForwardSpec(
            "b1",
            "sub",
            unix_listen_for(self.state_dir, "b1", "sub"),
            UNIXTarget(os.path.join(sub, "outside.sock")),
        )
        with self.assertRaises(InvalidArgument) as info:
            await self.table.add(spec3)
        assert "resolves outside" in info.exception.message
        assert accepted == []

    async def test_a_pinned_target_replaced_in_its_directory_is_never_connected(self) -> None:
        """R2 (security-3): a sidecar's socket pinned at bind (device, inode, owner); another
        socket bound at the same path (what a leftover of a deleted bottle's sidecar uid did)
        is refused at connect, and so is the same inode handed to another owner."""
        tdir = targets_dir(self.state_dir, "b1")
        os.makedirs(tdir, mode=0o700)
        path = os.path.join(tdir, "egress.sock")
        first = reactor.listenUNIX(path, factory_of(Echo))  # type: ignore[attr-defined]
        self.addCleanup(first.stopListening)
        target = UNIXTarget(path, held=HeldSocket.at(path))
        listen = unix_listen_for(self.state_dir, "b1", "agent")
        info = await self.table.add(ForwardSpec("b1", "agent", listen, target))
        assert isinstance(info.bound, UNIXListen)
        c = Collector(b"mine")
        await connect_unix(info.bound.path, c)
        await c.done
        assert c.received == b"mine"
        os.rename(path, path + ".real")  # the first listener keeps its file, aside
        self.addCleanup(os.rename, path + ".real", path)  # for its own stopListening
        impostor = socket.socket(socket.AF_UNIX)
        self.addCleanup(impostor.close)
        impostor.bind(path)
        impostor.listen(8)
        impostor.setblocking(False)
        c = Collector(b"secret", fin=False)
        await connect_unix(info.bound.path, c)
        await c.done
        assert c.received == b""
        await self.until(lambda: self.table.get("b1", "agent").counters.failed == 1, "failed")
        with self.assertRaises(BlockingIOError):
            impostor.accept()  # nothing ever connected to it
        if os.geteuid() == 0:  # the pinned inode itself, handed to another owner
            await self.table.remove("b1", "agent")
            target = UNIXTarget(path, held=HeldSocket.at(path))
            info = await self.table.add(ForwardSpec("b1", "agent", listen, target))
            os.chown(path, 65534, 65534, follow_symlinks=False)
            c = Collector(b"secret", fin=False)
            assert isinstance(info.bound, UNIXListen)
            await connect_unix(info.bound.path, c)
            await c.done
            assert c.received == b""
            with self.assertRaises(BlockingIOError):
                impostor.accept()

    async def test_tcp_listen_and_unix_target(self) -> None:
        """TCP to UNIX: an alias endpoint relaying to a socket in the bottle's target dir."""
        tdir = targets_dir(self.state_dir, "b1")
        os.makedirs(tdir, mode=0o700)
        target_path = os.path.join(tdir, "sidecar.sock")
        tport = reactor.listenUNIX(target_path, factory_of(Echo))  # type: ignore[attr-defined]
        self.addCleanup(tport.stopListening)
        info = await self.table.add(
            ForwardSpec("b1", "web", TCPListen(ipaddress.IPv4Address(ALIAS), 0),
                        UNIXTarget(target_path))
        )  # fmt: skip
        assert isinstance(info.bound, TCPListen)
        data = pattern(2 * MiB, seed=11)
        c = Collector(data, fin=False)  # held open until the engine is checked
        await connect_tcp(ALIAS, info.bound.port, c)
        await self.until(lambda: len(c.received) == len(data), "the echo to come back")
        assert self.sessions()
        self.check_engine()
        c.transport.loseConnection()  # type: ignore[union-attr]
        await c.done
        assert sha(bytes(c.received)) == sha(data)

    async def test_stale_socket_replaced_but_regular_file_kept(self) -> None:
        listen = unix_listen_for(self.state_dir, "b1", "agent")
        os.makedirs(os.path.dirname(listen.path), mode=0o700)
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(listen.path)
        stale.close()  # a socket file with no listener
        target = TCPTarget(LOOP, self.target(Echo))
        await self.table.add(ForwardSpec("b1", "agent", listen, target))
        await self.table.remove("b1", "agent")
        with open(listen.path, "w") as f:
            f.write("not a socket")
        from bottlenet.errors import InvalidArgument

        with self.assertRaises(InvalidArgument):
            await self.table.add(ForwardSpec("b1", "agent", listen, target))
        assert os.path.isfile(listen.path)

    async def test_descriptors_a_peer_sends_are_closed_and_said_once(self) -> None:
        """A peer's SCM_RIGHTS (200 messages) on a UNIX endpoint: every descriptor closed, the
        bytes still relayed, at most one log line (not one per message)."""
        from twisted.logger import globalLogPublisher

        listen = await self.unix_echo_forward()
        marker = os.path.join(tempdir(self), "passed-fd")
        open(marker, "w").close()
        said: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(said.append)
        self.addCleanup(globalLogPublisher.removeObserver, said.append)
        n = 200

        def peer() -> bytes:
            fd = os.open(marker, os.O_RDONLY)
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(30)
                    s.connect(listen.path)
                    for _ in range(n):
                        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
                        s.sendmsg([b"x"], rights)
                    s.shutdown(socket.SHUT_WR)
                    got = b""
                    while chunk := s.recv(65536):
                        got += chunk
                    return got
            finally:
                os.close(fd)

        got = await threads.deferToThread(peer)
        assert got == b"x" * n
        await self.until(lambda: not fd_links(marker), "the passed descriptors to be closed")
        about = [e for e in said if "descriptor" in (formatEvent(e) or "")]
        assert len(about) <= 1, [formatEvent(e) for e in about[:3]]

    async def test_symlinked_bottle_dir_refused(self) -> None:
        from bottlenet.errors import InvalidArgument

        elsewhere = tempdir(self)
        os.makedirs(os.path.join(self.state_dir, "bottles"))
        os.symlink(elsewhere, os.path.join(self.state_dir, "bottles", "b1"))
        listen = unix_listen_for(self.state_dir, "b1", "agent")
        target = TCPTarget(LOOP, self.target(Echo))
        with self.assertRaises(InvalidArgument):
            await self.table.add(ForwardSpec("b1", "agent", listen, target))
        assert os.listdir(elsewhere) == []


# The same real-socket tests against the splice engine, and the portable engine behind
# Twisted's own client endpoints (benchmarks/standalone.py --twisted-connect: not the daemon's
# path, but the benchmarks measure against it, so it must relay correctly).
_NO_SPLICE = None if splice_supported() else "splice() is Linux-only"


class SpliceTransferTests(TransferTests):
    engine = "splice"
    skip = _NO_SPLICE


class SpliceFailureTests(FailureTests):
    engine = "splice"
    skip = _NO_SPLICE


class SpliceLimitTests(LimitTests):
    engine = "splice"
    skip = _NO_SPLICE


class SpliceSocketOptionTests(SocketOptionTests):
    engine = "splice"
    skip = _NO_SPLICE


class SpliceUnixTests(UnixTests):
    engine = "splice"
    skip = _NO_SPLICE


class TwistedConnectTransferTests(TransferTests):
    table_class = TwistedConnectTable


class TwistedConnectFailureTests(FailureTests):
    table_class = TwistedConnectTable


__all__ = ["ConnectionDone"]
