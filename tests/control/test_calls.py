"""Each control call is declared once (``control/calls.py``) and agrees with the AMP Commands."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from bottlenet.control import calls, codec
from bottlenet.control import commands as C
from bottlenet.control import lightclient as L
from bottlenet.control.calls import Call, ExecRequest, Pace


def test_the_pace_table_is_the_commands_own() -> None:
    """The AMP-free table names every Command, and each Command declares the same pace."""
    declared = {C.short_name(c): c.pace for c in (*C.ALL_COMMANDS, *C.PUSHED_COMMANDS)}
    assert declared == dict(calls.PACE)
    assert {name for name, pace in declared.items() if pace is Pace.VM} == {
        "DestroyBottle",
        "VerifyBottle",
        "SetEgressPolicy",
        "Exec",
        "Logs",
        "Leftovers",
    }


def test_the_slow_rule() -> None:
    """VM commands are slow; CreateBottle only with a spec; the rest never."""
    assert calls.destroy_bottle("b").slow and calls.verify_bottle("b").slow
    assert calls.set_egress_policy("b", []).slow and calls.logs("b").slow
    assert ExecRequest("b", ("true",)).call(local=True).slow
    assert not calls.create_bottle("b").slow and not calls.create_bottle("b", spec="").slow
    assert calls.create_bottle("b", spec="{}").slow
    assert not any(c.slow for c in (calls.ping(), calls.list_bottles(), calls.watch()))
    assert calls.ping().limit(4, 9) == 4 and calls.destroy_bottle("b").limit(4, 9) == 9


BUILT: list[Call[Any]] = [
    calls.hello("x/1"),
    calls.ping(),
    calls.create_bottle("b", "127.77.0.2", "{}"),
    calls.verify_bottle("b"),
    calls.set_egress_policy("b", ["example.com"]),
    calls.destroy_bottle("b"),
    calls.list_bottles(3, 7),
    calls.count_bottles(),
    calls.bottle_status("b"),
    calls.add_forward("b", "web", "127.0.0.1:80", 8080),
    calls.remove_forward("b", "web"),
    calls.list_forwards("b", 1, 2),
    calls.stats("b", 1, 2),
    calls.watch("b"),
    calls.logs("b", 10, True),
    ExecRequest("b", ("sh",), ("K=V",), "u", "/w", True, True, (24, 80), True, 5).call(local=True),
]


@pytest.mark.parametrize("call", BUILT, ids=lambda c: c.command)
def test_each_call_encodes_as_its_command(call: Call[Any]) -> None:
    """Every built call, given a capability, carries exactly its Command's argument keys and
    encodes with AMP's codec."""
    command = C.BY_NAME[call.command]
    keys = {k.decode() for k, _ in command.arguments}
    presented = calls.presenting(call, "c" * 22)
    assert set(presented.arguments) == keys
    assert codec.encode_request(command, b"1", presented.arguments)


def test_the_capability_commands_are_those_that_take_one() -> None:
    """``CAPABILITY_COMMANDS`` names exactly the Commands with a ``capability`` argument; a
    call's own capability is kept, and None adds none."""
    declared = {C.short_name(c) for c in C.ALL_COMMANDS if b"capability" in dict(c.arguments)}
    assert declared == calls.CAPABILITY_COMMANDS
    mine = calls.presenting(calls.destroy_bottle("b"), "c" * 22)
    assert calls.presenting(mine, "d" * 22).arguments["capability"] == "c" * 22
    assert "capability" not in calls.presenting(calls.destroy_bottle("b"), None).arguments
    assert "capability" not in calls.presenting(calls.ping(), "c" * 22).arguments


def test_exec_asks_for_fds_only_where_they_can_travel() -> None:
    """fds only on a UNIX socket without a terminal (both clients build Exec here)."""
    req = ExecRequest("b", ("true",))
    assert req.call(local=True).arguments["fds"] is True
    assert req.call(local=False).arguments["fds"] is None
    assert req._replace(tty=True).call(local=True).arguments["fds"] is None
    assert req._replace(fds=False).call(local=True).arguments["fds"] is None


def test_light_exec_request_bytes_are_the_codecs() -> None:
    """The light client's Exec bytes equal AMP's for the same declared call."""
    call = calls.presenting(BUILT[-1], "c" * 22)
    expected = codec.encode_request(C.Exec, b"a1", call.arguments)
    assert L.request_bytes(call.command, b"a1", call.arguments) == expected


def test_calls_import_no_amp_or_attrs() -> None:
    """The declared calls and their pace table load no Twisted, AMP or attrs."""
    probe = "import sys, bottlenet.control.calls; print(' '.join(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    modules = done.stdout.split()
    assert "bottlenet.control.calls" in modules
    assert [m for m in modules if m.split(".")[0] in ("twisted", "attr", "attrs", "zope")] == []
