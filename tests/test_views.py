"""LazyView, the ground floor's listing view: an item is built only when it is read."""

from __future__ import annotations

from bottlenet.views import LazyView


def test_items_are_built_only_when_read() -> None:
    """Reading one item or one page builds that item or page, nothing else."""
    built: list[int] = []

    def get(k: int) -> str:
        built.append(k)
        return f"item {k}"

    view = LazyView(range(1000), get)
    assert len(view) == 1000 and built == []
    assert view[7] == "item 7" and built == [7]
    assert view[10:12] == ["item 10", "item 11"] and built == [7, 10, 11]


def test_a_view_equals_the_list_it_stands_for_and_is_not_hashable() -> None:
    """Equal to a list (or another view) with the same items; like a list, no hash."""
    view = LazyView(["a", "b"], str.upper)
    assert view == ["A", "B"] and view == LazyView(["x", "y"], lambda k: "AB"[k == "y"])
    assert view != ["A"] and list(view) == ["A", "B"]
    assert view.__hash__ is None
