"""Security-2 T9: spec strings that do not encode as UTF-8 are INVALID_ARGUMENT."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bottlenet.bottles.spec import parse_bottle_spec
from bottlenet.control import commands as C
from bottlenet.errors import InvalidArgument
from tests.control.fakes import Conn

from .test_spec import doc

LONE = "\ud800"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"sidecar__image": LONE}, "sidecar.image"),
        ({"agent__env": ["TERM=" + LONE]}, "agent.env[0]"),
        ({"sidecar__egress__reload": ["/bin/x", "a\udfff"]}, "sidecar.egress.reload[1]"),
        ({"agent__" + LONE: 1}, "agent.?"),
    ],
)
def test_lone_surrogate_in_a_spec_is_invalid_argument(changes: dict[str, Any], field: str) -> None:
    """T9: ``"\\ud800"`` as sidecar.image used to reach spawnProcess and answer INTERNAL."""
    with pytest.raises(InvalidArgument) as info:
        parse_bottle_spec("b1", doc(**changes))
    assert info.value.message == f"{field}: must be valid Unicode (no lone surrogates)"


def test_lone_surrogate_over_the_control_socket_is_invalid_argument() -> None:
    """T9 end to end: the JSON escape over AMP is refused before the backend sees it."""
    conn = Conn()
    spec = json.dumps(doc(sidecar__image=LONE))  # ensure_ascii: the \\ud800 escape
    with pytest.raises(InvalidArgument, match="no lone surrogates"):
        conn.call(C.CreateBottle, name="b1", spec=spec)
    assert conn.factory.context.backend.calls == []  # type: ignore[attr-defined]
