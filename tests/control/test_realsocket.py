"""Real sockets on the real reactor (trial TestCases): UNIX, systemd fds, TLS client certs."""

from __future__ import annotations

import io
import os
import socket
import stat
import tempfile
from typing import Any

import pytest
from attrs import evolve
from twisted.internet import reactor as _reactor
from twisted.internet import ssl
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol, wrapClientTLS
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import Clock, deferLater
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from twisted.python.systemd import ListenFDs
from twisted.trial import unittest

from bottlenet.bottles.model import Bottle
from bottlenet.cli.main import main as cli_main
from bottlenet.control import calls
from bottlenet.control.blocking import BlockingControlClient, ControlConnectionError
from bottlenet.control.client import ControlClient, connect_control
from bottlenet.control.clienterrors import ClosedBeforeAnswer
from bottlenet.control.context import (
    REFUSED_PEER_LOG_INTERVAL,
    ControlContext,
    SmolvmFacts,
    TLSAdmission,
    UnixAdmission,
)
from bottlenet.control.endpoints import tls_control_endpoint
from bottlenet.control.lightclient import LightControlClient
from bottlenet.control.peercred import default_allowed_uids
from bottlenet.control.protocol import HardenedAMP
from bottlenet.control.server import ControlServerFactory
from bottlenet.errors import NotFound
from bottlenet.forward.ratelimit import RateLimitedLogger
from bottlenet.tap import control_service

from . import certs
from .fakes import FakeBackend

reactor: Any = _reactor

#: Twisted's own TLS helpers (``optionsForClientTLS`` with a client certificate,
#: ``trustRootFromCertificates``) hand pyOpenSSL X509/PKey objects to pyOpenSSL, which now warns;
#: the daemon's listener passes cryptography objects where Twisted lets it.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:Passing pyOpenSSL (X509|PKey) objects is deprecated:DeprecationWarning"
)


def _short_tmp(case: unittest.TestCase) -> str:
    d = tempfile.mkdtemp(prefix="bnr-")
    os.chmod(d, 0o700)

    def rm() -> None:
        for root, dirs, files in os.walk(d, topdown=False):
            for f in files:
                os.unlink(os.path.join(root, f))
            for sub in dirs:
                os.rmdir(os.path.join(root, sub))
        os.rmdir(d)

    case.addCleanup(rm)
    return d


class UNIXControlTests(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = _short_tmp(self)
        self.path = os.path.join(self.dir, "ctl", "control.sock")
        self.backend = FakeBackend()
        self.factory = ControlServerFactory(
            ControlContext(backend=self.backend, server_version="9.9", clock=reactor),
            UnixAdmission(default_allowed_uids()),
        )
        self.fatal: list[str] = []
        self.service = control_service(
            reactor, f"unix:{self.path}", self.factory, self.fatal.append
        )
        self.service.startService()
        self.addCleanup(self.service.stopService)
        self.assertEqual(self.fatal, [])

    def test_modes(self) -> None:
        self.assertEqual(stat.S_IMODE(os.lstat(self.path).st_mode), 0o600)
        self.assertEqual(stat.S_IMODE(os.lstat(os.path.dirname(self.path)).st_mode), 0o700)

    @inlineCallbacks
    def test_blocking_client_round_trip(self) -> Any:
        def script() -> list[Any]:
            with BlockingControlClient(self.path, timeout=5) as c:
                out: list[Any] = [c.hello().server_version]
                c.create_bottle("b1")
                out.append(c.add_forward("b1", "web", "127.0.0.1:8080").describe())
                out.append([f.label for f in c.all_forwards()])
                out.append([s.bytes_in for s in c.all_stats("b1")])
                c.destroy_bottle("b1")
                try:
                    c.bottle_status("b1")
                except NotFound as e:
                    out.append(e.code)
                return out

        out = yield deferToThread(script)
        self.assertEqual(out, ["9.9", "127.77.0.2:43000", ["web"], [5], "NOT_FOUND"])

    @inlineCallbacks
    def test_async_client(self) -> Any:
        client: ControlClient = yield connect_control(reactor, self.path, timeout=5)
        try:
            hello = yield client.hello()
            self.assertEqual(hello.protocol, 1)
            bottle = yield client.create_bottle("b2", alias="127.77.0.5")
            self.assertEqual(bottle.alias, "127.77.0.5")
            page = yield client.list_bottles()
            self.assertEqual([b.name for b in page.items], ["b2"])
            with self.assertRaises(NotFound):
                yield client.destroy_bottle("nope")
        finally:
            client.close()
            yield deferLater(reactor, 0.01, lambda: None)

    @inlineCallbacks
    def test_hostile_clients_do_not_disturb_others(self) -> Any:
        hostile = []
        for payload in (
            b"\xff" * 10,
            b"".join(
                len(b"k%d" % i).to_bytes(2, "big") + b"k%d" % i + b"\xff\xff" + b"v" * 0xFFFF
                for i in range(8)
            ),
            b"\x00\x07_answer\x00\x0299\x00\x00",
        ):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(self.path)
            s.setblocking(False)
            try:
                s.send(payload)
            except BlockingIOError:
                pass
            hostile.append(s)

        def good() -> str:
            with BlockingControlClient(self.path, timeout=5) as c:
                for _ in range(20):
                    c.ping()
                return c.hello().server_version

        version = yield deferToThread(good)
        self.assertEqual(version, "9.9")

        def closed(s: socket.socket) -> bool:
            s.settimeout(5)
            try:
                while s.recv(65536):
                    pass
            except ConnectionResetError:
                pass
            return True

        for s in hostile:
            ok = yield deferToThread(closed, s)
            self.assertTrue(ok)
            s.close()
        self.assertEqual(self.backend.calls, [])

    @inlineCallbacks
    def test_flood_never_read_pauses_reading(self) -> Any:
        """10k pipelined ListBottles (~10 KB answers each) never read: output stays bounded."""
        for i in range(100):
            self.backend.bottles[f"b{i:03d}"] = Bottle(f"b{i:03d}", "127.77.0.9", 1.0)
            self.backend.forwards[f"b{i:03d}"] = ()
        protos: list[Any] = []
        build = self.factory.buildProtocol

        def record(addr: Any) -> Any:
            p = build(addr)
            protos.append(p)
            return p

        self.factory.buildProtocol = record  # type: ignore[method-assign]
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(self.path)
        s.setblocking(False)
        req = b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x15bottlenet.ListBottles\x00\x00"
        data = req * 10_000
        sent = 0
        max_buffer = 0
        for _ in range(100):
            try:
                sent += s.send(data[sent:])
            except BlockingIOError:
                pass
            yield deferLater(reactor, 0.005, lambda: None)
            if protos and protos[0].transport is not None:
                t = protos[0].transport
                max_buffer = max(max_buffer, len(t.dataBuffer) + t._tempDataLen)
            if sent == len(data):
                break
        # Unbounded, this would be ~100 MB of answers queued in the daemon.
        self.assertLess(sent, len(data))
        self.assertLess(max_buffer, 1024 * 1024)
        self.assertIn("write", protos[0].pause_reasons)

        def good() -> None:
            with BlockingControlClient(self.path, timeout=5) as c:
                c.ping()

        yield deferToThread(good)
        s.close()
        yield deferLater(reactor, 0.05, lambda: None)

    @inlineCallbacks
    def test_uid_not_allowed_is_dropped(self) -> Any:
        self.factory.admission = UnixAdmission(frozenset({os.geteuid() + 12345}))

        def script() -> str:
            try:
                with BlockingControlClient(self.path, timeout=5) as c:
                    c.ping()
            except ControlConnectionError as e:
                return str(e)
            return "answered"

        result = yield deferToThread(script)
        self.assertNotEqual(result, "answered")

    @inlineCallbacks
    def test_uid_refusal_says_so(self) -> Any:
        """Issue 30: refused for its uid, each client raises ClosedBeforeAnswer, and
        bottlenetctl's hint names the uid and --allow-uid, not "is the daemon running?"."""
        self.factory.admission = UnixAdmission(frozenset({os.geteuid() + 12345}))
        # three refusals of one uid: the log's suppression timer on a clock of its own
        self.factory.context = evolve(
            self.factory.context,
            refused_log=RateLimitedLogger(Logger(), Clock(), REFUSED_PEER_LOG_INTERVAL),
        )

        def script() -> list[object]:
            out: list[object] = []
            for client in (
                BlockingControlClient(self.path, timeout=5),
                LightControlClient(self.path, timeout=5),
            ):
                try:
                    with client as c:
                        c.call(calls.ping())
                except ControlConnectionError as e:
                    out.append(type(e))
            err = io.StringIO()
            out.append(cli_main(["--control", self.path, "status"], env={}, err=err))
            out.append(err.getvalue())
            return out

        *kinds, code, err = yield deferToThread(script)
        self.assertEqual(kinds, [ClosedBeforeAnswer, ClosedBeforeAnswer])
        uid = os.geteuid()
        self.assertEqual(code, 3)
        self.assertIn("closed the connection before answering", err)
        self.assertIn(f"this is uid {uid} (start it with --allow-uid {uid}", err)
        self.assertNotIn("is the bottlenet daemon running", err)


class SystemdTests(unittest.TestCase):
    @inlineCallbacks
    def test_adopts_inherited_fd_without_chmod(self) -> Any:
        d = _short_tmp(self)
        path = os.path.join(d, "sd.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        os.chmod(path, 0o600)
        s.listen(5)
        fd = os.dup(s.fileno())
        s.close()
        factory = ControlServerFactory(
            ControlContext(
                backend=FakeBackend(),
                server_version="sd",
                clock=reactor,
                smolvm=SmolvmFacts("1.0"),
            ),
            UnixAdmission(default_allowed_uids()),
        )
        fatal: list[str] = []
        svc = control_service(
            reactor,
            "systemd:domain=UNIX:name=control",
            factory,
            fatal.append,
            listen_fds=ListenFDs([fd], ("control",)),
        )
        svc.startService()
        self.assertEqual(fatal, [])
        self.assertRaises(OSError, os.fstat, fd)  # the inherited fd was taken over

        def script() -> tuple[str, bool]:
            with BlockingControlClient(path, timeout=5) as c:
                h = c.hello()
                return h.server_version, h.smolvm_available

        result = yield deferToThread(script)
        self.assertEqual(result, ("sd", True))
        self.assertEqual(stat.S_IMODE(os.lstat(path).st_mode), 0o600)
        yield svc.stopService()
        self.assertTrue(os.path.exists(path))  # systemd's path: never unlinked by us
        os.unlink(path)


class TLSTests(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = _short_tmp(self)
        self.ca = certs.make_ca("bottlenet test CA")
        self.other_ca = certs.make_ca("other CA")
        server = certs.issue(self.ca, "localhost", server=True)
        self.key, self.cert = certs.write(self.dir, "server", server)
        self.ca_path = certs.write(self.dir, "ca", self.ca)[1]
        self.backend = FakeBackend()
        context = ControlContext(
            backend=self.backend,
            server_version="tls",
            clock=reactor,
            # Refusals logged without the flush timer, which outlives the listener (until the
            # reactor stops) while a refused key is still within its interval.
            refused_log=RateLimitedLogger(Logger(), reactor, REFUSED_PEER_LOG_INTERVAL),
        )
        factory = ControlServerFactory(context, TLSAdmission.of(context))
        self.server_protos: list[Any] = []
        build = factory.buildProtocol

        def record(addr: Any) -> Any:
            p = build(addr)
            if p is not None:
                self.server_protos.append(p)
            return p

        factory.buildProtocol = record  # type: ignore[method-assign]
        endpoint = tls_control_endpoint(reactor, 0, "127.0.0.1", self.key, self.cert, self.ca_path)
        self.port: IListeningPort = self.successResultOf(endpoint.listen(factory))
        self.addCleanup(self.port.stopListening)

    def _client(self, issued: certs.Issued | None) -> Deferred[HardenedAMP]:
        client_cert = None
        if issued is not None:
            client_cert = ssl.PrivateCertificate.loadPEM(issued.cert_pem + issued.key_pem)
        options = ssl.optionsForClientTLS(
            "localhost",
            trustRoot=ssl.Certificate.loadPEM(self.ca.cert_pem),
            clientCertificate=client_cert,
        )
        host = self.port.getHost()
        ep = wrapClientTLS(options, TCP4ClientEndpoint(reactor, "127.0.0.1", host.port))
        return connectProtocol(ep, HardenedAMP(pause_reading=False))

    @inlineCallbacks
    def _call(self, issued: certs.Issued | None) -> Any:
        try:
            proto = yield self._client(issued)
        except Exception as e:
            return e
        client = ControlClient(proto, reactor, timeout=5)
        try:
            result = yield client.hello()
        except Exception as e:
            result = e
        client.close()
        for _ in range(300):  # TLS close_notify takes a few round trips
            if proto.transport is None and all(p.transport is None for p in self.server_protos):
                break
            yield deferLater(reactor, 0.01, lambda: None)
        return result

    @inlineCallbacks
    def test_good_client_accepted(self) -> Any:
        good = certs.issue(self.ca, "launcher-1", server=False)
        result = yield self._call(good)
        self.assertEqual(getattr(result, "server_version", result), "tls")

    @inlineCallbacks
    def test_bad_clients_refused(self) -> Any:
        for issued in (
            certs.issue(self.other_ca, "intruder", server=False),
            certs.issue(self.ca, "expired", server=False, expired=True),
            None,
        ):
            result = yield self._call(issued)
            self.assertIsInstance(result, Exception, issued and issued.cert.subject)
        self.assertEqual(self.backend.calls, [])

    @inlineCallbacks
    def test_silent_connections_do_not_lock_out_a_launcher(self) -> Any:
        """Security-2 T2: 70 silent TCP peers (over the 64 slots) used to lock launchers out."""
        port = self.port.getHost().port
        silent = []
        for _ in range(70):  # non-blocking: past the listen backlog, connects wait for accept
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            silent.append(s)
        try:
            for _ in range(1000):  # until the daemon has accepted all of them
                if len(self.server_protos) >= 70:
                    break
                yield deferLater(reactor, 0.01, lambda: None)
            result = yield self._call(certs.issue(self.ca, "launcher-1", server=False))
            self.assertEqual(getattr(result, "server_version", result), "tls")
        finally:
            for s in silent:
                s.close()
        for _ in range(1000):  # every silent connection's close seen (no timer left behind)
            if all(p.transport is None for p in self.server_protos):
                break
            yield deferLater(reactor, 0.01, lambda: None)

    def test_interface_required(self) -> None:
        from bottlenet.control.endpoints import ControlListenError

        with self.assertRaises(ControlListenError):
            tls_control_endpoint(reactor, 0, "", self.key, self.cert, self.ca_path)
