"""Real sockets: GET /metrics from a listening Site (TCP on 127.0.0.1:0, and a UNIX socket)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint, UNIXClientEndpoint
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from twisted.trial import unittest

from bottlenet.bottles.model import Bottle
from bottlenet.ops import metrics
from bottlenet.ops.listening import ListeningService
from tests.ops.test_metrics import _fwd


class RawGet(Protocol):
    """HTTP/1.0 by hand: the response ends when the server closes."""

    def __init__(self, path: bytes) -> None:
        self.path = path
        self.data = b""
        self.done: Deferred[bytes] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(b"GET " + self.path + b" HTTP/1.0\r\nHost: x\r\n\r\n")

    def dataReceived(self, data: bytes) -> None:
        self.data += data

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.done.callback(self.data)


@inlineCallbacks
def get(endpoint: IStreamClientEndpoint, path: bytes):  # type: ignore[no-untyped-def]
    proto = yield endpoint.connect(Factory.forProtocol(lambda: RawGet(path)))
    raw = yield proto.done
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
    return status, {k.lower(): v for k, v in headers.items()}, body


class MetricsOverSockets(unittest.TestCase):
    @inlineCallbacks
    def _start(self, text: str):  # type: ignore[no-untyped-def]
        spec = metrics.parse_metrics_endpoint(text)
        source = metrics.SnapshotSource(
            lambda: [_fwd("demo", "git", accepted=3, active=1)], lambda: [Bottle("demo", None, 1.0)]
        )
        commands = metrics.CommandStats()
        commands.record("Hello", "OK")
        site = metrics.metrics_site(source, reactor, control=commands)
        errors: list[str] = []
        svc = ListeningService(
            "metrics", spec.describe(), spec.endpoint(reactor), site, errors.append
        )
        svc.startService()
        self.addCleanup(svc.stopService)
        port = yield svc.when_listening()
        return port, errors

    @inlineCallbacks
    def test_get_metrics_over_tcp(self):  # type: ignore[no-untyped-def]
        port, errors = yield self._start("tcp:0:interface=127.0.0.1")
        host = port.getHost()
        self.assertEqual(host.host, "127.0.0.1")
        client = TCP4ClientEndpoint(reactor, "127.0.0.1", host.port)
        status, headers, body = yield get(client, b"/metrics")
        self.assertEqual(status, 200)
        self.assertEqual(headers[b"content-type"], metrics.CONTENT_TYPE)
        names = {f.name for f in text_string_to_metric_families(body.decode())}
        self.assertIn("bottlenet_relays_accepted", names)
        self.assertIn("bottlenet_control_commands", names)
        self.assertIn(b'bottlenet_relays_accepted_total{bottle="demo",forward="git"} 3', body)
        status, _, _ = yield get(client, b"/")
        self.assertEqual(status, 404)
        self.assertEqual(errors, [])

    @inlineCallbacks
    def test_get_metrics_over_unix_socket_mode_0600(self):  # type: ignore[no-untyped-def]
        tmp = tempfile.mkdtemp(prefix="bn-m-")  # short: sun_path is ~104 bytes
        self.addCleanup(shutil.rmtree, tmp, True)
        path = os.path.join(tmp, "m.sock")
        yield self._start(f"unix:{path}")
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        status, _, body = yield get(UNIXClientEndpoint(reactor, path), b"/metrics")
        self.assertEqual(status, 200)
        self.assertIn(b'bottlenet_bottles{state="ready"} 1', body)

    @inlineCallbacks
    def test_listen_failure_is_reported(self):  # type: ignore[no-untyped-def]
        taken = socket.socket()
        self.addCleanup(taken.close)
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        spec = metrics.parse_metrics_endpoint(f"tcp:{taken.getsockname()[1]}:interface=127.0.0.1")
        source = metrics.SnapshotSource(list)
        errors: list[str] = []
        site = metrics.metrics_site(source, reactor)
        svc = ListeningService(
            "metrics", spec.describe(), spec.endpoint(reactor), site, errors.append
        )
        svc.startService()
        self.addCleanup(svc.stopService)
        yield self.assertFailure(svc.when_listening(), Exception)
        self.assertEqual(len(errors), 1)
        self.assertIn("cannot listen", errors[0])
        self.assertIn(spec.describe(), errors[0])


class MetricsConnectionCap(unittest.TestCase):
    @inlineCallbacks
    def test_connections_past_the_cap_are_closed_and_counted(self):  # type: ignore[no-untyped-def]
        """Issue 13 item 6: another uid held 330 metrics connections and exhausted the fds."""
        capped: list[metrics.CappedFactory] = []
        site = metrics.metrics_site(
            metrics.SnapshotSource(list),
            reactor,
            refusals=lambda: [("metrics", "cap", c.refused) for c in capped],
        )
        capped.append(metrics.CappedFactory(site, 2, reactor))
        spec = metrics.parse_metrics_endpoint("tcp:0:interface=127.0.0.1")
        svc = ListeningService("metrics", spec.describe(), spec.endpoint(reactor), capped[0], list)
        svc.startService()
        self.addCleanup(svc.stopService)
        port = yield svc.when_listening()
        held = [socket.create_connection(("127.0.0.1", port.getHost().port)) for _ in range(2)]
        for s in held:
            self.addCleanup(s.close)
        yield _until(lambda: len(capped[0].protocols) == 2)
        extra = socket.create_connection(("127.0.0.1", port.getHost().port))
        self.addCleanup(extra.close)
        extra.settimeout(10)
        yield _until(lambda: capped[0].refused == 1)
        self.assertEqual(extra.recv(1), b"")  # closed at accept
        for s in held:
            s.close()
        yield _until(lambda: len(capped[0].protocols) == 0)
        client = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
        status, _, body = yield get(client, b"/metrics")
        self.assertEqual(status, 200)
        self.assertIn(
            b'bottlenet_connections_refused_total{listener="metrics",reason="cap"} 1', body
        )


@inlineCallbacks
def _until(cond):  # type: ignore[no-untyped-def]
    from twisted.internet.task import deferLater

    for _ in range(500):
        if cond():
            return
        yield deferLater(reactor, 0.01, lambda: None)
    raise AssertionError("condition never held")
