"""Security-2 T15 (and T9 for exec): exec ``user`` and ``workdir`` say exactly what they are."""

from __future__ import annotations

import pytest

from bottlenet.bottles.attach import parse_exec_request
from bottlenet.errors import InvalidArgument


@pytest.mark.parametrize("user", ["\u0661\u0660\u0660\u0660", "1000:\u0660", "\uff11"])
def test_exec_user_takes_ascii_digits_only(user: str) -> None:
    """T15: a uid in Arabic-Indic digits matched the regex's ``\\d`` and passed."""
    with pytest.raises(InvalidArgument, match="user name or uid"):
        parse_exec_request(["id"], user=user)


@pytest.mark.parametrize(
    ("workdir", "why"),
    [
        ("/a/../..", "'..' segment"),
        ("/srv/..", "'..' segment"),
        ("/a\x7fb", "control or format"),
        ("/a\u202eb", "control or format"),
        ("/a\u2066b", "control or format"),
        ("/a\u200bb", "control or format"),
        ("/a\x85b", "control or format"),
        ("/a\ud800", "control or format"),
    ],
)
def test_exec_workdir_refuses_dotdot_control_and_bidi(workdir: str, why: str) -> None:
    """T15: ``..``, DEL and U+202E were accepted as an exec workdir."""
    with pytest.raises(InvalidArgument, match=why):
        parse_exec_request(["pwd"], workdir=workdir)


def test_exec_fine_values_still_pass() -> None:
    """Names, uid:gid, and ordinary absolute paths (dots inside names included) pass."""
    r = parse_exec_request(["pwd"], user="1000:1000", workdir="/srv/app..v2/./x")
    assert (r.user, r.workdir) == ("1000:1000", "/srv/app..v2/./x")
    assert parse_exec_request(["id"], user="agent").user == "agent"


@pytest.mark.parametrize(("argv", "env"), [(["a\ud800"], []), (["a"], ["A=\udfff"])])
def test_exec_lone_surrogate_is_invalid_argument(argv: list[str], env: list[str]) -> None:
    """T9 for exec: a lone surrogate in argv or env is refused before smolvm runs."""
    with pytest.raises(InvalidArgument, match="no lone surrogates"):
        parse_exec_request(argv, env=env)
