"""pytest fixtures for vmctl tests: a fake smolvm state dir that never leaks processes; and
the session hooks that expand the real smolvm's disk templates in the background
(``tests/vmctl/wheeltemplates.py``) once a collected test needs them."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.fakes import FakeSmolvm
from tests.vmctl.wheeltemplates import start_expansion, stop_expansion


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the templates' decode now if a collected test starts the real smolvm."""
    if any("real_templates" in getattr(item, "fixturenames", ()) for item in session.items):
        start_expansion()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """End a decode nobody waited for (a run of only the tests before the first start)."""
    stop_expansion()


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
