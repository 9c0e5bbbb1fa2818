"""The daemon's TOML configuration file: forward-only bottles declared up front.

Everything is checked here, before the reactor runs or anything is bound, and every problem
becomes one :class:`ConfigError` line that names the file, the key and the reason.
"""

from __future__ import annotations

import ipaddress
import tomllib
from collections.abc import Mapping
from typing import Any

from attrs import frozen

from bottlenet.errors import BottlenetError
from bottlenet.fields import Fields
from bottlenet.forward.spec import (
    DEFAULT_MAX_CONNECTIONS,
    MAX_CONNECTIONS_LIMIT,
    AliasPool,
    TargetSpec,
    check_bottle_name,
    check_label,
    check_port,
    parse_target,
    targets_dir,
)


class ConfigError(Exception):
    """A configuration problem, already phrased as one line for the operator."""


@frozen
class ForwardConfig:
    label: str
    port: int
    target: TargetSpec
    max_connections: int


@frozen
class BottleConfig:
    name: str
    alias: ipaddress.IPv4Address
    forwards: tuple[ForwardConfig, ...]


@frozen
class DaemonConfig:
    bottles: tuple[BottleConfig, ...]


_TOP_KEYS = {"bottle"}
_BOTTLE_KEYS = {"name", "alias", "forward"}
_FORWARD_KEYS = {"label", "port", "target", "max_connections"}


class _Reader:
    """Walks the parsed TOML and turns each problem into a ConfigError naming file and key."""

    def __init__(self, path: str, pool: AliasPool, unix_root: str) -> None:
        self.path = path
        self.pool = pool
        self.unix_root = unix_root

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.path}: {message}")

    def fields(self, table: object, where: str, allowed: set[str]) -> Fields:
        return Fields(table, where, allowed=allowed, error=self.error)

    def validated(self, f: Fields, key: str, check: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return check(*args, **kwargs)
        except BottlenetError as e:
            raise f.fail(key, e.message) from None

    def tables(self, f: Fields, key: str, what: str, allowed: set[str]) -> list[Fields]:
        """The array of tables at ``key``, each checked for unknown keys."""
        raw = f.get(key, [])
        if not isinstance(raw, list):
            raise f.fail(key, f"must be an array of tables ({what})")
        return [self.fields(item, f.path(f"{key}[{i}]"), allowed) for i, item in enumerate(raw)]

    def read(self, data: Mapping[str, Any]) -> DaemonConfig:
        top = self.fields(data, "", _TOP_KEYS)
        bottles: list[BottleConfig] = []
        names: set[str] = set()
        aliases: set[ipaddress.IPv4Address] = set()
        for raw in self.tables(top, "bottle", "[[bottle]]", _BOTTLE_KEYS):
            bottle = self.read_bottle(raw)
            if bottle.name in names:
                raise raw.fail("name", f"bottle {bottle.name} is declared twice")
            if bottle.alias in aliases:
                raise raw.fail("alias", f"alias {bottle.alias} belongs to another bottle")
            names.add(bottle.name)
            aliases.add(bottle.alias)
            bottles.append(bottle)
        return DaemonConfig(tuple(bottles))

    def read_bottle(self, f: Fields) -> BottleConfig:
        name = self.validated(f, "name", check_bottle_name, f.get("name", required=True))
        alias = self.validated(f, "alias", self.pool.parse_alias, f.get("alias", required=True))
        forwards: list[ForwardConfig] = []
        labels: set[str] = set()
        ports: set[int] = set()
        for raw in self.tables(f, "forward", "[[bottle.forward]]", _FORWARD_KEYS):
            forward = self.read_forward(raw, name)
            if forward.label in labels:
                raise raw.fail("label", f"label {forward.label} is used twice")
            if forward.port and forward.port in ports:
                raise raw.fail("port", f"port {forward.port} is used twice")
            labels.add(forward.label)
            ports.add(forward.port)
            forwards.append(forward)
        return BottleConfig(name, alias, tuple(forwards))

    def read_forward(self, f: Fields, bottle: str) -> ForwardConfig:
        label = self.validated(f, "label", check_label, f.get("label", required=True))
        port = self.validated(f, "port", check_port, f.get("port", 0), allow_zero=True)
        target = self.validated(
            f,
            "target",
            parse_target,
            f.get("target", required=True),
            unix_root=targets_dir(self.unix_root, bottle),
        )
        max_conn = f.integer(
            "max_connections", 1, MAX_CONNECTIONS_LIMIT, default=DEFAULT_MAX_CONNECTIONS
        )
        return ForwardConfig(label, port, target, max_conn)


def parse_config(text: bytes, path: str, pool: AliasPool, unix_root: str) -> DaemonConfig:
    """Parse and validate the bytes of a config file (``path`` is only used in messages)."""
    try:
        data = tomllib.loads(text.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: (file): not valid UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        # tomllib's message names the line and column; it quotes no file content.
        raise ConfigError(f"{path}: (syntax): {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: (syntax): nested too deeply") from None
    return _Reader(path, pool, unix_root).read(data)


def load_config(path: str, pool: AliasPool, unix_root: str) -> DaemonConfig:
    """Read ``path`` and validate it; every failure is a one-line ConfigError."""
    try:
        with open(path, "rb") as f:
            text = f.read((1 << 20) + 1)
    except OSError as e:
        raise ConfigError(f"{path}: (file): cannot read: {e.strerror}") from None
    if len(text) > 1 << 20:
        raise ConfigError(f"{path}: (file): larger than 1 MiB")
    return parse_config(text, path, pool, unix_root)
