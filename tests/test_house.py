"""The house drawn from the imports: pyproject's layers and acyclic contracts hold on the code,
and break on an upward import or a cycle added to the same graph (so they can fail)."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grimp
import pytest
from importlinter import configuration
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.layers import LayersContract
from importlinter.domain.contract import Contract

ROOT = Path(__file__).resolve().parent.parent
HOUSE = "the house has no arrow running back up (rooms in order, top to bottom)"
NO_CYCLE = "no cycle between the rooms, nor between the modules of a room"


def _contract(name: str, kind: type[Contract]) -> Contract:
    """The contract ``name`` from pyproject.toml, read as lint-imports reads it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (options,) = [c for c in config.pop("contracts") if c["name"] == name]

    def plain(values: dict[str, Any]) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, bool) else v for k, v in values.items()}

    return kind(name, plain(config), plain(options))


@pytest.fixture(scope="module")
def graph() -> Any:
    configuration.configure()  # what lint-imports does first (its timer, its file system)
    return grimp.build_graph("bottlenet", "vmctl", exclude_type_checking_imports=True)


@contextmanager
def _added(graph: Any, importer: str, imported: str) -> Iterator[Any]:
    """``graph`` with one more import, for the time of the block."""
    assert not graph.direct_import_exists(importer=importer, imported=imported)
    graph.add_import(
        importer=importer, imported=imported, line_number=1, line_contents=f"import {imported}"
    )
    try:
        yield graph
    finally:
        graph.remove_import(importer=importer, imported=imported)


def test_the_house_holds_on_the_code(graph: Any) -> None:
    """The rooms import only rooms below them, and no modules import each other in a ring."""
    assert _contract(HOUSE, LayersContract).check(graph, verbose=False).kept
    assert _contract(NO_CYCLE, AcyclicSiblingsContract).check(graph, verbose=False).kept


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("bottlenet.forward.relay", "bottlenet.control.server"),  # data plane -> control
        ("bottlenet.bottles.registry", "bottlenet.control.server"),  # bottles -> control
        ("vmctl.smolvm", "bottlenet.bottles.model"),  # vmctl -> bottles
        ("bottlenet.control.protocol", "bottlenet.cli.main"),  # control -> cli
        ("bottlenet.ops.logs", "bottlenet.bottles.model"),  # side by side: ops -> bottles
        ("bottlenet.errors", "bottlenet.probe.plan"),  # ground floor -> a room
        ("bottlenet.probe.plan", "bottlenet.bridge.reach"),  # no forbidden contract sees it
    ],
)
def test_an_arrow_back_up_breaks_the_house(graph: Any, importer: str, imported: str) -> None:
    """Any import from a lower room to a higher one (or across one floor) breaks the layers."""
    with _added(graph, importer, imported) as changed:
        assert not _contract(HOUSE, LayersContract).check(changed, verbose=False).kept


def test_a_cycle_breaks_the_acyclic_contract(graph: Any) -> None:
    """A ring of imports between two modules of one room breaks the acyclic contract."""
    assert graph.direct_import_exists(
        importer="bottlenet.forward.table", imported="bottlenet.forward.spec"
    )
    with _added(graph, "bottlenet.forward.spec", "bottlenet.forward.table") as changed:
        assert not _contract(NO_CYCLE, AcyclicSiblingsContract).check(changed, verbose=False).kept
