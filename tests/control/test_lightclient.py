"""The light client (no Twisted) speaks exactly the AMP boxes of the Command definitions."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
from twisted.protocols import amp

from bottlenet.cli.main import _plain
from bottlenet.control import codec
from bottlenet.control import commands as C
from bottlenet.control import lightclient as L
from bottlenet.control.clienterrors import RemoteError
from bottlenet.control.framing import BoxParser, encode_box
from bottlenet.control.records import (
    BottleRecord,
    EndpointRecord,
    PoolRecord,
    decode_records,
    encode_records,
)
from bottlenet.control.results import BottleRow, EndpointRow
from bottlenet.errors import NotFound


def _kind(arg: amp.Argument) -> L.Kind:
    if isinstance(arg, C.RecordList) and arg.record is BottleRecord:
        return L.Kind.BOTTLE_RECORDS
    if isinstance(arg, C.RecordList) and arg.record is PoolRecord:
        return L.Kind.POOL_RECORDS
    if isinstance(arg, C.StrictListOf):
        inner = _kind(arg.elementType)
        return {L.Kind.UNICODE: L.Kind.UNICODE_LIST, L.Kind.INTEGER: L.Kind.INTEGER_LIST}[inner]
    if isinstance(arg, C.StrictBoolean):
        return L.Kind.BOOLEAN
    if isinstance(arg, C.StrictInteger):
        return L.Kind.INTEGER
    if type(arg) is amp.Unicode:
        return L.Kind.UNICODE
    raise AssertionError(f"no light kind for {arg!r}")


def _schema(pairs: list[tuple[bytes, amp.Argument]]) -> L.Schema:
    return {k.decode(): (_kind(a), bool(a.optional)) for k, a in pairs}


@pytest.mark.parametrize("name", sorted(L.COMMANDS))
def test_light_table_matches_the_command_definitions(name: str) -> None:
    """Each light command's argument and answer kinds are the Command's own."""
    command = getattr(C, name)
    assert command.commandName == b"bottlenet." + name.encode()
    assert L.COMMANDS[name] == (_schema(command.arguments), _schema(command.response))


def test_the_light_client_does_not_grow() -> None:
    """Its commands and methods are pinned (review 3, section 8): each command is a mirror
    kept by hand, so a new one fails here; other calls go through the blocking client, and
    callers run ``call(calls.x(...))`` rather than a named method per command."""
    assert set(L.COMMANDS) == {"Hello", "Ping", "ListBottles", "NodeInfo", "Exec"}
    public = {name for name in vars(L.LightControlClient) if not name.startswith("_")}
    assert public == {"connect", "close", "call", "hello", "start_exec"}


REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("Hello", {"client_version": "x/1 ü", "protocols": [1, 2]}),
    ("Ping", {}),
    ("ListBottles", {"offset": 0, "limit": None}),
    ("ListBottles", {"offset": 7, "limit": 100}),
]


@pytest.mark.parametrize(("name", "arguments"), REQUESTS)
def test_light_request_bytes_are_the_codecs(name: str, arguments: dict[str, Any]) -> None:
    """The request bytes equal those AMP's Command.makeArguments + serialize write."""
    expected = codec.encode_request(getattr(C, name), b"a1", arguments)
    assert L.request_bytes(name, b"a1", arguments) == expected


def _answer(command: type[amp.Command], values: dict[str, Any]) -> dict[bytes, bytes]:
    box = command.makeResponse(values, None)
    box[amp.ANSWER] = b"1"
    parser = BoxParser(box_type=dict)
    parser.feed(box.serialize())
    parsed = parser.next_box()
    assert parsed is not None
    return dict(parsed)


def test_light_answers_decode_as_the_codec_does() -> None:
    """Hello and ListBottles answers (optional keys absent or present) decode the same."""
    b1 = BottleRecord(
        name="b1",
        alias="127.77.0.1",
        source="api",
        state="ready",
        forwards=2,
        created_at=1.5,
    )
    cases: list[tuple[str, dict[str, Any]]] = [
        (
            "Hello",
            {
                "server_version": "0.1.0",
                "protocol": 1,
                "features": ["bottles", "exec"],
                "smolvm_available": False,
                "smolvm_version": None,
                "smolvm_source": None,
            },
        ),
        (
            "Hello",
            {
                "server_version": "0.1.0",
                "protocol": 1,
                "features": [],
                "smolvm_available": True,
                "smolvm_version": "1.32.2",
                "smolvm_source": "PATH",
            },
        ),
        ("ListBottles", {"bottles": [b1], "total": 3, "next_offset": 1}),
        ("ListBottles", {"bottles": [], "total": 0, "next_offset": None}),
        ("Ping", {}),
    ]
    for name, values in cases:
        command = getattr(C, name)
        box = _answer(command, values)
        light = _as_json(L.decode_answer(name, box))
        assert light == _as_json(codec.decode_answer(command, amp.AmpBox(box)))


def _as_json(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer with its bottles (client rows or attrs records) as bottlenetctl's --json
    writes them (objects and lists)."""

    def plain(b: Any) -> Any:
        return json.loads(json.dumps(_plain(b) if isinstance(b, tuple) else attrs.asdict(b)))

    return {k: [plain(b) for b in v] if k == "bottles" else v for k, v in answer.items()}


def test_bottle_rows_are_the_records_fields() -> None:
    """The light client's BottleRow/EndpointRow have the records' fields, order and defaults."""
    for row, record in ((BottleRow, BottleRecord), (EndpointRow, EndpointRecord)):
        fields = attrs.fields(record)
        assert row._fields == tuple(f.name for f in fields)
        defaults = {
            f.name: f.default.factory() if isinstance(f.default, attrs.Factory) else f.default  # type: ignore[arg-type]
            for f in fields
            if f.default is not attrs.NOTHING
        }
        assert row._field_defaults == defaults


def test_a_vm_bottle_reads_the_same_as_row_and_record() -> None:
    """Every field of a full VM bottle (endpoints, env, policy, warnings) reads the same."""
    record = BottleRecord(
        name="b1",
        alias=None,
        source="config",
        state="degraded",
        created_at=2.0,
        forwards=1,
        mode="socket",
        isolation="verified",
        sidecar_vm="bn-b1-sidecar",
        agent_vm="bn-b1-agent",
        endpoints=(EndpointRecord("egress", "unix:/run/bottle/egress.sock", "/h/e.sock"),),
        env={"HTTPS_PROXY": "http://127.0.0.1:3128"},
        policy=("example.com",),
        probe="PASS",
        warnings=("w1",),
        detail="sidecar gone",
        workload="exited",
        workload_exit_code=3,
        bridge="running (3128)",
    )
    data = encode_records([record])
    assert _as_json({"bottles": decode_records(data, BottleRecord)}) == _as_json(
        {"bottles": L.decode_value(L.Kind.BOTTLE_RECORDS, data)}
    )


def test_light_error_boxes_are_typed() -> None:
    """An error box becomes the typed error; an unknown code keeps its code."""
    box = {b"_error": b"1", b"_error_code": b"NOT_FOUND", b"_error_description": b"no b1"}
    with pytest.raises(NotFound, match="no b1"):
        L.decode_answer("Ping", box)
    box[b"_error_code"] = b"INTERNAL"
    with pytest.raises(RemoteError) as info:
        L.decode_answer("Ping", box)
    assert info.value.code == "INTERNAL"


def test_light_malformed_answers_are_framing_errors() -> None:
    """A missing required key or a non-canonical integer is refused, not guessed."""
    with pytest.raises(L.FramingError):
        L.decode_answer("ListBottles", {b"_answer": b"1", b"bottles": b"[]"})
    bad = {b"_answer": b"1", b"bottles": b"[]", b"total": b"+1"}
    with pytest.raises(L.FramingError):
        L.decode_answer("ListBottles", bad)


def test_encode_box_is_amp_serialize() -> None:
    """The shared box encoder writes AmpBox.serialize's bytes."""
    box = {b"b": b"2", b"a": b"", b"_ask": b"ff"}
    assert encode_box(box) == amp.AmpBox(box).serialize()
