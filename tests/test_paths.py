"""The one private-directory helper: created 0700, ours, too-open dirs fixed or refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from bottlenet.errors import InvalidArgument
from bottlenet.paths import PrivateDirError, ensure_private_dir


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_creates_parents_and_a_0700_dir_once(tmp_path: Path) -> None:
    d = tmp_path / "a" / "b"
    assert ensure_private_dir(str(d)) is True
    assert _mode(d) == 0o700
    assert ensure_private_dir(str(d)) is False


@pytest.mark.parametrize("mode", [0o750, 0o755, 0o1777])
def test_too_open_is_refused_never_chmodded(tmp_path: Path, mode: int) -> None:
    """Issue 13 item 8: a shared directory (a sticky 1777 one too) is refused, kept as is."""
    d = tmp_path / "wide"
    d.mkdir()
    os.chmod(d, mode)
    (d / "someone-elses-file").write_text("")
    with pytest.raises(PrivateDirError, match=rf"wide is mode {mode:04o}$"):
        ensure_private_dir(str(d))
    assert stat.S_IMODE(os.lstat(d).st_mode) == mode  # refusing never repairs


@pytest.mark.parametrize("mode", [0o701, 0o700])
def test_traversable_accepts_exactly_search_by_others(tmp_path: Path, mode: int) -> None:
    """Issue 19: the state dir after smolvm's start as root (o+x added) is still ours."""
    d = tmp_path / "state"
    d.mkdir()
    os.chmod(d, mode)
    assert ensure_private_dir(str(d), traversable=True) is False
    assert _mode(d) == mode
    if mode == 0o701:
        with pytest.raises(PrivateDirError, match=r"is mode 0701$"):
            ensure_private_dir(str(d))  # not where the caller did not ask for it


@pytest.mark.parametrize("mode", [0o702, 0o703, 0o704, 0o705, 0o707, 0o710, 0o711, 0o720, 0o740])
def test_traversable_never_accepts_group_or_other_read_write(tmp_path: Path, mode: int) -> None:
    """Issue 19: only o+x is smolvm's; group bits or other read/write are refused as before."""
    d = tmp_path / "state"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(PrivateDirError, match=rf"is mode {mode:04o}$"):
        ensure_private_dir(str(d), traversable=True)


def test_symlinks_and_files_refused_with_the_callers_name(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("")
    for name in ("link", "file"):
        with pytest.raises(PrivateDirError) as info:
            ensure_private_dir(str(tmp_path / name), name="bottle directory of x")
        assert (
            info.value.message == "bottle directory of x is not a directory (symlinks are refused)"
        )
    assert issubclass(PrivateDirError, InvalidArgument)  # a typed, client-safe error


def test_os_errors_become_the_typed_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(PrivateDirError, match=r"^cannot create .*file/sub: "):
        ensure_private_dir(str(tmp_path / "file" / "sub"))


def test_unix_path_state_names_what_is_there(tmp_path: Path) -> None:
    """The one stale-socket probe: only a socket nobody accepts on is ``stale``."""
    import socket

    from bottlenet.paths import unix_path_state

    assert unix_path_state(str(tmp_path / "none")) == ("absent", None)
    (tmp_path / "file").write_text("x")
    assert unix_path_state(str(tmp_path / "file"))[0] == "not-a-socket"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(tmp_path / "live"))
    live.listen(1)
    try:
        assert unix_path_state(str(tmp_path / "live"))[0] == "alive"
        os.symlink(tmp_path / "live", tmp_path / "link")
        assert unix_path_state(str(tmp_path / "link"))[0] == "symlink"  # never followed
    finally:
        live.close()
    assert unix_path_state(str(tmp_path / "live"))[0] == "stale"  # bound, nobody listening
