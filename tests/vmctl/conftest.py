"""pytest fixtures for vmctl tests: a fake smolvm state dir that never leaks processes."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.fakes import FakeSmolvm


@pytest.fixture
def fake_smolvm() -> Iterator[FakeSmolvm]:
    """A FakeSmolvm in a short temp state dir (smolvm's own limit, see
    ``vmctl.smolvm.MAX_STATE_DIR``); teardown kills every VM pid it recorded and fails the
    test if any survives."""
    fake = FakeSmolvm(tempfile.mkdtemp(prefix="fake-smolvm-"))
    yield fake
    survivors = fake.cleanup()
    shutil.rmtree(fake.path, ignore_errors=True)
    assert not survivors, f"fake smolvm processes survived cleanup: {survivors}"
