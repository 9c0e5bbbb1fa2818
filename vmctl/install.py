"""Find the smolvm binary and the assets it needs (libkrun, libkrunfw, the agent rootfs).

One job: answer "which smolvm, and where did it come from", once, at daemon start. The order
is the ``--smolvm`` option, then ``smolvm`` on ``PATH``, then the ``smolmachines`` wheel of the
``bottlenet[vm]`` extra (which ships the CLI as ``smol/smol-vmm`` next to ``libkrun.so``,
``libkrunfw.so.5`` and ``agent-rootfs.tar.zst``). Assets found next to the binary are passed
to smolvm explicitly (``SMOLVM_LIB_DIR``, ``SMOLVM_AGENT_ROOTFS``) because vmctl never lets the
daemon's own environment through, and smolvm's default lookups (``$HOME/.local/share/smolvm``)
depend on who installed it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from attrs import frozen

#: The PyPI distribution that bundles the real smolvm CLI (``pip install 'bottlenet[vm]'``).
WHEEL_DIST = "smolmachines"
#: Where the CLI sits inside that wheel, relative to site-packages.
WHEEL_BINARY = ("smol", "smol-vmm")
LIB_NAMES = ("libkrun.so", "libkrunfw.so.5")
ROOTFS_NAMES = ("agent-rootfs", "agent-rootfs.tar.zst")

SOURCE_OPTION = "option"
SOURCE_PATH = "path"
SOURCE_WHEEL = "wheel"


@frozen
class SmolvmInstall:
    """One smolvm binary and the assets handed to it. ``source`` says how it was found."""

    binary: str
    source: str
    lib_dir: str | None = None
    agent_rootfs: str | None = None
    wheel_version: str | None = None

    def describe(self) -> str:
        """One line for logs and ``bottlenetctl status``: where this smolvm came from."""
        where = {
            SOURCE_OPTION: "--smolvm",
            SOURCE_PATH: "PATH",
            SOURCE_WHEEL: f"{WHEEL_DIST} {self.wheel_version} wheel (bottlenet[vm])",
        }.get(self.source, self.source)
        return f"{self.binary} (from {where})"

    def env(self) -> dict[str, str]:
        """The asset variables smolvm gets (only what was found, never inherited)."""
        out: dict[str, str] = {}
        if self.lib_dir is not None:
            out["SMOLVM_LIB_DIR"] = self.lib_dir
        if self.agent_rootfs is not None:
            out["SMOLVM_AGENT_ROOTFS"] = self.agent_rootfs
        return out


def is_executable(path: str) -> bool:
    """An executable file the daemon may run (see :func:`untrusted_reason`)."""
    return os.path.isfile(path) and os.access(path, os.X_OK) and untrusted_reason(path) is None


def untrusted_reason(path: str) -> str | None:
    """Why the binary at ``path`` must not be run by the daemon, or None.

    The binary (after symlinks) and its directory must belong to root or to the daemon's
    user and be writable by nobody else: otherwise another user could swap in a "smolvm"
    that the daemon then runs with its rights.
    """
    real = os.path.realpath(path)
    for what, p in (("binary", real), ("directory", os.path.dirname(real))):
        try:
            st = os.stat(p)
        except OSError as e:
            return f"cannot inspect its {what}: {e.strerror}"
        if st.st_uid not in (0, os.geteuid()):
            return f"its {what} {p} is owned by uid {st.st_uid}"
        if st.st_mode & 0o022:
            return f"its {what} {p} is writable by group or others (mode {st.st_mode & 0o7777:04o})"
    return None


def assets_beside(binary: str) -> tuple[str | None, str | None]:
    """The lib dir and agent rootfs that sit next to ``binary`` (the wheel's layout)."""
    here = os.path.dirname(os.path.realpath(binary))
    lib_dir = here if all(os.path.isfile(os.path.join(here, n)) for n in LIB_NAMES) else None
    rootfs = next(
        (os.path.join(here, n) for n in ROOTFS_NAMES if os.path.exists(os.path.join(here, n))),
        None,
    )
    return lib_dir, rootfs


def _with_assets(binary: str, source: str, wheel_version: str | None = None) -> SmolvmInstall:
    lib_dir, rootfs = assets_beside(binary)
    return SmolvmInstall(binary, source, lib_dir, rootfs, wheel_version)


def find_wheel() -> SmolvmInstall | None:
    """The smolvm of the installed ``smolmachines`` distribution, or None.

    Read from the distribution's metadata: the package is never imported (it loads a large
    native module).
    """
    from importlib import metadata

    try:
        dist = metadata.distribution(WHEEL_DIST)
    except metadata.PackageNotFoundError:
        return None
    binary = os.path.abspath(str(dist.locate_file(os.path.join(*WHEEL_BINARY))))
    if not is_executable(binary):
        return None
    return _with_assets(binary, SOURCE_WHEEL, dist.version)


def discover(
    option: str | None,
    env_path: str | None,
    wheel: Callable[[], SmolvmInstall | None] = find_wheel,
) -> SmolvmInstall | None:
    """Resolve smolvm once: ``--smolvm``, else ``smolvm`` on PATH, else the wheel.

    A ``--smolvm`` path with a slash is made absolute, a bare name is searched on
    ``env_path``; a ``--smolvm`` that names nothing executable gives None (it never falls
    back to something the operator did not ask for). Relative PATH entries are ignored,
    since the daemon's cwd is not a trusted place to find binaries.
    """
    if option:
        found = _search(option, env_path)
        return _with_assets(found, SOURCE_OPTION) if found else None
    found = _search("smolvm", env_path)
    if found:
        return _with_assets(found, SOURCE_PATH)
    return wheel()


def _search(name: str, env_path: str | None) -> str | None:
    if os.sep in name:
        candidate = os.path.abspath(name)
        return candidate if is_executable(candidate) else None
    for entry in (env_path or "").split(os.pathsep):
        if not entry or not os.path.isabs(entry):
            continue
        candidate = os.path.join(entry, name)
        if is_executable(candidate):
            return candidate
    return None


__all__ = [
    "SmolvmInstall",
    "assets_beside",
    "discover",
    "find_wheel",
    "is_executable",
    "untrusted_reason",
]
