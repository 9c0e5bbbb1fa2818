"""Where the daemon keeps things: its state directory, its control socket, private directories.

The ground floor: both the daemon and ``bottlenetctl`` read these rules, so this module
imports nothing of bottlenet but :mod:`bottlenet.errors`.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import os
import socket
import stat
import struct
from collections.abc import Mapping
from typing import Literal

from attrs import frozen

from bottlenet.errors import InvalidArgument

#: The control socket's file name, in the runtime dir or the state dir.
SOCKET_NAME = "control.sock"
#: ``sockaddr_un.sun_path`` is 108 bytes on Linux, 104 on macOS (with the NUL): 103 usable.
MAX_SUN_PATH = 103


def default_state_dir(env: Mapping[str, str]) -> str:
    """``$XDG_STATE_HOME/bottlenet``, else ``~/.local/state/bottlenet`` (one per user)."""
    base = env.get("XDG_STATE_HOME") or os.path.join(
        env.get("HOME") or os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(base, "bottlenet")


class PrivateDirError(InvalidArgument):
    """A directory that must be ours alone is not, or cannot be made so.

    The message names the directory as the caller asked (a path for the operator, or e.g.
    "bottle directory of NAME" where the message goes to a control client).
    """


#: The one bit beyond 0700 a traversable private directory may carry: search by others.
#: smolvm 1.32 (as root) adds it to every ancestor of its data dir at ``machine start`` so that
#: its per-VM uids reach their VM directories (``docs/smolvm.md``, "Privilege model").
TRAVERSE_BIT = 0o001


def ensure_private_dir(path: str, *, name: str | None = None, traversable: bool = False) -> bool:
    """Create ``path`` (and parents) so that it is a real directory, ours, mode 0700.

    An existing symlink, a non-directory, a directory owned by someone else or one that is
    group/world accessible is refused, never repaired: the daemon never follows or chmods a
    directory it did not create (``--state-dir /tmp`` must not strip ``/tmp``'s sticky bit).
    ``traversable`` also accepts 0701 (others may search, never list, read or write): the state
    directory, whose every file is 0600, after smolvm's ``machine start`` as root.
    Returns True when this call created ``path``; raises PrivateDirError.
    """
    what = path if name is None else name
    created = False
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            os.mkdir(path, 0o700)
            created = True
        except FileExistsError:
            pass
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise PrivateDirError(f"{what} is not a directory (symlinks are refused)")
        if st.st_uid != os.geteuid():
            raise PrivateDirError(f"{what} is owned by uid {st.st_uid}, not by this user")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077 & ~(TRAVERSE_BIT if traversable else 0):
            # mkdir(0700) under any umask is never wider: this directory is not ours to fix.
            raise PrivateDirError(f"{what} is mode {mode:04o}")  # the caller says why
    except OSError as e:
        raise PrivateDirError(f"cannot create {what}: {e.strerror or e}") from None
    return created


#: The lock file in the state directory that makes a daemon its only owner.
LOCK_NAME = "daemon.lock"


class StateDirBusy(InvalidArgument):
    """Another live daemon holds the state directory's lock."""


class StateDirLock:
    """An exclusive ``flock`` on ``<state-dir>/daemon.lock``, holding the owner's pid.

    Taken before the state is read or anything is changed, so a second daemon on the same
    state directory exits before it can run recovery, rewrite ``state.json`` or touch a VM.
    The kernel drops the lock when the holder dies (no stale lock after ``kill -9``).
    """

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, LOCK_NAME)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise StateDirBusy naming the holder's pid; OSError otherwise."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StateDirBusy(f"{self.path} is not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                who = f"pid {holder}" if holder is not None else "a process"
                raise StateDirBusy(
                    f"another bottlenet daemon ({who}) holds {self.path}: "
                    "one daemon per state directory"
                ) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.record_pid()

    def record_pid(self) -> None:
        """Write our pid into the lock file (again after a fork, e.g. twistd daemonizing)."""
        if self._fd is None:
            return
        data = f"{os.getpid()}\n".encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() and len(text) < 12 else None


class NotRegularFile(OSError):
    """A path that must name a regular file names something else (FIFO, device, socket, link)."""


def open_regular(path: str, *, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the regular file at ``path`` (relative to ``dir_fd`` when
    given), opened without ever blocking.

    For any path someone else can write (a guest's read-write volume, the state files): the
    path is ``lstat``-ed first, so a FIFO, a device, a socket or a symlink is refused without
    being opened (opening a FIFO blocks until a writer comes; a device may act on open); the
    open itself is ``O_NONBLOCK | O_NOFOLLOW``, and the descriptor must be the same regular
    file (a swap between the two calls is refused too). Raises OSError (NotRegularFile).
    """
    st = os.lstat(path, dir_fd=dir_fd)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(errno.EINVAL, "not a regular file", path)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise NotRegularFile(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SymlinkInPath(OSError):
    """A path that must be resolved without following links has a symlink at ``filename``."""


_PATH_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir_nofollow(path: str) -> int:
    """An ``O_PATH`` descriptor of the directory ``path``, resolved from ``/`` one component
    at a time (``openat`` with ``O_NOFOLLOW``), so that no symlink anywhere in it is followed.

    For a directory someone else controls a part of (a user's volume): whatever is at the path
    later, the descriptor stays the directory found now. ``path`` must be absolute, without
    ``.`` or ``..`` components. Raises SymlinkInPath naming the first symlink met (its
    ``filename``), NotADirectoryError, FileNotFoundError or another OSError.
    """
    if not path.startswith("/"):
        raise OSError(errno.EINVAL, "not an absolute path", path)
    fd = os.open("/", _PATH_FLAGS)
    walked = ""
    try:
        for part in (p for p in path.split("/") if p):
            walked += "/" + part
            if part in (".", ".."):
                raise OSError(errno.EINVAL, "a . or .. component", walked)
            try:
                child = os.open(part, _PATH_FLAGS, dir_fd=fd)
            except NotADirectoryError:
                mode = os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode
                if stat.S_ISLNK(mode):
                    raise SymlinkInPath(errno.ELOOP, "a symlink", walked) from None
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", walked) from None
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "no such directory", walked) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def fd_path(fd: int) -> str:
    """Where the kernel says the file behind ``fd`` is now (``/proc/self/fd``): a path free of
    symlinks, for calls that take a path; every call on the object itself goes through
    :func:`proc_fd`."""
    return os.readlink(proc_fd(fd))


def proc_fd(fd: int) -> str:
    """``/proc/self/fd/N``: the object ``fd`` refers to, for calls that have no ``f`` variant
    usable on an ``O_PATH`` descriptor (``getxattr``, ``setxattr``); the kernel follows this
    link to the very object, never by name."""
    return f"/proc/self/fd/{fd}"


#: ``struct file_handle``'s header (``handle_bytes``, ``handle_type``) and the most bytes a
#: handle may hold (``MAX_HANDLE_SZ``).
_HANDLE_HEAD = struct.Struct("<Ii")
_MAX_HANDLE = 128
_AT_EMPTY_PATH = 0x1000


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def file_handle(fd: int) -> bytes | None:
    """The kernel's handle of the file behind ``fd`` (``name_to_handle_at``): its type and
    bytes, what :func:`open_by_handle` finds the same file by after any rename, or None when
    its filesystem cannot make one."""
    buf = ctypes.create_string_buffer(_HANDLE_HEAD.size + _MAX_HANDLE)
    _HANDLE_HEAD.pack_into(buf, 0, _MAX_HANDLE, 0)
    mount_id = ctypes.c_int()
    if _libc().name_to_handle_at(fd, b"", buf, ctypes.byref(mount_id), _AT_EMPTY_PATH) != 0:
        return None
    size, _ = _HANDLE_HEAD.unpack_from(buf, 0)
    return buf.raw[: _HANDLE_HEAD.size + size]


def open_by_handle(handle: bytes, mount_fd: int) -> int:
    """An ``O_PATH`` descriptor of the file ``handle`` (:func:`file_handle`) names, on the
    filesystem of ``mount_fd`` (an ``O_RDONLY`` descriptor of any of its directories); needs
    ``CAP_DAC_READ_SEARCH``. Raises OSError (ESTALE: that file is gone)."""
    if len(handle) < _HANDLE_HEAD.size or len(handle) > _HANDLE_HEAD.size + _MAX_HANDLE:
        raise OSError(errno.EINVAL, "not a file handle")
    size, _ = _HANDLE_HEAD.unpack_from(handle, 0)
    if size != len(handle) - _HANDLE_HEAD.size:
        raise OSError(errno.EINVAL, "not a file handle")
    libc = _libc()
    libc.open_by_handle_at.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    fd: int = libc.open_by_handle_at(mount_fd, handle, os.O_PATH | os.O_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


#: How many entries one removal of a tree another uid can write may touch: a hostile tree
#: costs at most this much work per attempt (each attempt removes what it touched).
MAX_TREE_ENTRIES = 10_000
#: How many directories one removal holds open at once; a deeper subtree is moved up first.
MAX_TREE_DEPTH = 16
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class TreeTooLarge(OSError):
    """A tree held more entries than one removal may touch (what it touched is gone)."""


def remove_tree_at(parent_fd: int, name: str, *, max_entries: int = MAX_TREE_ENTRIES) -> None:
    """Remove ``name`` in the directory ``parent_fd`` and everything under it, whatever each
    entry is, in a tree another uid can write while this runs (a VMM's socket directory).

    Every call is relative to a directory descriptor (``O_DIRECTORY | O_NOFOLLOW``, then
    ``scandir``/``unlinkat``/``rmdir`` on it), so no path is resolved twice and no symlink is
    followed: a rename or a symlink swapped in mid-way can only make this remove that link,
    never reach outside the tree. At most ``MAX_TREE_DEPTH`` directories are open at once (a
    deeper one is moved up to ``name`` first, so depth costs no ``PATH_MAX`` and no recursion)
    and at most ``max_entries`` entries are touched (then TreeTooLarge). Missing: nothing to
    do. Raises OSError.
    """
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent_fd)
        return
    top = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        _empty(top, top, 0, [max_entries])
    finally:
        os.close(top)
    os.rmdir(name, dir_fd=parent_fd)


def _empty(top: int, fd: int, depth: int, budget: list[int]) -> None:
    """Remove every entry of the directory ``fd`` (``top`` takes subtrees moved up)."""
    while True:
        with os.scandir(fd) as it:
            batch = [(e.name, e.is_dir(follow_symlinks=False)) for e in itertools.islice(it, 256)]
        if not batch:
            return
        for entry, is_dir in batch:
            budget[0] -= 1
            if budget[0] < 0:
                raise TreeTooLarge(errno.EFBIG, "more entries than one removal may touch")
            if not is_dir:
                _unlink_or_retry(fd, entry)
            elif depth + 1 >= MAX_TREE_DEPTH:
                # Move it up: it is emptied from the top later, with few fds held.
                os.rename(entry, f".up-{os.urandom(8).hex()}", src_dir_fd=fd, dst_dir_fd=top)
            else:
                _remove_subdir(top, fd, entry, depth, budget)


def _unlink_or_retry(fd: int, entry: str) -> None:
    """Unlink a non-directory; one that became a directory is left for the next pass."""
    try:
        os.unlink(entry, dir_fd=fd)
    except (FileNotFoundError, IsADirectoryError):
        pass
    except PermissionError as e:  # Linux says EPERM for unlink of a directory
        if not stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
            raise e from None


def _remove_subdir(top: int, fd: int, entry: str, depth: int, budget: list[int]) -> None:
    try:
        child = os.open(entry, _DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        return
    except (NotADirectoryError, OSError) as e:
        if e.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        _unlink_or_retry(fd, entry)  # swapped for a symlink or a file: that goes
        return
    try:
        _empty(top, child, depth + 1, budget)
    finally:
        os.close(child)
    try:
        os.rmdir(entry, dir_fd=fd)
    except (FileNotFoundError, OSError) as e:
        if e.errno not in (errno.ENOENT, errno.ENOTEMPTY):
            raise  # refilled meanwhile: the next pass of the parent sees it again


def default_control_path(env: Mapping[str, str], state_dir: str) -> str:
    """``$XDG_RUNTIME_DIR/bottlenet/control.sock``, else ``<state-dir>/control.sock``."""
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "bottlenet", SOCKET_NAME)
    return os.path.join(state_dir, SOCKET_NAME)


def default_control_endpoint(env: Mapping[str, str], state_dir: str) -> str:
    """The default ``--control`` value, as an endpoint description."""
    return "unix:" + default_control_path(env, state_dir).replace(":", r"\:")


#: What is at a UNIX socket path before the daemon binds there.
UnixPathState = Literal["absent", "symlink", "not-a-socket", "stale", "alive", "unknown"]


def unix_path_state(path: str) -> tuple[UnixPathState, OSError | None]:
    """Look at ``path`` without following a symlink, and probe a socket found there.

    ``stale`` (nothing accepts: its daemon is gone) is the only state a caller may unlink;
    ``alive`` covers a full backlog too; ``unknown`` (e.g. EACCES) comes with the error and
    is never replaced. The probe is a non-blocking connect: no data is sent, nothing waits.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "absent", None
    if stat.S_ISLNK(st.st_mode):
        return "symlink", None
    if not stat.S_ISSOCK(st.st_mode):
        return "not-a-socket", None
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.setblocking(False)
        probe.connect(path)
    except (BlockingIOError, InterruptedError):
        return "alive", None
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return "stale", None
        return "unknown", e
    finally:
        probe.close()
    return "alive", None


@frozen
class Description:
    """An endpoint description (``kind:ARG:key=value...``) split the way Twisted splits one.

    ``positional`` are the arguments without ``=`` (they come first); ``options`` the
    ``key=value`` ones, each key once. Meaning is the caller's: this only splits.
    """

    kind: str
    positional: tuple[str, ...]
    options: Mapping[str, str]


def split_description(text: str) -> Description:
    """Split on ``:``, honouring ``\\:`` and ``\\\\`` as Twisted's endpoint parser does.

    Raises ValueError (a one-line reason naming no value) for a trailing backslash, a
    positional argument after a keyword one, or a key given twice.
    """
    parts: list[str] = []
    current: list[str] = []
    chars = iter(text)
    for c in chars:
        if c == "\\":
            nxt = next(chars, None)
            if nxt is None:
                raise ValueError("trailing backslash")
            current.append(nxt)
        elif c == ":":
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    parts.append("".join(current))
    kind, *args = parts
    positional: list[str] = []
    options: dict[str, str] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            if options:
                raise ValueError("a positional argument must come before every key=value")
            positional.append(arg)
        elif key in options:
            raise ValueError(f"{key} given twice")
        else:
            options[key] = value
    return Description(kind, tuple(positional), options)
