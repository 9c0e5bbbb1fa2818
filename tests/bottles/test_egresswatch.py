"""The sidecar's egress denials as ``egress_denied`` events (bottles.egresswatch), on a clock.

smolvm is a stub answering ``egress_events`` from a script here; the parse of the real output
shape is ``test_smolvm_egress_events_parses_the_fakes_output`` (the fake answers as 1.32.2 and
1.37.3 do: ``tests/vmctl/test_contract.py``'s egress-events case).
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from bottlenet.bottles.egresswatch import INTERVAL, PER_POLL, EgressWatch, new_denials
from bottlenet.bottles.events import EGRESS_DENIED
from bottlenet.bottles.model import BottleState
from tests.fakes import FAKE_SMOLVM, FAST_PATH
from vmctl.smolvm import EgressDenial


def denial(i: int, op: str = "connect") -> EgressDenial:
    return EgressDenial(f"2026-12-07T10:00:{i:02d}Z", op, f"10.0.0.{i}:443")


class StubSmolvm:
    def __init__(self) -> None:
        self.answers: dict[str, tuple[EgressDenial, ...] | None] = {}
        self.asked: list[tuple[str, int]] = []

    def egress_events(self, name: str, limit: int) -> Deferred[Any]:
        self.asked.append((name, limit))
        return succeed(self.answers.get(name, ()))


class VmBottle:
    """The fields of a Bottle the watch reads."""

    def __init__(self, name: str, state: BottleState = BottleState.READY) -> None:
        self.name, self.state = name, state
        self.vms = type("V", (), {"sidecar_vm": f"bn-{name}-sidecar"})()


def rig(bottles: list[Any]) -> tuple[Clock, StubSmolvm, list[tuple[str, str, str | None]]]:
    clock, smolvm, seen = Clock(), StubSmolvm(), []
    watch = EgressWatch(
        clock,
        smolvm,  # type: ignore[arg-type]
        lambda: bottles,
        lambda e: seen.append((e.kind, e.bottle, e.detail)),
    )
    watch.startService()
    return clock, smolvm, seen


def test_new_denials_follow_the_last_seen() -> None:
    """New are those after the last one seen; a window past it is all new."""
    a, b, c = denial(1), denial(2), denial(3)
    assert new_denials((), (a, b)) == (a, b)
    assert new_denials((a, b), (a, b, c)) == (c,)
    assert new_denials((a, b), (b, c)) == (c,)
    assert new_denials((a, b), (a, b)) == ()
    assert new_denials((a,), (c,)) == (c,)


def test_each_denial_is_one_event_naming_the_bottle_once() -> None:
    """Every poll publishes the denials not published before, as egress_denied naming the
    bottle and ``operation dest``; a degraded bottle is not asked."""
    bottles: list[Any] = [VmBottle("b1"), VmBottle("b2", BottleState.DEGRADED)]
    clock, smolvm, seen = rig(bottles)
    smolvm.answers["bn-b1-sidecar"] = (denial(1), denial(2, "sendto"))
    clock.advance(INTERVAL)
    assert seen == [
        (EGRESS_DENIED, "b1", "connect 10.0.0.1:443"),
        (EGRESS_DENIED, "b1", "sendto 10.0.0.2:443"),
    ]
    smolvm.answers["bn-b1-sidecar"] = (denial(1), denial(2, "sendto"), denial(3))
    clock.advance(INTERVAL)
    assert seen[2:] == [(EGRESS_DENIED, "b1", "connect 10.0.0.3:443")]
    clock.advance(INTERVAL)
    assert len(seen) == 3
    assert {n for n, _ in smolvm.asked} == {"bn-b1-sidecar"}
    assert all(limit == PER_POLL for _, limit in smolvm.asked)


def test_a_flood_is_bounded_per_poll() -> None:
    """More denials than a poll asks for: PER_POLL events and one that says there were more."""
    clock, smolvm, seen = rig([VmBottle("b1")])
    smolvm.answers["bn-b1-sidecar"] = tuple(denial(i % 60) for i in range(PER_POLL))
    clock.advance(INTERVAL)
    assert len(seen) == PER_POLL + 1 and "at least" in str(seen[-1][2])


def test_a_cli_without_egress_events_is_asked_once() -> None:
    clock, smolvm, seen = rig([VmBottle("b1")])
    smolvm.answers["bn-b1-sidecar"] = None
    clock.advance(INTERVAL)
    clock.advance(INTERVAL * 3)
    assert len(smolvm.asked) == 1 and seen == []


def test_smolvm_egress_events_parses_the_fakes_output(tmp_path: os.PathLike[str]) -> None:
    """The fake's ``machine egress-events --json`` (the real shape: a JSON array of
    timestamp/operation/dest) through vmctl's parse: malformed records dropped, the operation
    kept to its known words, the newest ``--limit`` kept."""
    data = str(tmp_path)
    events = [
        {"timestamp": "t1", "operation": "connect", "dest": "127.0.0.1:22"},
        {"timestamp": "t2", "operation": "sendto", "dest": "169.254.169.254:80"},
        {"timestamp": "t3", "operation": "rm -rf", "dest": "10.1.1.1:53"},
        {"timestamp": "t4", "operation": "connect", "dest": "$(evil) payload"},
        "junk",
    ]
    with open(os.path.join(data, "fake-faults.json"), "w") as f:
        json.dump({"egress_events": {"s1": events}, "fail": []}, f)
    env = {"PATH": FAST_PATH, "SMOLVM_DATA_DIR": data}
    r = subprocess.run(
        [FAKE_SMOLVM, "machine", "egress-events", "--name", "s1", "--json", "--limit", "4"],
        env=env,
        capture_output=True,
        check=True,
    )
    raw = json.loads(r.stdout)
    assert len(raw) == 4  # the newest four: "t1" dropped by --limit
    parsed = [d for d in map(EgressDenial.from_json, raw) if d is not None]
    assert parsed == [
        EgressDenial("t2", "sendto", "169.254.169.254:80"),
        EgressDenial("t3", "other", "10.1.1.1:53"),
    ]


def test_a_stop_during_a_poll_logs_no_failure() -> None:
    """A poll still waiting on smolvm when the daemon stops is cancelled quietly: no
    "egress watch failed" traceback at every stop that meets one, and no poll after."""
    from twisted.logger import capturedLogs

    clock = Clock()
    pending: Deferred[Any] = Deferred()
    asked: list[str] = []

    class Slow:
        def egress_events(self, name: str, limit: int) -> Deferred[Any]:
            asked.append(name)
            return pending

    watch = EgressWatch(clock, Slow(), lambda: [VmBottle("b1")], lambda e: None)  # type: ignore[arg-type]
    watch.startService()
    clock.advance(INTERVAL)
    assert asked == ["bn-b1-sidecar"]
    with capturedLogs() as events:
        watch.stopService()
    assert [e for e in events if e.get("log_failure")] == []
    assert clock.getDelayedCalls() == []
