"""The house drawn from the imports: pyproject's layers and acyclic contracts hold on the code,
and break on an upward import or a cycle added to the same graph (so they can fail)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOUSE = "the house has no arrow running back up (rooms in order, top to bottom)"
NO_CYCLE = "no cycle between the rooms, nor between the modules of a room"

#: Imports from a lower room to a higher one, or across one floor.
UPWARD = [
    ("bottlenet.forward.relay", "bottlenet.control.server"),  # data plane -> control
    ("bottlenet.bottles.registry", "bottlenet.control.server"),  # bottles -> control
    ("vmctl.smolvm", "bottlenet.bottles.model"),  # vmctl -> bottles
    ("bottlenet.control.protocol", "bottlenet.cli.main"),  # control -> cli
    ("bottlenet.ops.logs", "bottlenet.bottles.model"),  # side by side: ops -> bottles
    ("bottlenet.errors", "bottlenet.probe.plan"),  # ground floor -> a room
    ("bottlenet.probe.plan", "bottlenet.bridge.reach"),  # no forbidden contract sees it
    ("bottlenet.control.blocking", "bottlenet.fleet.request"),  # the daemon's side -> Ray's
    ("bottlenet.tap", "bottlenet.fleet.pool"),  # side by side on the top floor
    ("bottlenet.bottles.registry", "bottlenet.node.drain"),  # bottles -> the node's policies
    ("bottlenet.node.lease", "bottlenet.control.server"),  # side by side: node -> control
]
#: forward.table imports forward.spec; this closes a ring.
CYCLE = ("bottlenet.forward.spec", "bottlenet.forward.table")

# Run in a fresh interpreter: Twisted's plugin scan (other tests) leaves a ``__provides__`` on
# ``abc.ABC`` that import-linter's option check trips over.
_CHECK = """
import json, sys, tomllib
import grimp
from importlinter import configuration
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.layers import LayersContract

configuration.configure()  # what lint-imports does first (its timer, its file system)
house, no_cycle, upward, cycle = json.loads(sys.argv[1])
config = tomllib.load(open("pyproject.toml", "rb"))["tool"]["importlinter"]
contracts = config.pop("contracts")

def plain(values):
    return {k: str(v) if isinstance(v, bool) else v for k, v in values.items()}

def contract(name, kind):
    (options,) = [c for c in contracts if c["name"] == name]
    return kind(name, plain(config), plain(options))

graph = grimp.build_graph("bottlenet", "vmctl", exclude_type_checking_imports=True)

def kept(name, kind, added=None):
    if added is not None:
        assert not graph.direct_import_exists(importer=added[0], imported=added[1]), added
        graph.add_import(importer=added[0], imported=added[1], line_number=1, line_contents="x")
    try:
        return contract(name, kind).check(graph, verbose=False).kept
    finally:
        if added is not None:
            graph.remove_import(importer=added[0], imported=added[1])

print(json.dumps({
    "house": kept(house, LayersContract),
    "acyclic": kept(no_cycle, AcyclicSiblingsContract),
    "upward": [kept(house, LayersContract, a) for a in upward],
    "cycle_exists": graph.direct_import_exists(importer=cycle[1], imported=cycle[0]),
    "cycle": kept(no_cycle, AcyclicSiblingsContract, cycle),
}))
"""


@pytest.fixture(scope="module")
def verdicts() -> dict[str, Any]:
    args = json.dumps([HOUSE, NO_CYCLE, UPWARD, CYCLE])
    out = subprocess.run(
        [sys.executable, "-c", _CHECK, args], cwd=ROOT, capture_output=True, text=True, check=True
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_the_house_holds_on_the_code(verdicts: dict[str, Any]) -> None:
    """The rooms import only rooms below them, and no modules import each other in a ring."""
    assert verdicts["house"] is True
    assert verdicts["acyclic"] is True


@pytest.mark.parametrize("index", range(len(UPWARD)), ids=[f"{a}->{b}" for a, b in UPWARD])
def test_an_arrow_back_up_breaks_the_house(verdicts: dict[str, Any], index: int) -> None:
    """Any import from a lower room to a higher one (or across one floor) breaks the layers."""
    assert verdicts["upward"][index] is False


def test_a_cycle_breaks_the_acyclic_contract(verdicts: dict[str, Any]) -> None:
    """A ring of imports between two modules of one room breaks the acyclic contract."""
    assert verdicts["cycle_exists"] is True
    assert verdicts["cycle"] is False
