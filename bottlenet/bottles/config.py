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

    def fail(self, key: str, reason: str) -> ConfigError:
        return ConfigError(f"{self.path}: {key}: {reason}")

    def check_keys(self, table: Mapping[str, Any], allowed: set[str], where: str) -> None:
        for key in table:
            if key not in allowed:
                # The key came from the file: show it only if it is harmless.
                shown = key if key.isascii() and key.isidentifier() and len(key) <= 40 else "?"
                prefix = f"{where}." if where else ""
                raise self.fail(f"{prefix}{shown}", "unknown key")

    def required(self, table: Mapping[str, Any], key: str, where: str) -> Any:
        if key not in table:
            raise self.fail(f"{where}.{key}", "missing")
        return table[key]

    def validated(self, key: str, check: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return check(*args, **kwargs)
        except BottlenetError as e:
            raise self.fail(key, e.message) from None

    def read(self, data: Mapping[str, Any]) -> DaemonConfig:
        self.check_keys(data, _TOP_KEYS, "")
        raw_bottles = data.get("bottle", [])
        if not isinstance(raw_bottles, list):
            raise self.fail("bottle", "must be an array of tables ([[bottle]])")
        bottles: list[BottleConfig] = []
        names: set[str] = set()
        aliases: set[ipaddress.IPv4Address] = set()
        for i, raw in enumerate(raw_bottles):
            where = f"bottle[{i}]"
            if not isinstance(raw, dict):
                raise self.fail(where, "must be a table")
            bottle = self.read_bottle(raw, where)
            if bottle.name in names:
                raise self.fail(f"{where}.name", f"bottle {bottle.name} is declared twice")
            if bottle.alias in aliases:
                raise self.fail(f"{where}.alias", f"alias {bottle.alias} belongs to another bottle")
            names.add(bottle.name)
            aliases.add(bottle.alias)
            bottles.append(bottle)
        return DaemonConfig(tuple(bottles))

    def read_bottle(self, raw: Mapping[str, Any], where: str) -> BottleConfig:
        self.check_keys(raw, _BOTTLE_KEYS, where)
        name = self.validated(f"{where}.name", check_bottle_name, self.required(raw, "name", where))
        alias = self.validated(
            f"{where}.alias", self.pool.parse_alias, self.required(raw, "alias", where)
        )
        raw_forwards = raw.get("forward", [])
        if not isinstance(raw_forwards, list):
            raise self.fail(f"{where}.forward", "must be an array of tables ([[bottle.forward]])")
        forwards: list[ForwardConfig] = []
        labels: set[str] = set()
        ports: set[int] = set()
        for j, fraw in enumerate(raw_forwards):
            fwhere = f"{where}.forward[{j}]"
            if not isinstance(fraw, dict):
                raise self.fail(fwhere, "must be a table")
            forward = self.read_forward(fraw, fwhere, name)
            if forward.label in labels:
                raise self.fail(f"{fwhere}.label", f"label {forward.label} is used twice")
            if forward.port and forward.port in ports:
                raise self.fail(f"{fwhere}.port", f"port {forward.port} is used twice")
            labels.add(forward.label)
            ports.add(forward.port)
            forwards.append(forward)
        return BottleConfig(name, alias, tuple(forwards))

    def read_forward(self, raw: Mapping[str, Any], where: str, bottle: str) -> ForwardConfig:
        self.check_keys(raw, _FORWARD_KEYS, where)
        label = self.validated(f"{where}.label", check_label, self.required(raw, "label", where))
        port = self.validated(f"{where}.port", check_port, raw.get("port", 0), allow_zero=True)
        target = self.validated(
            f"{where}.target",
            parse_target,
            self.required(raw, "target", where),
            unix_root=targets_dir(self.unix_root, bottle),
        )
        max_conn = raw.get("max_connections", DEFAULT_MAX_CONNECTIONS)
        if (
            isinstance(max_conn, bool)
            or not isinstance(max_conn, int)
            or not 1 <= max_conn <= MAX_CONNECTIONS_LIMIT
        ):
            raise self.fail(
                f"{where}.max_connections", f"must be an integer 1-{MAX_CONNECTIONS_LIMIT}"
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
