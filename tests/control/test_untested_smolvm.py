"""A daemon whose smolvm is outside the tested versions (the fake reporting 1.38.0): one
warning line at start, an "untested" mark in ``bottlenetctl status`` and ``node info``, and
``smolvm_tested`` false in Hello and NodeInfo (issue 35; newcomer-3 trap 9)."""

from __future__ import annotations

import os

import pytest

from tests.control.vmdaemon import VMDaemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="VMDaemon's fake needs root")


def test_a_fake_reporting_1380_is_warned_once_and_marked_untested() -> None:
    d = VMDaemon()
    d.fake.set_faults("exec-netns", version="1.38.0")
    d.start()
    try:
        with d.client() as c:
            hello = c.hello()
            node = c.node_info()
        assert hello.smolvm_version == "1.38.0" and hello.smolvm_tested is False
        assert hello.smolvm_tested_versions == ("1.32.2", "1.37.3")
        assert node.smolvm == "1.38.0" and node.smolvm_tested is False
        status = d.ctl("status").stdout.decode()
        assert "1.38.0 (untested: tested with 1.32.2, 1.37.3)" in status, status
        assert "1.38.0 (untested)" in d.ctl("node", "info").stdout.decode()
        warned = [line for line in d.log().splitlines() if "is untested" in line]
        assert len(warned) == 1, d.log()[-3000:]
    finally:
        assert d.cleanup() == []


def test_a_tested_version_is_not_marked() -> None:
    d = VMDaemon()
    d.fake.set_faults("exec-netns", version="1.37.3")
    d.start()
    try:
        with d.client() as c:
            assert c.hello().smolvm_tested is True
        assert "untested" not in d.ctl("status").stdout.decode()
        assert "is untested" not in d.log()
    finally:
        assert d.cleanup() == []
