"""A bottle's directory, ``<state-dir>/bottles/<name>/``, removed as hostile ground.

Under per-VM uids its ``sidecar/`` is the sidecar VMM uid's own (``vmmaccess``): a VMM that
escaped its guest can fill it with anything (deep trees, files, FIFOs, symlinks, renames while
the daemon works). So the directory is removed with descriptor-relative calls, bounded in
depth and entries (``paths.remove_tree_at``), and whatever is in it goes, whatever its type:
it belongs to the bottle. What one attempt cannot remove is moved aside to ``.trash-<hex>``
(cleared at the next start, a bounded piece per start), so the bottle's name is free again at
once. Nothing here raises: one bottle's cleanup never fails a teardown or a daemon's start.
Blocking file calls: run them off the reactor thread where the caller can.
"""

from __future__ import annotations

import os

from twisted.logger import Logger

from bottlenet.errors import safe_repr
from bottlenet.paths import remove_tree_at

BOTTLES = "bottles"
#: What a removal could not finish is renamed to this prefix plus 16 hex digits.
TRASH_PREFIX = ".trash-"

log = Logger()


def remove_bottle_dir(state_dir: str, name: str) -> bool:
    """Remove ``bottles/<name>`` and everything in it; what cannot be removed now is moved
    aside. True when the name is free. Never raises (a failure is logged)."""
    root = os.path.join(state_dir, BOTTLES)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError as e:
        log.error("cannot open {root}: {why}", root=root, why=e.strerror)
        return False
    try:
        return _remove_or_move_aside(fd, name)
    finally:
        os.close(fd)


def _remove_or_move_aside(fd: int, name: str) -> bool:
    try:
        remove_tree_at(fd, name)
        return True
    except OSError as e:
        why = e.strerror or type(e).__name__
    aside = f"{TRASH_PREFIX}{os.urandom(8).hex()}"
    try:
        os.rename(name, aside, src_dir_fd=fd, dst_dir_fd=fd)
    except OSError as e:
        log.error(
            "bottle directory {name} not removed ({why}) nor moved aside ({err})",
            name=safe_repr(name, 80),
            why=why,
            err=e.strerror,
        )
        return False
    log.warn(
        "bottle directory {name} not removed ({why}); moved aside to {aside}, cleared at the "
        "next start",
        name=safe_repr(name, 80),
        why=why,
        aside=aside,
    )
    return True
