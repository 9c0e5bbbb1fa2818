"""``vmctl.kvm``: what ``/dev/kvm`` shows before any boot, on real device nodes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vmctl import kvm
from vmctl.kvm import KVM_API_VERSION, probe_kvm

REPO = str(Path(__file__).resolve().parents[2])
#: /dev/null's device numbers: a character device every host has, which knows no KVM ioctl.
NULL = os.makedev(1, 3)


def null_node(where: Path, mode: int) -> str:
    """A character device node of /dev/null's at ``where`` (made by root) with ``mode``."""
    os.mknod(where, stat.S_IFCHR | mode, NULL)
    os.chmod(where, mode)
    return str(where)


def test_a_missing_device_says_so(tmp_path: Path) -> None:
    """No /dev/kvm: not usable, and why."""
    status = probe_kvm(str(tmp_path / "kvm"))
    assert not status.usable and "is missing" in str(status.why)


def test_a_regular_file_is_not_a_character_device(tmp_path: Path) -> None:
    """K01: a file at the path is refused before it is opened."""
    path = tmp_path / "kvm"
    path.write_text("")
    status = probe_kvm(str(path))
    assert status == kvm.KvmStatus(False, f"{path} is not a character device")


def test_a_character_device_that_is_not_kvm_does_not_answer() -> None:
    """/dev/null opens read-write but knows no KVM_GET_API_VERSION."""
    status = probe_kvm("/dev/null")
    assert not status.usable
    assert "does not answer KVM_GET_API_VERSION" in str(status.why)


def test_another_api_version_is_not_usable(monkeypatch: Any) -> None:
    """K02: a device answering an API other than 12 is refused, naming both versions (the
    kernel's answer is stood in for: no host has a KVM of another API)."""
    monkeypatch.setattr(kvm.fcntl, "ioctl", lambda fd, request: KVM_API_VERSION - 1)
    status = probe_kvm("/dev/null")
    assert status == kvm.KvmStatus(False, "/dev/null speaks KVM API 11, not 12")
    monkeypatch.setattr(kvm.fcntl, "ioctl", lambda fd, request: KVM_API_VERSION)
    assert probe_kvm("/dev/null").usable


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node and dropping a capability")
def test_a_device_the_daemon_can_only_read_is_not_usable(tmp_path: Path) -> None:
    """K03: a VM needs /dev/kvm read-write; a node the daemon may only read (0444, as a
    root without CAP_DAC_OVERRIDE sees it) fails the open, whatever it would answer."""
    node = null_node(tmp_path / "kvm", 0o444)
    code = "import sys; from vmctl.kvm import probe_kvm; print(probe_kvm(sys.argv[1]).describe())"
    done = subprocess.run(
        ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", sys.executable,
         "-c", code, node],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == f"not usable: cannot open {node}: Permission denied"


@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="this host has no /dev/kvm")
@pytest.mark.skipif(os.geteuid() != 0, reason="/dev/kvm is root's 0600 here")
def test_this_hosts_kvm_answers_the_stable_api() -> None:
    """The real device: read-write, API 12 (whether it boots smolvm's guests is another
    matter: docs/smolvm.md)."""
    assert probe_kvm().usable
