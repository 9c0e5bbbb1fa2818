"""One kit built for the kit room's tests (about a second), shared by the session."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from bottlenet.kit.build import Kit, KitCache


@pytest.fixture(scope="session")
def built_kit() -> Iterator[tuple[KitCache, Kit]]:
    d = tempfile.mkdtemp(prefix="kit-test-")
    os.chmod(d, 0o755)
    cache = KitCache(d)
    kit = cache.ensure()
    yield cache, kit
    from bottlenet.kit.build import remove

    remove(kit.root)
    shutil.rmtree(d, ignore_errors=True)
