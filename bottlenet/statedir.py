"""Where the daemon keeps its state, and how private directories are made safely."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from bottlenet.errors import InvalidArgument


def default_state_dir(env: Mapping[str, str]) -> str:
    """``$XDG_STATE_HOME/bottlenet``, else ``~/.local/state/bottlenet`` (one per user)."""
    base = env.get("XDG_STATE_HOME") or os.path.join(
        env.get("HOME") or os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(base, "bottlenet")


def ensure_private_dir(path: str) -> str:
    """Create ``path`` (and parents) so that it is a real directory, ours, mode 0700.

    An existing symlink, a non-directory or a directory owned by someone else is refused
    rather than repaired: the daemon never follows or chmods what it does not own.
    """
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"{path} is not a directory (symlinks are refused)")
    if st.st_uid != os.geteuid():
        raise InvalidArgument(f"{path} is owned by uid {st.st_uid}, not by this user")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path
