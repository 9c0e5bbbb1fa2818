"""Responders and peer checks, on StringTransport with a fake backend."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
from attrs import evolve
from twisted.internet.error import ConnectionDone
from twisted.logger import LogEvent
from twisted.protocols import amp
from twisted.python.failure import Failure

from bottlenet.bottles.model import Bottle, TCPEndpoint
from bottlenet.bottles.spec import BottleSpec
from bottlenet.control import commands as C
from bottlenet.control.codec import RemoteError
from bottlenet.control.context import TLSAdmission
from bottlenet.control.records import (
    BottleRecord,
    EndpointRecord,
    ForwardRecord,
    bottle_record,
    encode_records,
)
from bottlenet.control.server import ControlServerFactory
from bottlenet.errors import (
    ALL_ERRORS,
    AlreadyExists,
    BottlenetError,
    Busy,
    InvalidArgument,
    NotFound,
)
from bottlenet.forward.spec import parse_target
from bottlenet.paths import PrivateDirError
from tests.bottles.harness import socket_bottle
from vmctl.smolvm import VmUids

from .fakes import OWN_UID, Conn, FakeBackend, make_factory


def test_hello_negotiates(conn: Conn) -> None:
    r = conn.call(C.Hello, client_version="test/1", protocols=[1, 7])
    assert r == {
        "server_version": "0.1.0",
        "protocol": 1,
        "features": list(C.FEATURES),
        "smolvm_available": False,
        "guest_kit": None,
        "guest_kit_argv": None,
        "smolvm_version": None,
        "smolvm_source": None,
        "smolvm_tested": None,
        "smolvm_tested_versions": [],
        "vm_uids": None,
        "vm_uids_basis": None,
    }


def test_hello_reports_smolvm() -> None:
    c = Conn(make_factory(smolvm_version="1.3.3"))
    r = c.call(C.Hello, client_version="x", protocols=[1])
    assert r["smolvm_available"] is True
    assert r["smolvm_version"] == "1.3.3"
    c.close()


def test_hello_without_common_protocol(conn: Conn) -> None:
    with pytest.raises(C.UnsupportedProtocol):
        conn.call(C.Hello, client_version="x", protocols=[2, 3])


def test_bottle_lifecycle(conn: Conn) -> None:
    backend = conn.factory.context.backend
    assert isinstance(backend, FakeBackend)
    r = conn.call(C.CreateBottle, name="b1")
    assert r["bottle"] == BottleRecord("b1", "127.77.0.2", "control", "ready", 1700000000.5, 0)
    r = conn.call(C.CreateBottle, name="b2", alias="127.77.0.9")
    assert r["bottle"].alias == "127.77.0.9"
    with pytest.raises(AlreadyExists):
        conn.call(C.CreateBottle, name="b1")
    r = conn.call(C.AddForward, bottle="b1", label="web", target="127.0.0.1:8080")
    assert r["forward"] == ForwardRecord("b1", "web", "127.0.0.1:8080", "127.77.0.2:43000")
    assert (r["host"], r["port"], r["path"]) == ("127.77.0.2", 43000, None)
    assert conn.call(C.BottleStatus, name="b1")["bottle"].forwards == 1
    fw = conn.call(C.ListForwards, bottle="b1")
    assert fw["total"] == 1 and fw["next_offset"] is None
    st = conn.call(C.Stats)["stats"]
    assert [(s.label, s.accepted, s.bytes_in) for s in st] == [("web", 1, 5)]
    conn.call(C.RemoveForward, bottle="b1", label="web")
    with pytest.raises(NotFound):
        conn.call(C.RemoveForward, bottle="b1", label="web")
    conn.call(C.DestroyBottle, name="b1")
    with pytest.raises(NotFound):
        conn.call(C.BottleStatus, name="b1")
    with pytest.raises(NotFound):
        conn.call(C.ListForwards, bottle="b1")
    assert [b.name for b in conn.call(C.ListBottles)["bottles"]] == ["b2"]
    assert conn.call(C.Ping) == {}


def test_pagination(conn: Conn) -> None:
    backend = conn.factory.context.backend
    assert isinstance(backend, FakeBackend)
    for i in range(250):
        conn.call(C.CreateBottle, name=f"b{i:03d}")
    first = conn.call(C.ListBottles)
    assert len(first["bottles"]) == C.MAX_PAGE
    assert first["total"] == 250 and first["next_offset"] == 100
    page = conn.call(C.ListBottles, offset=240, limit=1000)
    assert [b.name for b in page["bottles"]] == [f"b{i}" for i in range(240, 250)]
    assert page["next_offset"] is None
    with pytest.raises(InvalidArgument):
        conn.call(C.ListBottles, offset=-1)
    with pytest.raises(InvalidArgument):
        conn.call(C.ListBottles, limit=0)
    assert conn.call(C.ListBottles, offset=999)["bottles"] == []


BAD_NAMES = ["", "a/b", "..", "a\x00b", "A", "-x", "x" * 300, "é"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_change_nothing(conn: Conn, name: str) -> None:
    for cmd, kw in [
        (C.CreateBottle, {"name": name}),
        (C.DestroyBottle, {"name": name}),
        (C.BottleStatus, {"name": name}),
        (C.AddForward, {"bottle": name, "label": "web", "target": "127.0.0.1:80"}),
        (C.AddForward, {"bottle": "ok", "label": name, "target": "127.0.0.1:80"}),
        (C.RemoveForward, {"bottle": name, "label": "web"}),
        (C.ListForwards, {"bottle": name}),
    ]:
        with pytest.raises(InvalidArgument):
            conn.call(cmd, **kw)
    backend = conn.factory.context.backend
    assert isinstance(backend, FakeBackend)
    assert backend.calls == []


@pytest.mark.parametrize("port", [-1, 65536, 1 << 40])
def test_bad_ports(conn: Conn, port: int) -> None:
    with pytest.raises(InvalidArgument):
        conn.call(C.AddForward, bottle="b", label="web", target="127.0.0.1:80", port=port)
    assert conn.factory.context.backend.calls == []  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "target", ["10.0.0.1:80", "localhost:80", "127.1:80", "127.0.0.1:0", "unix:/tmp/x"]
)
def test_bad_targets(conn: Conn, target: str) -> None:
    with pytest.raises(InvalidArgument):
        conn.call(C.AddForward, bottle="b", label="web", target=target)
    assert conn.factory.context.backend.calls == []  # type: ignore[attr-defined]


def test_bad_alias(conn: Conn) -> None:
    with pytest.raises(InvalidArgument):
        conn.call(C.CreateBottle, name="b", alias="127.1")
    assert conn.factory.context.backend.calls == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("exc_type", ALL_ERRORS)
def test_every_error_code_crosses(exc_type: type[BottlenetError]) -> None:
    backend = FakeBackend()
    backend.fail_with = exc_type("safe message")
    c = Conn(make_factory(backend))
    with pytest.raises(exc_type) as info:
        c.call(C.ListBottles)
    assert info.value.message == "safe message"
    assert type(info.value).code == exc_type.code
    c.close()


def test_a_subclass_of_a_wire_error_crosses_as_its_base() -> None:
    backend = FakeBackend()
    backend.fail_with = PrivateDirError("bottle directory of b is mode 0755")
    c = Conn(make_factory(backend))
    with pytest.raises(InvalidArgument) as info:
        c.call(C.ListBottles)
    assert info.value.message == "bottle directory of b is mode 0755"
    c.close()


def test_internal_error_is_generic_and_logged_without_detail(logs: list[LogEvent]) -> None:
    backend = FakeBackend()
    canary = "CANARY-internal-4c1d"
    backend.fail_with = RuntimeError(canary)
    c = Conn(make_factory(backend))
    with pytest.raises(C.InternalError) as info:
        c.call(C.CreateBottle, name="b")
    assert canary not in str(info.value)
    assert not c.transport.disconnecting  # the connection stays usable
    assert c.call(C.Ping) == {}
    assert any("internal error" in str(e.get("log_format")) for e in logs)
    assert canary not in repr(logs)
    c.close()


def test_mutations_logged_with_uid_and_pid(conn: Conn, logs: list[LogEvent]) -> None:
    conn.call(C.CreateBottle, name="b1")
    conn.call(C.AddForward, bottle="b1", label="web", target="127.0.0.1:80")
    conn.call(C.RemoveForward, bottle="b1", label="web")
    conn.call(C.DestroyBottle, name="b1")
    requested = [e for e in logs if "requested by" in str(e.get("log_format"))]
    assert [e["command"] for e in requested] == [
        "CreateBottle",
        "AddForward",
        "RemoveForward",
        "DestroyBottle",
    ]
    assert all(e["uid"] == OWN_UID and e["pid"] == 4242 for e in requested)


def test_other_uid_dropped_before_parsing(logs: list[LogEvent]) -> None:
    backend = FakeBackend()
    c = Conn(make_factory(backend, uid=0))
    assert c.transport.aborted
    c.send(b"\x00\x08_command\x00\x0fbottlenet.Ping\x00\x04_ask\x00\x011\x00\x00")
    assert c.transport.value() == b""
    refused = [e for e in logs if "refused peer" in str(e.get("log_format"))]
    assert [(e["uid"], e["pid"]) for e in refused] == [(0, 4242)]
    c.close()


def test_allow_uid_admits_another_uid() -> None:
    c = Conn(make_factory(uid=2000, allowed_uids=frozenset({OWN_UID, 2000})))
    assert not c.transport.aborted
    assert c.call(C.Ping) == {}
    c.close()


def test_unreadable_credentials_dropped() -> None:
    def broken(sock: object) -> object:
        raise OSError("nope")

    f = make_factory()
    f.admission = evolve(f.admission, peer_credentials=broken)
    c = Conn(f)
    assert c.transport.aborted
    c.close()


def test_unknown_command_is_unhandled_and_connection_survives(conn: Conn) -> None:
    canary = b"CANARY\nunknown"
    conn.send(b"\x00\x08_command" + len(canary).to_bytes(2, "big") + canary)
    conn.send(b"\x00\x04_ask\x00\x017\x00\x00")
    (box,) = conn.boxes()
    assert box[b"_error_code"] == b"UNHANDLED"
    assert canary not in box[b"_error_description"]
    assert conn.call(C.Ping) == {}


def test_unknown_code_becomes_remote_error() -> None:
    from twisted.protocols import amp

    from bottlenet.control.codec import decode_answer

    box = amp.AmpBox(
        {b"_error": b"1", b"_error_code": b"NEW_CODE", b"_error_description": b"later"}
    )
    with pytest.raises(RemoteError) as info:
        decode_answer(C.Ping, box)
    assert info.value.code == "NEW_CODE"


def test_busy_maps(conn: Conn) -> None:
    conn.factory.context.backend.fail_with = Busy("try later")  # type: ignore[attr-defined]
    with pytest.raises(Busy):
        conn.call(C.DestroyBottle, name="b")


def test_client_version_logged_only_in_a_known_shape() -> None:
    from bottlenet.control.server import describe_client_version

    assert describe_client_version("bottlenet-blocking/0.1.0") == "'bottlenet-blocking/0.1.0'"
    for odd in ("CANARY-0f0e", "x/1.0 CANARY", "launcher/1.2.3.4.5", "a" * 300, "x/1\n"):
        described = describe_client_version(odd)
        assert odd not in described and described.startswith(f"<{len(odd.encode())} bytes sha256:")


def test_every_handled_command_is_reported_once_with_its_result() -> None:
    seen: list[tuple[str, str]] = []
    backend = FakeBackend()
    c = Conn(make_factory(backend, on_command=lambda *pair: seen.append(pair)))
    c.call(C.Hello, client_version="x", protocols=[1])
    c.call(C.CreateBottle, name="b1")
    with pytest.raises(AlreadyExists):
        c.call(C.CreateBottle, name="b1")
    with pytest.raises(InvalidArgument):
        c.call(C.BottleStatus, name="Bad Name")  # refused by the validator, still counted
    backend.fail_with = RuntimeError("boom")
    with pytest.raises(C.InternalError):
        c.call(C.ListBottles)
    c.send(amp.AmpBox({b"_command": b"bottlenet.Nope", b"_ask": b"9"}).serialize())
    assert c.boxes()[0][b"_error_code"] == amp.UNHANDLED_ERROR_CODE  # not a command: not counted
    assert seen == [
        ("Hello", "OK"),
        ("CreateBottle", "OK"),
        ("CreateBottle", "ALREADY_EXISTS"),
        ("BottleStatus", "INVALID_ARGUMENT"),
        ("ListBottles", "INTERNAL"),
    ]
    tls = ControlServerFactory(c.factory.context, TLSAdmission.of(c.factory.context))
    tls_proto = tls.buildProtocol(None)
    assert tls_proto is not None and tls_proto.control.on_command is c.proto.control.on_command
    c.close()


@pytest.mark.parametrize("digits", [21, 4301, 5000])
def test_huge_spec_integer_is_invalid_argument(conn: Conn, digits: int) -> None:
    """Issue 13 item 9: a 5000-digit integer used to escape as INTERNAL (a ValueError)."""
    spec = '{"mode": ' + "9" * digits + "}"
    with pytest.raises(InvalidArgument) as info:
        conn.call(C.CreateBottle, name="b1", spec=spec)
    assert info.value.message == "spec: integers have at most 20 digits"
    assert conn.factory.context.backend.calls == []  # type: ignore[attr-defined]


def test_concurrent_control_connections_are_capped() -> None:
    """Issue 13 item 7: 300 connections used to add 74.5 MiB (256 KiB of box each), unbounded."""
    from twisted.internet.task import Clock
    from twisted.logger import capturedLogs

    factory = make_factory(max_connections=3, clock=Clock())
    held = [Conn(factory) for _ in range(3)]
    with capturedLogs() as events:
        for _ in range(50):
            assert factory.buildProtocol(None) is None  # Twisted closes the socket
    assert factory.refused == 50
    lines = [e for e in events if "refused a connection" in e.get("log_format", "")]
    assert len(lines) == 1  # rate-limited
    held[0].proto.connectionLost(Failure(ConnectionDone()))
    again = Conn(factory)  # a slot came back
    assert again.call(C.Ping) == {}
    # A refused uid never holds a slot, so a flood of them cannot starve the launcher.
    refused = make_factory(uid=12345, max_connections=1, clock=Clock())
    for _ in range(10):
        Conn(refused)
    assert refused.open_connections == 0 and refused.refused == 0


def test_backend_gets_values_parsed_once(conn: Conn) -> None:
    """The responder hands the bottles layer parsed values, never raw text or dicts."""
    backend = conn.factory.context.backend
    assert isinstance(backend, FakeBackend)
    conn.call(C.CreateBottle, name="b1", alias="127.77.0.9", spec='{"mode": "none"}')
    op, (name, alias, spec) = backend.mutations[-1]
    assert (op, name, alias) == ("create_bottle", "b1", ipaddress.IPv4Address("127.77.0.9"))
    assert isinstance(spec, BottleSpec) and spec.name == "b1" and not spec.has_vms
    assert spec.doc == {"mode": "none"}  # the document it was read from, for the state file
    conn.call(C.AddForward, bottle="b1", label="web", target="[::1]:8080", port=0)
    assert backend.mutations[-1] == ("add_forward", ("b1", "web", parse_target("[::1]:8080"), 0))
    with pytest.raises(InvalidArgument, match="sidecar"):
        conn.call(C.CreateBottle, name="b2", spec='{"mode": "socket"}')
    assert [c for c in backend.calls if c[1][0] == "b2"] == []


def test_vm_bottle_record_is_a_view_without_raw_ports(tmp_path: Any) -> None:
    bottle = socket_bottle(
        str(tmp_path),
        mechanism="socket: --mount-socket",
        endpoints=(TCPEndpoint("git", 9418, "/s/git.sock", "/run/bottle/git.sock", 40999),),
        env=(("GIT_GATE_SOCKET", "/run/bottle/git.sock"),),
    )
    record = bottle_record(bottle, 1)
    assert record.endpoints == (EndpointRecord("git", "unix:/run/bottle/git.sock", "/s/git.sock"),)
    assert (record.mode, record.forwards, record.probe) == ("socket", 1, "skipped")
    assert (
        record.isolation
        == "socket: --mount-socket; launch gate: SKIPPED (--unsafe-skip-isolation-probe)"
    )
    assert record.warnings and "NOT verified" in record.warnings[0]
    assert record.env == {"GIT_GATE_SOCKET": "/run/bottle/git.sock"}
    assert bottle_record(bottle, 1, with_env=False).env == {}
    assert b"40999" not in encode_records([record])
    plain = bottle_record(Bottle("p", "127.77.0.2", 1.0), 0)
    assert encode_records([plain]) == (
        b'[{"name":"p","alias":"127.77.0.2","source":"control","state":"ready",'
        b'"created_at":1.0,"forwards":0}]'
    )


def test_hello_reports_the_vm_uid_model() -> None:
    """Issue 19: Hello (and ``bottlenetctl status``) says which privilege model is in force."""
    factory = make_factory(smolvm_version="1.32.2")
    factory.context.smolvm.vm_uids = lambda: (str(VmUids.for_euid(0)), None)
    assert Conn(factory).call(C.Hello, client_version="x", protocols=[1])["vm_uids"] == (
        "per-VM uids"
    )
    assert VmUids.for_euid(1000) == "one uid"
