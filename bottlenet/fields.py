"""Typed fields of a parsed JSON or TOML object: the one reader behind every document.

The state file (``bottles.model``), bottle specs (``bottles.spec``), the config file
(``bottles.config``) and the control plane's wire records (``control.records``) all read
"field K must be of type T" through :class:`Fields`. Each caller names its own error type
(``StateError``, ``InvalidArgument``, ``ConfigError``, ``RecordError``), so a problem surfaces
in the caller's terms; every message names the field's dotted path and what is wrong with it,
never the value (values may come from a peer or an agent). Booleans never count as numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any


class FieldError(ValueError):
    """A field is missing or mistyped (the default error of :class:`Fields`)."""


def shown_key(key: object) -> str:
    """A key as it may appear in a message: itself when harmless, else ``?``."""
    if isinstance(key, str) and key.isascii() and key.isidentifier() and len(key) <= 40:
        return key
    return "?"


class Fields:
    """Typed access to one object (a mapping); ``where`` is its dotted path ("" at the top).

    ``allowed`` lists the keys it may hold (an unknown key is an error); ``error`` builds
    the exception raised for a message.
    """

    def __init__(
        self,
        table: object,
        where: str = "",
        *,
        allowed: Collection[str] | None = None,
        error: Callable[[str], Exception] = FieldError,
        what: str = "a table",
    ) -> None:
        self.where = where
        self.error = error
        if not isinstance(table, Mapping):
            raise error(f"{where or 'document'}: must be {what}")
        self.table: Mapping[str, Any] = table
        if allowed is not None:
            for key in table:
                if key not in allowed:
                    raise self.fail(shown_key(key), "unknown key")

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, problem: str) -> Exception:
        """The caller's error for ``problem`` with field ``key``."""
        return self.error(f"{self.path(key)}: {problem}")

    def __contains__(self, key: str) -> bool:
        return key in self.table

    def get(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """The raw value; a missing key is ``default`` (an error when ``required``)."""
        if key not in self.table:
            if required:
                raise self.fail(key, "missing")
            return default
        return self.table[key]

    def value(self, key: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
        """The value of ``key`` if it is a ``kind``; missing or null only when ``optional``."""
        value = self.table.get(key)
        if value is None:
            if optional:
                return None
            raise self.fail(key, "missing")
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise self.fail(key, f"must be {_describe(kinds)}")
        return value

    def integer(self, key: str, low: int, high: int, *, default: int | None = None) -> int:
        """An integer ``low``-``high`` (``default`` when missing; else it is required)."""
        value = self.get(key, default, required=default is None)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.fail(key, f"must be an integer {low}-{high}")
        return value

    def number(self, key: str) -> float:
        return float(self.value(key, (int, float)))

    def items(self, key: str, *, optional: bool = False) -> list[Any]:
        """The list at ``key`` (empty when missing and ``optional``)."""
        value = self.value(key, list, optional=optional)
        return [] if value is None else list(value)

    def strings(self, key: str, *, optional: bool = False) -> tuple[str, ...] | None:
        """A list of strings (None when missing and ``optional``)."""
        value = self.value(key, list, optional=optional)
        if value is None:
            return None
        if not all(isinstance(v, str) for v in value):
            raise self.fail(key, "must be a list of strings")
        return tuple(value)

    def str_map(self, key: str) -> dict[str, str]:
        """An object of string values (empty when missing)."""
        value = self.value(key, dict, optional=True) or {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise self.fail(key, "must be an object of strings")
        return dict(value)


_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    list: "a list",
    dict: "an object",
}


def _describe(kinds: tuple[type, ...]) -> str:
    if set(kinds) == {int, float}:
        return "a number"
    return " or ".join(_NAMES.get(k, k.__name__) for k in kinds)
