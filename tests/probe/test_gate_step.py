"""The daemon's gate step (bottlenet/bottles/probe.py) against guests that lie.

The "guest" here is a stand-in for ``smolvm machine exec``: it reads the script the gate sends
and answers with whatever a hostile ``/bin/sh`` could print. The gate must refuse it because
the host-side witness never saw the nonce, whatever the transcript says.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.internet import defer
from twisted.internet.task import Clock

from bottlenet.bottles.model import TCPEndpoint
from bottlenet.bottles.probe import MARKER_PREFIX, Gate, GateSettings
from bottlenet.probe.witness import WitnessFactory
from tests.probe.guests import pass_transcript
from vmctl.smolvm import GUEST_ROOT, ExecResult

ENDPOINT = TCPEndpoint("egress", 3128, "/s/egress.sock", "/run/bottle/egress.sock", 40001)


class Table:
    """Records ``divert`` calls like ForwardTable (the one method the gate uses)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    def divert(self, bottle: str, label: str, factory: Any) -> None:
        self.calls.append((bottle, label, factory))


class LyingGuest:
    """``exec`` that forges a perfect transcript from the nonce in the script it was sent."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.saw_markers: list[str] = []

    def exec(
        self,
        name: str,
        argv: list[str],
        stdin: bytes,
        timeout: float,
        user: str | None = None,
        session: Any = (),
    ) -> Any:
        """The strongest liar: it reads the whole plan out of the script it was sent and
        answers every check as an isolated guest would, but never connects to anything."""
        assert user == GUEST_ROOT  # the gate runs as the guest's root, whatever the image
        self.saw_markers = [n for n in os.listdir(self.state_dir) if n.startswith(MARKER_PREFIX)]
        code, out = pass_transcript(stdin)
        return defer.succeed(ExecResult(code, out, b"", 0.1))


def test_a_forged_transcript_fails_and_the_endpoint_is_restored(tmp_path: Any) -> None:
    state = str(tmp_path)
    guest, table = LyingGuest(state), Table()
    gate = Gate(
        Clock(),
        guest,
        table,
        state_dir=state,  # type: ignore[arg-type]
        settings=GateSettings(outside="198.18.0.1:9", dns_name="gate.invalid", home=state),
    )
    d = defer.Deferred.fromCoroutine(
        gate.run("b1", "bn-b1-agent", "socket", [ENDPOINT], other_bottle=None)
    )
    _plan, verdict = d.result  # type: ignore[attr-defined]
    # everything but the witness is perfect: that alone refuses it
    assert verdict.problems == (
        "own endpoint unix:/run/bottle/egress.sock was not witnessed on the host "
        "(no connection carrying this run's nonce)",
        # the cause the host can see (issue 27 item 3): its listener saw nothing at all
        "own endpoint unix:/run/bottle/egress.sock (egress): bottlenet's listener at "
        "/s/egress.sock never saw the connection (a grant or uid problem)",
    )
    # the endpoint was diverted to a witness for the window, then handed back to the relay
    assert [(b, lbl) for b, lbl, _ in table.calls] == [("b1", "egress"), ("b1", "egress")]
    assert isinstance(table.calls[0][2], WitnessFactory) and table.calls[1][2] is None
    # the marker existed while the guest ran and is gone afterwards
    assert len(guest.saw_markers) == 1
    assert not [n for n in os.listdir(state) if n.startswith(MARKER_PREFIX)]
