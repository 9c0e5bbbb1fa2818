"""Wire contract: golden bytes per command, responder signatures, value-size bounds."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from twisted.protocols import amp

from bottlenet.control import codec
from bottlenet.control import commands as C
from bottlenet.control.framing import BoxParser
from bottlenet.control.records import (
    BottleRecord,
    EndpointRecord,
    EventRecord,
    ForwardRecord,
    PoolRecord,
    StatsRecord,
)
from bottlenet.control.server import ControlLocator, paginate
from bottlenet.errors import ALL_ERRORS

# Checked-in wire bytes. If one of these changes, the protocol changed: old clients or
# daemons may break. Only ever add optional keys (see docs/protocol.md).
VM_RECORD = BottleRecord(
    name="b2",
    alias=None,
    source="control",
    state="ready",
    created_at=1700000000.5,
    forwards=1,
    mode="socket",
    isolation="socket: test",
    sidecar_vm="bn-b2-sidecar",
    agent_vm="bn-b2-agent",
    endpoints=(
        EndpointRecord("egress", "unix:/run/bottle/egress.sock", "/s/bottles/b2/egress.sock"),
    ),
    env={"HTTPS_PROXY": "http://127.0.0.1:3128"},
    policy=("example.org",),
    probe="PASS",
)
VM_RECORD_JSON = (
    b'{"name":"b2","alias":null,"source":"control","state":"ready","created_at":1700000000.5,'
    b'"forwards":1,"mode":"socket","isolation":"socket: test","sidecar_vm":"bn-b2-sidecar",'
    b'"agent_vm":"bn-b2-agent","endpoints":[{"service":"egress",'
    b'"endpoint":"unix:/run/bottle/egress.sock","host_path":"/s/bottles/b2/egress.sock"}],'
    b'"env":{"HTTPS_PROXY":"http://127.0.0.1:3128"},"policy":["example.org"],"probe":"PASS"}'
)

LEASED_RECORD = BottleRecord(
    "b1",
    "127.77.0.2",
    "control",
    "ready",
    1700000000.5,
    0,
    owner="t1",
    lease_seconds=60.0,
    lease_expires_at=1700000060.5,
)

GOLDEN: list[tuple[type[C.ControlCommand], dict[str, Any], bytes, dict[str, Any], bytes]] = [
    (
        C.Hello,
        {"client_version": "bottlenetctl/0.1.0", "protocols": [1]},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x0fbottlenet.Hello\x00\x0eclient_version\x00\x12bottlenetctl/0.1.0\x00\tprotocols\x00\x03\x00\x011\x00\x00",
        {
            "server_version": "0.1.0",
            "protocol": 1,
            "features": ["bottles", "forwards", "stats"],
            "smolvm_available": True,
            "smolvm_version": "1.3.3",
        },
        b"\x00\x07_answer\x00\x011\x00\x08features\x00\x1a\x00\x07bottles\x00\x08forwards\x00\x05stats\x00\x08protocol\x00\x011\x00\x0eserver_version\x00\x050.1.0\x00\x10smolvm_available\x00\x04True\x00\x0esmolvm_version\x00\x051.3.3\x00\x00",
    ),
    (
        C.Ping,
        {},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x0ebottlenet.Ping\x00\x00",
        {},
        b"\x00\x07_answer\x00\x011\x00\x00",
    ),
    (
        C.CreateBottle,
        {"name": "b1", "alias": "127.77.0.2"},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x16bottlenet.CreateBottle\x00\x05alias\x00\n127.77.0.2\x00\x04name\x00\x02b1\x00\x00",
        {
            "bottle": BottleRecord(
                name="b1",
                alias="127.77.0.2",
                source="control",
                state="ready",
                created_at=1700000000.5,
                forwards=1,
            )
        },
        b'\x00\x07_answer\x00\x011\x00\x06bottle\x00l{"name":"b1","alias":"127.77.0.2","source":"control","state":"ready","created_at":1700000000.5,"forwards":1}\x00\x00',
    ),
    (
        C.DestroyBottle,
        {"name": "b1"},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x17bottlenet.DestroyBottle\x00\x04name\x00\x02b1\x00\x00",
        {},
        b"\x00\x07_answer\x00\x011\x00\x00",
    ),
    (
        C.ListBottles,
        {"offset": 0, "limit": 50},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x15bottlenet.ListBottles\x00\x05limit\x00\x0250\x00\x06offset\x00\x010\x00\x00",
        {
            "bottles": [
                BottleRecord(
                    name="b1",
                    alias="127.77.0.2",
                    source="control",
                    state="ready",
                    created_at=1700000000.5,
                    forwards=1,
                )
            ],
            "total": 1,
            "next_offset": None,
        },
        b'\x00\x07_answer\x00\x011\x00\x07bottles\x00n[{"name":"b1","alias":"127.77.0.2","source":"control","state":"ready","created_at":1700000000.5,"forwards":1}]\x00\x05total\x00\x011\x00\x00',
    ),
    (
        C.BottleStatus,
        {"name": "b1"},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x16bottlenet.BottleStatus\x00\x04name\x00\x02b1\x00\x00",
        {
            "bottle": BottleRecord(
                name="b1",
                alias="127.77.0.2",
                source="control",
                state="ready",
                created_at=1700000000.5,
                forwards=1,
            )
        },
        b'\x00\x07_answer\x00\x011\x00\x06bottle\x00l{"name":"b1","alias":"127.77.0.2","source":"control","state":"ready","created_at":1700000000.5,"forwards":1}\x00\x00',
    ),
    (
        C.AddForward,
        {"bottle": "b1", "label": "web", "target": "127.0.0.1:8080", "port": 0},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x14bottlenet.AddForward\x00\x06bottle\x00\x02b1\x00\x05label\x00\x03web\x00\x04port\x00\x010\x00\x06target\x00\x0e127.0.0.1:8080\x00\x00",
        {
            "forward": ForwardRecord(
                bottle="b1", label="web", target="127.0.0.1:8080", endpoint="127.77.0.2:43001"
            ),
            "host": "127.77.0.2",
            "port": 43001,
        },
        b'\x00\x07_answer\x00\x011\x00\x07forward\x00U{"bottle":"b1","label":"web","target":"127.0.0.1:8080","endpoint":"127.77.0.2:43001"}\x00\x04host\x00\n127.77.0.2\x00\x04port\x00\x0543001\x00\x00',
    ),
    (
        C.RemoveForward,
        {"bottle": "b1", "label": "web"},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x17bottlenet.RemoveForward\x00\x06bottle\x00\x02b1\x00\x05label\x00\x03web\x00\x00",
        {},
        b"\x00\x07_answer\x00\x011\x00\x00",
    ),
    (
        C.ListForwards,
        {"bottle": "b1"},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x16bottlenet.ListForwards\x00\x06bottle\x00\x02b1\x00\x00",
        {
            "forwards": [
                ForwardRecord(
                    bottle="b1", label="web", target="127.0.0.1:8080", endpoint="127.77.0.2:43001"
                )
            ],
            "total": 3,
            "next_offset": 1,
        },
        b'\x00\x07_answer\x00\x011\x00\x08forwards\x00W[{"bottle":"b1","label":"web","target":"127.0.0.1:8080","endpoint":"127.77.0.2:43001"}]\x00\x0bnext_offset\x00\x011\x00\x05total\x00\x013\x00\x00',
    ),
    (
        C.Stats,
        {},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x0fbottlenet.Stats\x00\x00",
        {
            "stats": [
                StatsRecord(
                    bottle="b1",
                    label="web",
                    endpoint="127.77.0.2:43001",
                    accepted=3,
                    active=1,
                    refused=0,
                    failed=0,
                    bytes_in=100,
                    bytes_out=200,
                )
            ],
            "total": 1,
        },
        b'\x00\x07_answer\x00\x011\x00\x05stats\x00\x8b[{"bottle":"b1","label":"web","endpoint":"127.77.0.2:43001","accepted":3,"active":1,"refused":0,"failed":0,"bytes_in":100,"bytes_out":200}]\x00\x05total\x00\x011\x00\x00',
    ),
    (
        C.CreateBottle,
        {"name": "b2", "spec": '{"mode":"socket"}'},
        b'\x00\x04_ask\x00\x011\x00\x08_command\x00\x16bottlenet.CreateBottle\x00\x04name\x00\x02b2\x00\x04spec\x00\x11{"mode":"socket"}\x00\x00',
        {"bottle": VM_RECORD},
        b"\x00\x07_answer\x00\x011\x00\x06bottle\x01\x90" + VM_RECORD_JSON + b"\x00\x00",
    ),
    (
        C.VerifyBottle,
        {"name": "b2"},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x16bottlenet.VerifyBottle\x00\x04name\x00\x02b2\x00\x00",
        {"bottle": VM_RECORD, "result": "PASS"},
        b"\x00\x07_answer\x00\x011\x00\x06bottle\x01\x90"
        + VM_RECORD_JSON
        + b"\x00\x06result\x00\x04PASS\x00\x00",
    ),
    (
        C.SetEgressPolicy,
        {"bottle": "b2", "allow_hosts": ["example.org", "*.pypi.org"]},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x19bottlenet.SetEgressPolicy\x00\x0ballow_hosts\x00\x19\x00\x0bexample.org\x00\n*.pypi.org\x00\x06bottle\x00\x02b2\x00\x00",
        {"allow_hosts": ["example.org", "*.pypi.org"]},
        b"\x00\x07_answer\x00\x011\x00\x0ballow_hosts\x00\x19\x00\x0bexample.org\x00\n*.pypi.org\x00\x00",
    ),
    (
        C.Exec,
        {
            "bottle": "b2",
            "argv": ["sh", "-c", "echo hi"],
            "env": ["K=V"],
            "user": "1000",
            "stdin": True,
            "tty": True,
            "rows": 24,
            "cols": 80,
        },
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x0ebottlenet.Exec\x00\x04argv\x00\x11\x00\x02sh\x00\x02-c\x00\x07echo"
        b" hi"
        b"\x00\x06bottle\x00\x02b2\x00\x04cols\x00\x0280\x00\x03env\x00\x05\x00\x03K=V\x00\x04rows\x00\x0224\x00\x05stdin\x00\x04True\x00\x03tty\x00\x04True\x00\x04user\x00\x041000\x00\x00",
        {"tty": True},
        b"\x00\x07_answer\x00\x011\x00\x03tty\x00\x04True\x00\x00",
    ),
    (
        C.Logs,
        {"bottle": "b2", "tail": 50, "follow": True},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x0ebottlenet.Logs\x00\x06bottle\x00\x02b2\x00\x06follow\x00\x04True\x00\x04tail\x00\x0250\x00\x00",
        {},
        b"\x00\x07_answer\x00\x011\x00\x00",
    ),
    (
        C.Watch,
        {"bottle": "b2"},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x0fbottlenet.Watch\x00\x06bottle\x00\x02b2\x00\x00",
        {"seq": 7},
        b"\x00\x07_answer\x00\x011\x00\x03seq\x00\x017\x00\x00",
    ),
    (
        C.NodeInfo,
        {},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x12bottlenet.NodeInfo\x00\x00",
        {
            "server_version": "0.1.0",
            "protocol": 1,
            "host": "n1",
            "labels": ["kvm=true", "zone=a"],
            "privilege": "root;per-VM-uids",
            "smolvm": "1.32.2",
            "vm_possible": True,
            "vm_why_not": None,
            "kvm": "usable",
            "max_bottles": 256,
            "bottles": 2,
            "vm_bottles": 1,
            "connections_used": 3,
            "connections_total": 1000,
            "health": "ok",
            "health_reasons": [],
            "draining": False,
        },
        b"\x00\x07_answer\x00\x011\x00\x07bottles\x00\x012\x00\x11connections_total\x00\x041000\x00\x10connections_used\x00\x013\x00\x08draining\x00\x05False\x00\x06health\x00\x02ok\x00\x0ehealth_reasons\x00\x00\x00\x04host\x00\x02n1\x00\x03kvm\x00\x06usable\x00\x06labels\x00\x12\x00\x08kvm=true\x00\x06zone=a\x00\x0bmax_bottles\x00\x03256\x00\tprivilege\x00\x10root;per-VM-uids\x00\x08protocol\x00\x011\x00\x0eserver_version\x00\x050.1.0\x00\x06smolvm\x00\x061.32.2\x00\nvm_bottles\x00\x011\x00\x0bvm_possible\x00\x04True\x00\x00",
    ),
    (
        C.Drain,
        {"wait": True, "timeout": 30.0},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x0fbottlenet.Drain\x00\x07timeout\x00\x0430.0\x00\x04wait\x00\x04True\x00\x00",
        {"draining": True, "held": 0, "empty": True},
        b"\x00\x07_answer\x00\x011\x00\x08draining\x00\x04True\x00\x05empty\x00\x04True\x00\x04held\x00\x010\x00\x00",
    ),
    (
        C.Undrain,
        {},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x11bottlenet.Undrain\x00\x00",
        {"draining": False},
        b"\x00\x07_answer\x00\x011\x00\x08draining\x00\x05False\x00\x00",
    ),
    (
        C.RenewLease,
        {"name": "b1", "seconds": 60.0},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x14bottlenet.RenewLease\x00\x04name\x00\x02b1\x00\x07seconds\x00\x0460.0\x00\x00",
        {"bottle": LEASED_RECORD},
        b'\x00\x07_answer\x00\x011\x00\x06bottle\x00\xae{"name":"b1","alias":"127.77.0.2","source":"control","state":"ready","created_at":1700000000.5,"forwards":0,"owner":"t1","lease_seconds":60.0,"lease_expires_at":1700000060.5}\x00\x00',
    ),
    (
        C.Leftovers,
        {"name": "b1"},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x13bottlenet.Leftovers\x00\x04name\x00\x02b1\x00\x00",
        {"leftovers": ["bn-b1-agent"]},
        b"\x00\x07_answer\x00\x011\x00\tleftovers\x00\r\x00\x0bbn-b1-agent\x00\x00",
    ),
    (
        C.EnsurePool,
        {"spec": '{"mode":"socket"}', "size": 2},
        b'\x00\x04_ask\x00\x011\x00\x08_command\x00\x14bottlenet.EnsurePool\x00\x04size\x00\x012\x00\x04spec\x00\x11{"mode":"socket"}\x00\x00',
        {"pool": PoolRecord("0123456789ab", 2, 1, 1, 0)},
        b'\x00\x07_answer\x00\x011\x00\x04pool\x00F{"spec_hash":"0123456789ab","size":2,"ready":1,"filling":1,"failed":0}\x00\x00',
    ),
    (
        C.ListPools,
        {},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x13bottlenet.ListPools\x00\x00",
        {"pools": [PoolRecord("0123456789ab", 2, 1, 1, 0)]},
        b'\x00\x07_answer\x00\x011\x00\x05pools\x00H[{"spec_hash":"0123456789ab","size":2,"ready":1,"filling":1,"failed":0}]\x00\x00',
    ),
    (
        C.RemovePool,
        {"spec_hash": "0123456789ab"},
        b"\x00\x04_ask\x00\x011\x00\x08_command\x00\x14bottlenet.RemovePool\x00\tspec_hash\x00\x0c0123456789ab\x00\x00",
        {"destroyed": 1},
        b"\x00\x07_answer\x00\x011\x00\tdestroyed\x00\x011\x00\x00",
    ),
]
# Commands the daemon sends to its clients (pinned the same way).
PUSHED_GOLDEN: list[tuple[type[C.ControlCommand], dict[str, Any], bytes, dict[str, Any], bytes]] = [
    (
        C.Event,
        {
            "event": EventRecord(
                seq=8,
                kind="degraded",
                bottle="b2",
                at=1700000000.5,
                state="degraded",
                detail="sidecar VM process exited",
            )
        },
        b'\x00\x04_ask\x00\x011\x00\x08_command\x00\x0fbottlenet.Event\x00\x05event\x00s{"seq":8,"kind":"degraded","bottle":"b2","at":1700000000.5,"state":"degraded","detail":"sidecar'
        b" VM process exited"
        b'"}\x00\x00',
        {},
        b"\x00\x07_answer\x00\x011\x00\x00",
    ),
]


@pytest.mark.parametrize(
    ("command", "args", "request_bytes", "response", "answer_bytes"), GOLDEN + PUSHED_GOLDEN
)
def test_golden_bytes(
    command: type[C.ControlCommand],
    args: dict[str, Any],
    request_bytes: bytes,
    response: dict[str, Any],
    answer_bytes: bytes,
) -> None:
    assert codec.encode_request(command, b"1", args) == request_bytes
    box = command.makeResponse(response, None)
    box[amp.ANSWER] = b"1"
    assert box.serialize() == answer_bytes
    # And both directions parse back.
    p = BoxParser()
    p.feed(request_bytes + answer_bytes)
    req_box, ans_box = p.next_box(), p.next_box()
    assert req_box is not None and ans_box is not None
    expected_args = {k: args.get(k) for k in (n.decode() for n, _ in command.arguments)}
    assert command.parseArguments(req_box, None) == expected_args
    decoded = codec.decode_answer(command, ans_box)
    assert decoded == {k: response.get(k) for k in (n.decode() for n, _ in command.response)}


def test_golden_covers_every_command() -> None:
    assert {g[0] for g in GOLDEN} == set(C.ALL_COMMANDS)
    assert {g[0] for g in PUSHED_GOLDEN} == set(C.PUSHED_COMMANDS)


def _declared_commands() -> list[type[C.ControlCommand]]:
    return [
        v
        for v in vars(C).values()
        if isinstance(v, type)
        and issubclass(v, amp.Command)
        and v is not C.ControlCommand
        and v.__module__ == C.__name__
    ]


def test_all_commands_listed_and_namespaced() -> None:
    declared = _declared_commands()
    assert set(declared) == set(C.ALL_COMMANDS) | set(C.PUSHED_COMMANDS)
    names = [c.commandName for c in declared]
    assert len(set(names)) == len(names)
    assert all(
        n == b"bottlenet." + c.__name__.encode() for n, c in zip(names, declared, strict=True)
    )


@pytest.mark.parametrize("command", C.ALL_COMMANDS)
def test_responder_signature_matches_arguments(command: type[C.ControlCommand]) -> None:
    dispatch = ControlLocator._commandDispatch  # type: ignore[attr-defined]
    assert command.commandName in dispatch, f"no responder for {command.__name__}"
    cls, func = dispatch[command.commandName]
    assert cls is command
    params = list(inspect.signature(func).parameters)[1:]
    assert params == [amp._wireNameToPythonIdentifier(n) for n, _ in command.arguments]


@pytest.mark.parametrize("command", C.ALL_COMMANDS)
def test_every_error_code_mapped(command: type[C.ControlCommand]) -> None:
    for exc in ALL_ERRORS:
        assert command.errors[exc] == exc.code.encode()
        assert command.reverseErrors[exc.code.encode()] is exc  # type: ignore[attr-defined]


def test_evolution_rule_optional_only() -> None:
    """Pagination and later additions are optional; only the original keys are required."""
    for command in C.ALL_COMMANDS:
        for name, arg in command.arguments:
            if name in (b"offset", b"limit", b"alias", b"port"):
                assert arg.optional


def _max_records() -> dict[str, list[Any]]:
    big_path = "/" + "\x01" * 102  # control characters expand 6x in JSON
    name = "x" * 63
    label = "l" * 32
    n = 2**63 - 1
    return {
        "bottles": [
            BottleRecord(
                name, "255.255.255.255", "control" * 4, "ready" * 8, -1.7976931348623157e308, n
            )
        ]
        * C.MAX_PAGE,
        "forwards": [ForwardRecord(name, label, "unix:" + big_path, "unix:" + big_path)]
        * C.MAX_PAGE,
        "stats": [StatsRecord(name, label, "unix:" + big_path, n, n, n, n, n, n)] * C.MAX_PAGE,
    }


@pytest.mark.parametrize("command", [C.ListBottles, C.ListForwards, C.Stats])
def test_max_page_stays_under_amp_limit(command: type[C.ControlCommand]) -> None:
    key = command.response[0][0].decode()
    records = _max_records()[key] * 3
    response = paginate(records, 0, 10_000, key)
    box = command.makeResponse(response, None)
    assert all(len(v) <= 0xFFFF for v in box.values())
    assert len(box.serialize()) < 64 * 1024
    assert response["next_offset"] == len(response[key]) > 0
    # Paging to the end returns every record exactly once.
    seen, offset = 0, 0
    while offset is not None:
        page = paginate(records, offset, None, key)
        seen += len(page[key])
        offset = page["next_offset"]
    assert seen == len(records)
