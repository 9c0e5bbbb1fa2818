"""The config file: every problem is one line naming the file, the key and the reason."""

from __future__ import annotations

import os

import pytest

from bottlenet.bottles.config import ConfigError, load_config, parse_config
from bottlenet.forward.spec import AliasPool

POOL = AliasPool.parse("127.77.0.0/16")
PATH = "/etc/bn.toml"

GOOD = b"""
[[bottle]]
name = "demo"
alias = "127.77.0.2"
[[bottle.forward]]
label = "web"
port = 0
target = "127.0.0.1:8080"
[[bottle.forward]]
label = "git"
port = 9000
target = "[::1]:9418"
max_connections = 5

[[bottle]]
name = "other"
alias = "127.77.0.3"
"""


def parse(text: bytes):  # type: ignore[no-untyped-def]
    return parse_config(text, PATH, POOL, "/state")


def test_good_config() -> None:
    config = parse(GOOD)
    assert [b.name for b in config.bottles] == ["demo", "other"]
    demo = config.bottles[0]
    assert str(demo.alias) == "127.77.0.2"
    assert [(f.label, f.port, f.target.describe(), f.max_connections) for f in demo.forwards] == [
        ("web", 0, "127.0.0.1:8080", 1024),
        ("git", 9000, "[::1]:9418", 5),
    ]
    assert config.bottles[1].forwards == ()


def test_shipped_example_is_valid() -> None:
    here = os.path.dirname(__file__)
    config = load_config(os.path.join(here, "..", "..", "examples", "demo.toml"), POOL, "/state")
    assert config.bottles[0].forwards[0].target.describe() == "127.0.0.1:8080"


BAD = [
    (b"[[bottle]]\nname = 'x'\n", "bottle[0].alias: missing"),
    (b"[[bottle]]\nalias = '127.77.0.2'\n", "bottle[0].name: missing"),
    (b"[[bottle]]\nname = 'Bad'\nalias = '127.77.0.2'\n", "bottle[0].name: bottle name"),
    (b"[[bottle]]\nname = 'x'\nalias = '0.0.0.0'\n", "bottle[0].alias: alias 0.0.0.0 is not in"),
    (b"[[bottle]]\nname = 'x'\nalias = '127.0.0.1'\n", "bottle[0].alias: alias 127.0.0.1"),
    (b"[[bottle]]\nname = 'x'\nalias = '127.1'\n", "bottle[0].alias: alias '127.1' is not"),
    (b"[[bottle]]\nname = 'x'\nalias = 'localhost'\n", "bottle[0].alias"),
    (b"[[bottle]]\nname = 'x'\nalias = 2130706434\n", "bottle[0].alias"),
    (
        b"[[bottle]]\nname='a'\nalias='127.77.0.2'\n[[bottle]]\nname='b'\nalias='127.77.0.2'\n",
        "bottle[1].alias: alias 127.77.0.2 belongs to another bottle",
    ),
    (
        b"[[bottle]]\nname='a'\nalias='127.77.0.2'\n[[bottle]]\nname='a'\nalias='127.77.0.3'\n",
        "bottle[1].name: bottle a is declared twice",
    ),
    (b"[[bottle]]\nname='a'\nalias='127.77.0.2'\ncolour='red'\n", "bottle[0].colour: unknown key"),
    (b"verbose = true\n", "verbose: unknown key"),
    (b"bottle = 3\n", "bottle: must be an array of tables"),
    (b"[bottle]\nname='a'\n", "bottle: must be an array of tables"),
    (
        b"[[bottle]]\nname='a'\nalias='127.77.0.2'\n[[bottle.forward]]\nport=1\ntarget='127.0.0.1:1'\n",
        "bottle[0].forward[0].label: missing",
    ),
    (
        b"[[bottle]]\nname='a'\nalias='127.77.0.2'\n[[bottle.forward]]\nlabel='w'\nport=70000\n"
        b"target='127.0.0.1:1'\n",
        "bottle[0].forward[0].port: port 70000 is out of range",
    ),
    (
        b"[[bottle]]\nname='a'\nalias='127.77.0.2'\n[[bottle.forward]]\nlabel='w'\nport='80'\n"
        b"target='127.0.0.1:1'\n",
        "bottle[0].forward[0].port",
    ),
    (
        b"[[bottle]]\nname='a'\nalias='127.77.0.2'\n[[bottle.forward]]\nlabel='w'\n"
        b"target='localhost:80'\n",
        "bottle[0].forward[0].target: target host 'localhost'",
    ),
    (
        b"[[bottle]]\nname='a'\nalias='127.77.0.2'\n[[bottle.forward]]\nlabel='w'\n"
        b"target='10.1.2.3:80'\n",
        "bottle[0].forward[0].target: target host 10.1.2.3 is not a loopback address",
    ),
    (
        b"[[bottle]]\nname='a'\nalias='127.77.0.2'\n[[bottle.forward]]\nlabel='w'\n"
        b"target='127.0.0.1:80'\n[[bottle.forward]]\nlabel='w'\ntarget='127.0.0.1:81'\n",
        "bottle[0].forward[1].label: label w is used twice",
    ),
    (
        b"[[bottle]]\nname='a'\nalias='127.77.0.2'\n[[bottle.forward]]\nlabel='w'\nport=5\n"
        b"target='127.0.0.1:80'\n[[bottle.forward]]\nlabel='v'\nport=5\ntarget='127.0.0.1:81'\n",
        "bottle[0].forward[1].port: port 5 is used twice",
    ),
    (
        b"[[bottle]]\nname='a'\nalias='127.77.0.2'\n[[bottle.forward]]\nlabel='w'\n"
        b"target='127.0.0.1:80'\nmax_connections=0\n",
        "bottle[0].forward[0].max_connections: must be an integer",
    ),
    (b"[[bottle]\n", "(syntax)"),
    (b"\xff\xfe", "(file): not valid UTF-8"),
]


@pytest.mark.parametrize(("text", "expected"), BAD)
def test_bad_config_is_one_line_naming_file_and_key(text: bytes, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(text)
    message = str(info.value)
    assert message.startswith(f"{PATH}: ")
    assert expected in message
    assert "\n" not in message


def test_hostile_key_is_not_echoed() -> None:
    with pytest.raises(ConfigError) as info:
        parse(b'"\\u001b[31mevil" = 1\n')
    assert "\x1b" not in str(info.value) and "evil" not in str(info.value)


def test_missing_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError) as info:
        load_config(path, POOL, "/state")
    assert str(info.value) == f"{path}: (file): cannot read: No such file or directory"


def test_oversized_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "big.toml"
    path.write_bytes(b"#" * (2 << 20))
    with pytest.raises(ConfigError, match="larger than 1 MiB"):
        load_config(str(path), POOL, "/state")
