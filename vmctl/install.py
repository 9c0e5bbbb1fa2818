"""Find the smolvm binary and the assets it needs (libkrun, libkrunfw, the agent rootfs).

One job: answer "which smolvm, and where did it come from", once, at daemon start. The order
is the ``--smolvm`` option, then ``smolvm`` on ``PATH``, then the ``smolmachines`` wheel of the
``bottlenet[vm]`` extra (which ships the CLI as ``smol/smol-vmm`` next to ``libkrun.so``,
``libkrunfw.so.5`` and ``agent-rootfs.tar.zst``). Assets found next to the binary are passed
to smolvm explicitly (``SMOLVM_LIB_DIR``, and the agent rootfs in the variable this CLI reads
for it) because vmctl never lets the daemon's own environment through, and smolvm's default
lookups (``$HOME/.local/share/smolvm``) depend on who installed it.

The rootfs tarball goes in ``SMOLVM_AGENT_ROOTFS_TAR`` when the binary holds that name (1.32.2
and 1.37.3 both read it; 1.37 reads ``SMOLVM_AGENT_ROOTFS`` as a directory only and fails
every start with ``read agent rootfs: Not a directory``), else in ``SMOLVM_AGENT_ROOTFS`` as
older CLIs took it; an unpacked rootfs directory always goes in ``SMOLVM_AGENT_ROOTFS``. What
the binary offers decides, never its version string.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence

from attrs import frozen

#: The PyPI distribution that bundles the real smolvm CLI (``pip install 'bottlenet[vm]'``).
WHEEL_DIST = "smolmachines"
#: Where the CLI sits inside that wheel, relative to site-packages.
WHEEL_BINARY = ("smol", "smol-vmm")
LIB_NAMES = ("libkrun.so", "libkrunfw.so.5")
ROOTFS_NAMES = ("agent-rootfs", "agent-rootfs.tar.zst")
#: The variable a CLI reads an unpacked rootfs directory from (and older ones a tarball too).
ROOTFS_DIR_VAR = "SMOLVM_AGENT_ROOTFS"
#: The variable for the rootfs tarball (smolvm PR #356), where the binary holds its name.
ROOTFS_TAR_VAR = "SMOLVM_AGENT_ROOTFS_TAR"
#: The most bytes of a binary searched for a name it reads (the 1.37.3 CLI has 50 MB).
MAX_BINARY_SCAN = 512 * 1024 * 1024

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
    #: The variable ``agent_rootfs`` is passed in (:func:`rootfs_variable`).
    rootfs_var: str = ROOTFS_DIR_VAR
    #: For the wheel: named by hand (pip's ``REQUESTED``), not pulled in by ``bottlenet[vm]``.
    wheel_by_name: bool = False

    def describe(self) -> str:
        """One line for logs and ``bottlenetctl status``: where this smolvm came from."""
        how = "installed by name" if self.wheel_by_name else "pulled in by bottlenet[vm]"
        where = {
            SOURCE_OPTION: "--smolvm",
            SOURCE_PATH: "PATH",
            SOURCE_WHEEL: f"the {WHEEL_DIST} {self.wheel_version} wheel, {how}",
        }.get(self.source, self.source)
        return f"{self.binary} (from {where})"

    def env(self) -> dict[str, str]:
        """The asset variables smolvm gets (only what was found, never inherited)."""
        out: dict[str, str] = {}
        if self.lib_dir is not None:
            out["SMOLVM_LIB_DIR"] = self.lib_dir
        if self.agent_rootfs is not None:
            out[self.rootfs_var] = self.agent_rootfs
        return out


def binary_holds(binary: str, word: bytes) -> bool:
    """Whether the file ``binary`` contains ``word`` (a name it reads, as ``strings`` shows
    it), searched in its first :data:`MAX_BINARY_SCAN` bytes; False when it cannot be read.
    Blocking: run while the daemon is built, before the reactor runs."""
    try:
        with open(binary, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return False
            with mmap.mmap(f.fileno(), min(size, MAX_BINARY_SCAN), access=mmap.ACCESS_READ) as m:
                return m.find(word) >= 0
    except (OSError, ValueError):
        return False


def rootfs_variable(binary: str, rootfs: str | None) -> str:
    """Where this CLI takes ``rootfs``: a directory in ``SMOLVM_AGENT_ROOTFS``; a tarball in
    ``SMOLVM_AGENT_ROOTFS_TAR`` when the binary holds that name, else (an older CLI) in
    ``SMOLVM_AGENT_ROOTFS``."""
    if rootfs is None or os.path.isdir(rootfs):
        return ROOTFS_DIR_VAR
    return ROOTFS_TAR_VAR if binary_holds(binary, ROOTFS_TAR_VAR.encode()) else ROOTFS_DIR_VAR


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


def with_assets(
    binary: str, source: str, wheel_version: str | None = None, wheel_by_name: bool = False
) -> SmolvmInstall:
    """``binary`` with the assets beside it, the rootfs in the variable this CLI reads."""
    lib_dir, rootfs = assets_beside(binary)
    return SmolvmInstall(
        binary,
        source,
        lib_dir,
        rootfs,
        wheel_version,
        rootfs_variable(binary, rootfs),
        wheel_by_name,
    )


def find_wheel(path: Sequence[str] | None = None) -> SmolvmInstall | None:
    """The smolvm of the installed ``smolmachines`` distribution, or None (``path``: the
    directories searched instead of ``sys.path``, e.g. a ``pip install --target`` prefix).

    Read from the distribution's metadata: the package is never imported (it loads a large
    native module). pip's ``REQUESTED`` marks a wheel named on its command line (``pip install
    smolmachines==X``) rather than brought by the ``bottlenet[vm]`` extra.
    """
    from importlib import metadata

    found = (
        metadata.distributions(name=WHEEL_DIST, path=list(path))
        if path
        else metadata.distributions(name=WHEEL_DIST)
    )
    dists = list(found)
    if not dists:
        return None
    dist = dists[0]
    binary = os.path.abspath(str(dist.locate_file(os.path.join(*WHEEL_BINARY))))
    if not is_executable(binary):
        return None
    by_name = dist.read_text("REQUESTED") is not None
    return with_assets(binary, SOURCE_WHEEL, dist.version, by_name)


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
        return with_assets(found, SOURCE_OPTION) if found else None
    found = _search("smolvm", env_path)
    if found:
        return with_assets(found, SOURCE_PATH)
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
    "ROOTFS_DIR_VAR",
    "ROOTFS_TAR_VAR",
    "SmolvmInstall",
    "assets_beside",
    "binary_holds",
    "discover",
    "find_wheel",
    "is_executable",
    "rootfs_variable",
    "untrusted_reason",
    "with_assets",
]
