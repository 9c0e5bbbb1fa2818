"""Address and target parsing: invariants 1 and 2 at the value level."""

from __future__ import annotations

import ipaddress

import pytest

from bottlenet.errors import AlreadyExists, InvalidArgument, ResourceExhausted
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import (
    AliasPool,
    TCPTarget,
    UNIXTarget,
    check_bottle_name,
    check_label,
    check_port,
    parse_target,
    unix_listen_for,
)

POOL = AliasPool.parse("127.77.0.0/16")

REJECTED_ALIASES = [
    "0.0.0.0",
    "::",
    "",
    "*",
    "127.0.0.1",
    "::1",
    "localhost",
    "example.com",
    "127.78.0.2",
    "10.0.0.1",
    "127.77.0.0",
    "127.77.255.255",
    "127.1",
    "0x7f.0.0.2",
    "2130706434",
    "127.0.0.016",
    "127.077.0.2",
    " 127.77.0.2",
    "127.77.0.2 ",
    "127.77.0.2\n",
    "127.77.0.2/32",
    "::ffff:127.77.0.2",
    "127.77.0.2:80",
    "127.77.0.2.",
    "\uff11\uff12\uff17.77.0.2",  # fullwidth digits
    None,
    2130706434,
]


@pytest.mark.parametrize("text", REJECTED_ALIASES, ids=repr)
def test_rejected_alias_spellings(text: object) -> None:
    with pytest.raises(InvalidArgument):
        POOL.parse_alias(text)


def test_canonical_alias_accepted() -> None:
    assert POOL.parse_alias("127.77.0.2") == ipaddress.IPv4Address("127.77.0.2")


def test_rejection_message_never_echoes_raw_control_characters() -> None:
    with pytest.raises(InvalidArgument) as info:
        POOL.parse_alias("127.77.0.2\n\x1b[31mevil")
    assert "\n" not in str(info.value) and "\x1b" not in str(info.value)
    assert "sha256:" in str(info.value)


@pytest.mark.parametrize(
    "text", ["127.0.0.0/8", "0.0.0.0/0", "10.0.0.0/8", "127.77.0.1/16", "127.77.0.0", "x/16"]
)
def test_bad_pools(text: str) -> None:
    with pytest.raises(InvalidArgument):
        AliasPool.parse(text)


def test_registry_refuses_other_bottles_alias_and_duplicates() -> None:
    reg = AliasRegistry(POOL)
    assert str(reg.claim("a", "127.77.0.2")) == "127.77.0.2"
    with pytest.raises(AlreadyExists):
        reg.claim("b", "127.77.0.2")
    with pytest.raises(AlreadyExists):
        reg.claim("a")
    with pytest.raises(InvalidArgument):
        reg.check_owned("b", ipaddress.IPv4Address("127.77.0.2"))
    reg.check_owned("a", ipaddress.IPv4Address("127.77.0.2"))
    # Allocation skips the taken alias; release makes it free again.
    assert str(reg.claim("b")) == "127.77.0.1"
    assert str(reg.claim("c")) == "127.77.0.3"
    reg.release("a")
    assert reg.owner(ipaddress.IPv4Address("127.77.0.2")) is None
    assert str(reg.claim("d")) == "127.77.0.2"


def test_registry_exhaustion_is_a_clean_error() -> None:
    reg = AliasRegistry(AliasPool.parse("127.77.0.0/30"))
    reg.claim("a")
    reg.claim("b")
    with pytest.raises(ResourceExhausted):
        reg.claim("c")


@pytest.mark.parametrize(
    "text",
    [
        "localhost:80",
        "example.com:80",
        "10.0.0.1:80",
        "0.0.0.0:80",
        "127.1:80",
        "127.0.0.1",
        "127.0.0.1:0",
        "127.0.0.1:65536",
        "127.0.0.1:080",
        "127.0.0.1:+80",
        "[::]:80",
        "[::ffff:127.0.0.1]:80",
        "::1:80",
        " 127.0.0.1:80",
        "unix:relative/path",
        "unix:/etc/passwd",
        "unix:/state/../etc/x.sock",
    ],
)
def test_rejected_targets(text: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_target(text, unix_root="/state")


def test_accepted_targets() -> None:
    assert parse_target("127.0.0.1:8080") == TCPTarget(ipaddress.IPv4Address("127.0.0.1"), 8080)
    assert parse_target("127.5.6.7:1").describe() == "127.5.6.7:1"
    assert parse_target("[::1]:443").describe() == "[::1]:443"
    assert parse_target("unix:/state/b/x.sock", unix_root="/state") == UNIXTarget("/state/b/x.sock")
    with pytest.raises(InvalidArgument):
        parse_target("unix:/state/b/x.sock")  # no root given: UNIX targets refused


@pytest.mark.parametrize("name", ["", "-a", "A", "a/b", "..", "a\x00", "a" * 64, "é", "a_b"])
def test_bad_bottle_names(name: str) -> None:
    with pytest.raises(InvalidArgument):
        check_bottle_name(name)


@pytest.mark.parametrize("label", ["", "_a", "Web", "a/b", "a" * 33, "a.b"])
def test_bad_labels(label: str) -> None:
    with pytest.raises(InvalidArgument):
        check_label(label)


@pytest.mark.parametrize("port", [-1, 65536, True, "80", 1.0, None])
def test_bad_ports(port: object) -> None:
    with pytest.raises(InvalidArgument):
        check_port(port, allow_zero=True)


def test_port_zero_only_where_allowed() -> None:
    assert check_port(0, allow_zero=True) == 0
    with pytest.raises(InvalidArgument):
        check_port(0, allow_zero=False)


def test_unix_listen_lives_in_the_bottle_dir() -> None:
    assert unix_listen_for("/state", "b1", "egress").path == "/state/bottles/b1/egress.sock"
    with pytest.raises(InvalidArgument):
        unix_listen_for("/state", "../x", "egress")
