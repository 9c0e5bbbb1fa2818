"""Both clients as a launcher uses them: addresses, per-call timeouts, every page, events."""

from __future__ import annotations

import os
import socket
import tempfile
import threading

import pytest

from bottlenet.control import commands as C
from bottlenet.control.address import TLSCredentials, parse_control_address
from bottlenet.control.blocking import (
    VM_TIMEOUT,
    BlockingControlClient,
    ControlConnectionError,
)
from bottlenet.control.client import EventStream
from bottlenet.control.records import EventRecord
from bottlenet.errors import InvalidArgument
from tests.bottles.harness import DaemonCase


@pytest.mark.parametrize(
    ("text", "kind", "where"),
    [
        ("/run/b/control.sock", "unix", "/run/b/control.sock"),
        ("unix:/run/b/c.sock", "unix", "/run/b/c.sock"),
        ("tls:daemon.example:7443", "tls", "tls:daemon.example:7443"),
        ("tls:127.0.0.2:7443", "tls", "tls:127.0.0.2:7443"),
        ("tls:[::1]:7443", "tls", "tls:[::1]:7443"),
    ],
)
def test_control_addresses(text: str, kind: str, where: str) -> None:
    address = parse_control_address(text)
    assert (address.kind, address.describe()) == (kind, where)


@pytest.mark.parametrize(
    "text", ["", "unix:", "tls:host", "tls:host:0", "tls:host:99999", "tls:::1:80", "tls:a b:80"]
)
def test_bad_control_addresses(text: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_control_address(text)


@pytest.mark.parametrize("text", ["tcp:1.2.3.4:5", "ssl:host:443", "systemd:domain=UNIX"])
def test_an_endpoint_prefix_is_not_taken_for_a_file_name(text: str) -> None:
    """``tcp:...`` and the like are refused naming the forms a client takes, not looked up as a
    socket file of that name."""
    with pytest.raises(InvalidArgument, match=r"is not a control address: use PATH, unix:PATH"):
        parse_control_address(text)


def test_tls_credentials_from_the_environment() -> None:
    assert TLSCredentials.from_env({}) is None
    with pytest.raises(InvalidArgument, match="needs all of"):
        TLSCredentials.from_env({"BOTTLENET_CONTROL_CERT": "/c.pem"})
    creds = TLSCredentials.from_env(
        {"BOTTLENET_CONTROL_CERT": "c", "BOTTLENET_CONTROL_KEY": "k", "BOTTLENET_CONTROL_CA": "a"}
    )
    assert creds == TLSCredentials("c", "k", "a")
    with pytest.raises(InvalidArgument, match="TLS client credentials"):
        creds.context()
    with pytest.raises(InvalidArgument, match="client certificate"):
        BlockingControlClient("tls:127.0.0.1:7443")


def test_per_command_default_timeouts() -> None:
    c = BlockingControlClient("/nonexistent.sock", timeout=4)
    assert c.timeout_for(C.Ping, {}) == 4
    assert c.timeout_for(C.CreateBottle, {"name": "b"}) == 4
    assert c.timeout_for(C.CreateBottle, {"name": "b", "spec": "{}"}) == VM_TIMEOUT
    for slow in (C.DestroyBottle, C.VerifyBottle, C.SetEgressPolicy, C.Exec):
        assert c.timeout_for(slow, {}) == VM_TIMEOUT


def test_a_call_gives_up_after_its_own_timeout() -> None:
    """A daemon that accepts and never answers: the call's timeout, not the client's."""
    d = tempfile.mkdtemp(prefix="bnt-", dir="/tmp")
    path = os.path.join(d, "silent.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    accepted: list[socket.socket] = []
    t = threading.Thread(target=lambda: accepted.append(server.accept()[0]))
    t.start()
    try:
        c = BlockingControlClient(path, timeout=300)
        with pytest.raises(ControlConnectionError, match=r"no answer within 0\.2s"):
            c.ping(timeout=0.2)
    finally:
        t.join(10)
        for s in [server, *accepted]:
            s.close()
        os.unlink(path)
        os.rmdir(d)


class AsyncClientTests(DaemonCase):
    async def test_all_pages_and_events_as_callback_and_async_iterator(self) -> None:
        client = await self.start()
        seen: list[EventRecord] = []
        seq = await client.watch(seen.append)
        stream: EventStream = await client.events("b7")
        for i in range(120):  # more than one page (100)
            await client.create_bottle(f"b{i}")
        bottles = await client.all_bottles()
        self.assertEqual(len(bottles), 120)
        self.assertEqual(sorted(b.name for b in bottles), sorted(f"b{i}" for i in range(120)))
        self.assertEqual(await client.all_forwards(), [])
        await client.destroy_bottle("b7")
        kinds = []
        async for event in stream:  # only b7's events
            kinds.append((event.kind, event.bottle))
            if event.kind == "destroyed":
                break
        self.assertEqual(kinds, [("created", "b7"), ("ready", "b7"), ("destroyed", "b7")])
        self.assertEqual(len(seen), 241)
        self.assertEqual([e.seq for e in seen], list(range(seq + 1, seq + 242)))
        # a call can have its own timeout
        await client.ping(timeout=5)
