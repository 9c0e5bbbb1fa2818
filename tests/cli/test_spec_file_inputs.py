"""Security-2 T10: a --spec file or a --config file that cannot be used is one clean line."""

from __future__ import annotations

import io
import os

import pytest

from bottlenet.bottles.config import ConfigError, parse_config
from bottlenet.cli.main import main
from bottlenet.forward.aliases import AliasPool

DEEP = b"a = " + b"[" * 5000 + b"]" * 5000 + b"\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (DEEP, "nested too deeply"),
        (b"# caf\xe9\nmode = 'none'\n", "not valid UTF-8"),
        (b"mode = 'none'\nx = '" + b"y" * 70_000 + b"'\n", "control protocol carries at most"),
        (b"x = '" + b"y" * 300_000 + b"'\n", "larger than"),
    ],
)
def test_unusable_spec_file_is_one_usage_line(
    tmp_path: os.PathLike[str], content: bytes, message: str
) -> None:
    """T10: deep nesting, non-UTF-8 and oversize used to give tracebacks or INTERNAL."""
    spec = os.path.join(tmp_path, "spec.toml")
    with open(spec, "wb") as f:
        f.write(content)
    err = io.StringIO()
    env = {"BOTTLENET_CONTROL": os.path.join(tmp_path, "nothing.sock")}  # never contacted
    assert main(["bottle", "create", "x", "--spec", spec], env=env, err=err) == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_deeply_nested_daemon_config_is_one_config_error() -> None:
    """T10: the daemon's --config with 5000 nested arrays used to exit with a traceback."""
    with pytest.raises(ConfigError) as info:
        parse_config(DEEP, "/etc/bottlenet.toml", AliasPool.parse("127.77.0.0/16"), "/state")
    assert str(info.value) == "/etc/bottlenet.toml: (syntax): nested too deeply"
