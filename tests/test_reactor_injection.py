"""No global reactor in library code: only the composition roots import it
(docs/architecture.md, "The doors"); everything else takes the reactor or a clock."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The entry point that composes the daemon (``tap.makeService``): the only module of the
#: package that may name the global reactor (the benchmark relay, ``benchmarks/standalone.py``,
#: is not shipped).
COMPOSITION_ROOTS = frozenset({"bottlenet/tap.py"})


def global_reactor_imports(source: str) -> list[int]:
    """Lines of ``source`` that import ``twisted.internet.reactor`` in any spelling."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.module == "twisted.internet" and any(a.name == "reactor" for a in node.names):
                lines.append(node.lineno)
            elif node.module is not None and node.module.startswith("twisted.internet.reactor"):
                lines.append(node.lineno)
        elif isinstance(node, ast.Import):
            if any(a.name.startswith("twisted.internet.reactor") for a in node.names):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_finder_sees_every_spelling() -> None:
    """Each way of importing the global reactor is found (and an installer is not)."""
    source = (
        "from twisted.internet import reactor\n"
        "def f():\n    from twisted.internet import task, reactor as r\n"
        "import twisted.internet.reactor\n"
        "from twisted.internet.reactor import callLater\n"
        "from twisted.internet import epollreactor\n"
    )
    assert global_reactor_imports(source) == [1, 3, 4, 5]


def test_library_code_never_imports_the_global_reactor() -> None:
    """Outside the composition roots no module of bottlenet/ or vmctl/ imports the reactor."""
    found = []
    for package in ("bottlenet", "vmctl"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in COMPOSITION_ROOTS:
                continue
            found += [f"{rel}:{n}" for n in global_reactor_imports(path.read_text())]
    assert found == [], f"library code imports the global reactor: {found}"


def test_the_composition_roots_still_exist() -> None:
    """The allow-list names real files (a renamed root must be re-listed, not forgotten)."""
    for rel in COMPOSITION_ROOTS:
        assert global_reactor_imports((ROOT / rel).read_text()), rel
