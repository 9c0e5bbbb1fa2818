"""No function of the product is over 80 lines (issue 23): long functions are where state hides."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMIT = 80


def _long_functions(source: str, name: str) -> list[str]:
    tree = ast.parse(source, name)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > LIMIT:
                found.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_product_function_is_over_80_lines() -> None:
    """Every function in bottlenet/ and vmctl/ fits in 80 lines, decorators excluded."""
    found: list[str] = []
    for package in ("bottlenet", "vmctl"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found += _long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert found == []


def test_the_check_sees_a_long_function() -> None:
    """The counter itself finds an 81-line function (so the rule above can fail)."""
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    assert _long_functions("def f():\n" + body, "t.py") == ["t.py:1 f (81 lines)"]
    assert _long_functions("def f():\n" + body[: -len("    x79 = 79\n")], "t.py") == []
