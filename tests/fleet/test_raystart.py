"""``python -m bottlenet.fleet.raystart``: ``ray start``'s resource and labels from NodeInfo."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from bottlenet.fleet.raystart import main
from tests.fleet.daemons import NodeDaemon


@pytest.fixture
def daemon() -> Iterator[NodeDaemon]:
    d = NodeDaemon(
        tempfile.mkdtemp(prefix="bnr-", dir="/tmp"),
        0,
        extra=("--max-bottles", "7", "--label", "kvm=false", "--label", "pool=a"),
    )
    d.start()
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


def test_the_node_offers_its_capacity_and_labels(
    daemon: NodeDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    """The daemon's --max-bottles becomes the bottle resource, its labels Ray's, with
    whether VMs are possible; --bottles lowers the count, never raises it."""
    assert main(["--control", daemon.control]) == 0
    resources, labels = capsys.readouterr().out.split()
    assert resources == '--resources={"bottle":7}'
    assert labels.startswith("--labels=bottlenet-vm=")
    assert labels.endswith(",kvm=false,pool=a")
    assert main(["--control", daemon.control, "--bottles", "3"]) == 0
    assert capsys.readouterr().out.split()[0] == '--resources={"bottle":3}'
    assert main(["--control", daemon.control, "--bottles", "99"]) == 0
    assert capsys.readouterr().out.split()[0] == '--resources={"bottle":7}'


def test_no_daemon_is_one_line_and_status_1(capsys: pytest.CaptureFixture[str]) -> None:
    """A socket nobody listens on: one line naming it, exit status 1, no traceback."""
    root = tempfile.mkdtemp(prefix="bnr-", dir="/tmp")
    path = os.path.join(root, "none.sock")
    try:
        assert main(["--control", path]) == 1
    finally:
        shutil.rmtree(root)
    err = capsys.readouterr().err
    assert err.startswith("raystart: ") and "Traceback" not in err and path in err
