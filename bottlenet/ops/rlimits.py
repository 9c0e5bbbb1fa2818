"""Process limits the daemon raises at start.

Every relay holds two descriptors and every listener one; the usual soft ``RLIMIT_NOFILE`` of
1024 (256 on macOS) runs out long before the hard limit does. Raising soft to hard needs no
privilege, so the daemon always does it and logs the old and new values.
"""

from __future__ import annotations

import sys
from typing import Any

# macOS refuses a soft limit above kern.maxfilesperproc and reports RLIM_INFINITY as the hard
# limit; OPEN_MAX (10240) from <sys/syslimits.h> is the value setrlimit always accepts there.
MACOS_OPEN_MAX = 10240
# Linux never reports an infinite hard limit for NOFILE (fs.nr_open caps it); this is only
# a fallback for other systems that do.
OTHER_INFINITY_CAP = 1 << 20
# select() cannot watch a descriptor >= FD_SETSIZE; see select_reactor_cap().
FD_SETSIZE = 1024


def raise_nofile(
    cap: int | None = None, *, resource_module: Any = None, platform: str = sys.platform
) -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (at most ``cap``).

    Returns ``(old_soft, new_soft)`` for the caller to log; when the limit cannot be raised
    the two are equal. Never lowers the limit and never raises an exception.
    """
    if resource_module is None:
        try:
            import resource as resource_module
        except ImportError:  # not a POSIX system
            return (-1, -1)
    res = resource_module
    soft, hard = res.getrlimit(res.RLIMIT_NOFILE)
    infinity = res.RLIM_INFINITY
    if hard == infinity:
        target = MACOS_OPEN_MAX if platform == "darwin" else OTHER_INFINITY_CAP
    else:
        target = hard
    if cap is not None:
        target = min(target, cap)
    if soft != infinity and soft >= target:
        return (soft, soft)
    candidates = [target]
    if platform == "darwin" and target > MACOS_OPEN_MAX:
        candidates.append(MACOS_OPEN_MAX)  # kern.maxfilesperproc may be lower than hard
    for candidate in candidates:
        if soft != infinity and candidate <= soft:
            break
        try:
            res.setrlimit(res.RLIMIT_NOFILE, (candidate, hard))
        except (ValueError, OSError):
            continue
        return (soft, candidate)
    return (soft, soft)


def select_reactor_cap(reactor: object) -> int | None:
    """``FD_SETSIZE`` when ``reactor`` is built on ``select()``, else None (no cap needed).

    macOS's default Twisted reactor is the select reactor, which fails on descriptors at or
    above 1024; there, pass this as ``cap`` (or run ``twist --reactor=kqueue``).
    """
    if type(reactor).__name__ == "SelectReactor":
        return FD_SETSIZE
    return None
