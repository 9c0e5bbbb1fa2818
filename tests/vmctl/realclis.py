"""The real smolvm CLIs the contract tiers run against: every tested version, one each.

bottlenet is tested with each of ``vmctl.smolvm.TESTED_VERSIONS`` (1.32.2 and 1.37.3). The
venv's ``smolmachines`` wheel (``pip install '.[vm]'`` brings the newest the extra admits) is
one; the others are ``pip install --no-deps --target PREFIX smolmachines==X`` prefixes, found
under ``.smolvm/<version>`` in the checkout (``.ci/run`` installs them there) or in the
directories named by ``BOTTLENET_SMOLVM_PREFIXES`` (``os.pathsep``-separated). The suite runs
offline (``tests/netguard.py``), so it never installs one itself.

A tier whose version is missing skips, saying how to install it; under CI (``CI`` set) it fails
instead: CI must run every tested version.
"""

from __future__ import annotations

import glob
import os
from functools import cache

import pytest

from vmctl.install import SmolvmInstall, find_wheel
from vmctl.smolvm import tested_names

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The versions every contract tier runs against, oldest first.
VERSIONS = tested_names()


def prefixes() -> list[str]:
    """The ``--target`` prefixes looked in: ``$BOTTLENET_SMOLVM_PREFIXES``, then ``.smolvm/*``."""
    named = [p for p in os.environ.get("BOTTLENET_SMOLVM_PREFIXES", "").split(os.pathsep) if p]
    return named + sorted(glob.glob(os.path.join(REPO, ".smolvm", "*")))


@cache
def installs() -> dict[str, SmolvmInstall]:
    """Each real smolvm found, by its wheel's version (the venv's first, then the prefixes)."""
    found: dict[str, SmolvmInstall] = {}
    for where in [None, *prefixes()]:
        install = find_wheel([where] if where else None)
        if install is not None and install.wheel_version is not None:
            found.setdefault(install.wheel_version, install)
    return found


def prefix_of(install: SmolvmInstall) -> str:
    """The directory holding ``install``'s ``smol`` package (for a daemon's ``PYTHONPATH``)."""
    return os.path.dirname(os.path.dirname(install.binary))


def missing_reason(version: str) -> str:
    return (
        f"the real smolvm {version} is not installed: pip install --no-deps --target "
        f".smolvm/{version} smolmachines=={version} (.ci/run does)"
    )


def real_install(version: str) -> SmolvmInstall:
    """The real smolvm ``version``; skips without it (fails under CI, which runs them all)."""
    install = installs().get(version)
    if install is None:
        if os.environ.get("CI"):
            pytest.fail(missing_reason(version))
        pytest.skip(missing_reason(version))
    return install


#: ``@versions``: a test parametrized over every tested version (ids ``1.32.2``, ``1.37.3``).
versions = pytest.mark.parametrize("version", VERSIONS)
