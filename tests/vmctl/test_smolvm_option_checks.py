"""The start-up checks of the smolvm binary, at their exact edges.

tests-3 K06 (a ``--version`` that exits non-zero) and K08 (group-writable, not only
world-writable, is untrusted); K01 (the data dir's 61 bytes) is
``tests/test_settings.py::test_smolvm_data_dir_limit_is_61_bytes``. The binaries are shell
scripts the test writes: the checks read modes and run ``--version``, nothing else.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vmctl.install import untrusted_reason
from vmctl.service import StartupRefused, choose_smolvm


def _script(directory: Path, body: str, mode: int = 0o755) -> str:
    directory.mkdir(mode=0o755, exist_ok=True)
    os.chmod(directory, 0o755)
    path = directory / "smolvm"
    path.write_text(f"#!/bin/sh\n{body}\n")
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("code", [1, 3])
def test_a_smolvm_whose_version_exits_non_zero_is_refused(tmp_path: Path, code: int) -> None:
    """A binary that prints ``smolvm 1.32.2`` but exits non-zero is not trusted as a smolvm."""
    binary = _script(tmp_path / "bin", f"echo 'smolvm 1.32.2'; exit {code}")
    with pytest.raises(
        StartupRefused, match=rf"not a usable smolvm \(`--version` exited {code}: 'smolvm 1.32.2'\)"
    ):
        choose_smolvm(binary, None, environ={"PATH": ""}, wheel=lambda: None)


def test_a_smolvm_whose_version_exits_zero_is_used(tmp_path: Path) -> None:
    """The control case of the test above: the same script exiting 0 is accepted."""
    binary = _script(tmp_path / "bin", "echo 'smolvm 1.32.2'; exit 0")
    choice = choose_smolvm(binary, None, environ={"PATH": ""}, wheel=lambda: None)
    assert choice.install is not None and choice.install.binary == binary


@pytest.mark.parametrize(
    ("binary_mode", "dir_mode", "what"),
    [
        (0o775, 0o755, "binary"),
        (0o735, 0o755, "binary"),
        (0o755, 0o775, "directory"),
        (0o755, 0o770, "directory"),
    ],
)
def test_a_group_writable_smolvm_or_directory_is_untrusted(
    tmp_path: Path, binary_mode: int, dir_mode: int, what: str
) -> None:
    """Writable by its group (not by others) is enough to be refused: a group member could
    swap in a "smolvm" that the daemon then runs with its rights."""
    binary = _script(tmp_path / "bin", "echo 'smolvm 1.32.2'", binary_mode)
    os.chmod(tmp_path / "bin", dir_mode)
    reason = untrusted_reason(binary) or ""
    assert f"its {what}" in reason and "writable by group or others" in reason
    with pytest.raises(StartupRefused):
        choose_smolvm(binary, None, environ={"PATH": ""}, wheel=lambda: None)


def test_an_owner_only_writable_smolvm_is_trusted(tmp_path: Path) -> None:
    """The control case: 0755 in a 0755 directory, ours, is trusted."""
    assert untrusted_reason(_script(tmp_path / "bin", "echo 'smolvm 1.32.2'")) is None
