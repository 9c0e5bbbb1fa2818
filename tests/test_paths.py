"""The one private-directory helper: created 0700, ours, too-open dirs fixed or refused."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from bottlenet.errors import InvalidArgument
from bottlenet.paths import NotRegularFile, PrivateDirError, ensure_private_dir, open_regular


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


@pytest.mark.parametrize("traversable", [False, True])
@pytest.mark.parametrize("owner", ["chown", "other-euid"])
def test_a_private_dir_of_another_uid_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, traversable: bool, owner: str
) -> None:
    """A 0700 directory someone else owns is not ours (tests-3 M03): as root it is chowned to
    65534; without root the daemon's euid is faked to another uid, so any run pins the rule."""
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    if owner == "chown":
        if os.geteuid() != 0:
            pytest.skip("chown to another uid needs root (the other-euid case runs anyway)")
        os.chown(d, 65534, -1)
        foreign = 65534
    else:
        foreign = os.lstat(d).st_uid
        monkeypatch.setattr(os, "geteuid", lambda: foreign + 1)
    with pytest.raises(PrivateDirError, match=rf"theirs is owned by uid {foreign}, not by this"):
        ensure_private_dir(str(d), traversable=traversable)


# open_regular's defences against a swap between its lstat and its open (tests-3 O03-O07):
# the swap is simulated by making lstat report a regular file the path no longer names.


def _swapped_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str) -> Path:
    """A path whose lstat still answers for the regular file ``seen`` while a ``kind``
    (a symlink to ``seen``, a FIFO, another regular file) is there now."""
    seen, path = tmp_path / "seen", tmp_path / "swapped"
    seen.write_text("checked")
    if kind == "symlink":
        path.symlink_to(seen)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text("planted")
    real_lstat = os.lstat
    before = real_lstat(seen)

    def lstat(p: object, *a: object, **kw: object) -> os.stat_result:
        return before if str(p) == str(path) else real_lstat(p, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "lstat", lstat)
    return path


def test_open_regular_refuses_a_symlink_swapped_in_after_lstat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A symlink that appears after the lstat is not followed, even to the file lstat saw."""
    with pytest.raises(OSError):
        open_regular(str(_swapped_in(monkeypatch, tmp_path, "symlink")))


def test_open_regular_refuses_a_fifo_swapped_in_after_lstat_without_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO that appears after the lstat is opened without blocking, then refused."""
    fifo = _swapped_in(monkeypatch, tmp_path, "fifo")
    outcome: list[BaseException | int] = []
    done = threading.Event()

    def call() -> None:
        try:
            outcome.append(open_regular(str(fifo)))
        except BaseException as e:
            outcome.append(e)
        done.set()

    threading.Thread(target=call, daemon=True).start()
    returned = done.wait(30)
    if not returned:  # a blocked open: give it a writer so the thread ends, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        done.wait(30)
    assert returned, "open_regular blocked on a FIFO"
    assert len(outcome) == 1 and isinstance(outcome[0], NotRegularFile)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_open_regular_refuses_another_file_swapped_in_and_leaks_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another regular file (a hard link the guest planted) swapped in after the lstat is
    refused, and the refused descriptor is closed: 100 refusals leave no fd behind."""
    other = _swapped_in(monkeypatch, tmp_path, "file")
    before = _open_fds()
    for _ in range(100):
        with pytest.raises(NotRegularFile):
            open_regular(str(other))
    assert _open_fds() == before
