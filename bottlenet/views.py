"""Read-only views for listings: a page of a listing costs the page.

Ground floor: the table's, the registry's and the control plane's listings all use it, so it
lives below them and imports nothing of the rooms.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar, overload

K = TypeVar("K")
T = TypeVar("T")


class LazyView(Sequence[T]):
    """``[get(k) for k in keys]``, but each item is built only when read: a page of a listing
    costs the page."""

    def __init__(self, keys: Sequence[K], get: Callable[[K], T]) -> None:
        self._keys = keys
        self._get = get

    def __len__(self) -> int:
        return len(self._keys)

    def __eq__(self, other: object) -> bool:
        """Equal to a list (or another view) with the same items, like the list it stands for."""
        if isinstance(other, list | LazyView):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            get = self._get
            return [get(k) for k in self._keys[index]]
        return self._get(self._keys[index])


__all__ = ["LazyView"]
