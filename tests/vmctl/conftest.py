"""pytest fixtures for vmctl tests: a fake smolvm state dir that never leaks processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes import FakeSmolvm


@pytest.fixture
def fake_smolvm(tmp_path: Path) -> Iterator[FakeSmolvm]:
    """A FakeSmolvm in a temp SMOLVM_DATA_DIR; teardown kills every VM pid it recorded and
    fails the test if any survives."""
    fake = FakeSmolvm(str(tmp_path / "smolvm-data"))
    yield fake
    survivors = fake.cleanup()
    assert not survivors, f"fake smolvm processes survived cleanup: {survivors}"
