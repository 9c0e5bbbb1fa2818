"""The daemon and bottlenetctl never import Ray (the fleet room and its extra are the
trainer's side only): each is imported in a fresh interpreter where ``import ray`` fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_IMPORT_WITHOUT_RAY = """
import sys
sys.modules["ray"] = None  # any import of ray now raises ImportError
for name in sys.argv[1:]:
    __import__(name)
leaked = sorted(m for m in sys.modules if m == "bottlenet.fleet" or m.startswith("ray."))
print(",".join(leaked))
"""
DAEMON = [
    "bottlenet.tap",
    "bottlenet.settings",
    "bottlenet.cli.main",
    "bottlenet.control.blocking",
    "twisted.plugins.bottlenet_plugin",
]


def _import(*modules: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _IMPORT_WITHOUT_RAY, *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("module", DAEMON)
def test_the_daemon_side_imports_without_ray(module: str) -> None:
    """Importing it with Ray unimportable works and loads neither Ray nor bottlenet.fleet."""
    done = _import(module)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ""


def test_the_check_bites_on_the_fleet_room() -> None:
    """The same check on bottlenet.fleet fails, naming the extra to install."""
    done = _import("bottlenet.fleet")
    assert done.returncode != 0
    assert "pip install 'bottlenet[ray]'" in done.stderr
