"""The real smolvm's disk templates, expanded once per test session before any real start.

The ``smolmachines`` wheel ships ``storage-template.ext4.zst`` and ``overlay-template.ext4.zst``
(sparse 20 GiB and 10 GiB ext4 images). smolvm 1.32.2 expands them next to its binary on the
first ``machine start`` after an install (``<name>.partial``, then a rename to ``<name>``) and
reuses them from then on; ``strace -f`` shows that first start spending ~19 s (a quiet machine)
decoding 30 GiB of mostly zeros before it spawns the VMM, which then fails on KVM within 0.1 s.
A fresh venv (CI's) pays that once, in whichever test starts a machine first.

Here the same bytes are produced by ``zstd -d --sparse`` (the same frames, decoded by the
reference decoder) in a background process started when the session has collected a test that
starts the real smolvm, so the decode overlaps the tests that run before it; those tests wait
for it through :func:`real_templates`. Each file is written under a private name and renamed
into place when complete, so a smolvm that expands its own copy meanwhile is never disturbed.
Without ``zstd``, or with templates already there, nothing is done and smolvm expands them
itself, as before. Every contract fact the tests read from the real binary is unchanged: they
still run its ``machine start``; only the one-time cache fill is done by another decoder.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator

import pytest

from tests.vmctl.realclis import installs
from vmctl.install import SmolvmInstall

#: The templates smolvm 1.32.2 expands next to its binary on the first start (each from
#: ``<name>.zst`` beside it).
TEMPLATES = ("storage-template.ext4", "overlay-template.ext4")
#: The private name each one is decoded to before its rename (never smolvm's ``.partial``).
_TMP = ".{name}.bn-expanding"
#: ``sh -c`` script: decode one template (``$2``, in directory ``$1``) to its private name
#: (``$3``, :data:`_TMP`), then move it into place.
_SCRIPT = 'zstd -q -d --sparse -f -o "$1/$3" "$1/$2.zst" && mv -f "$1/$3" "$1/$2"'

#: The decodes in flight or done, one process per template (two cores: they run side by side).
_running: list[subprocess.Popen[bytes]] | None = None


def missing_templates(install: SmolvmInstall) -> list[str]:
    """The templates beside ``install``'s binary that have a ``.zst`` but are not expanded."""
    here = os.path.dirname(os.path.realpath(install.binary))
    return [
        name
        for name in TEMPLATES
        if os.path.exists(os.path.join(here, name + ".zst"))
        and not os.path.exists(os.path.join(here, name))
    ]


def start_expansion() -> None:
    """Start decoding every real smolvm's missing templates in the background (at most once;
    each tested version's wheel has its own, ``tests/vmctl/realclis.py``)."""
    global _running
    if _running is not None or shutil.which("zstd") is None:
        return
    _running = []
    for install in installs().values():
        here = os.path.dirname(os.path.realpath(install.binary))
        names = missing_templates(install) if os.access(here, os.W_OK) else []
        _running += [
            subprocess.Popen(
                ["sh", "-c", _SCRIPT, "sh", here, name, _TMP.format(name=name)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # its own group: stop_expansion ends zstd with it
            )
            for name in names
        ]


def wait_for_expansion() -> None:
    """Block until the background decodes (started here if they were not) have finished."""
    start_expansion()
    for proc in _running or []:
        proc.wait()


def stop_expansion() -> None:
    """Kill decodes still running at the end of the session and remove their partial files."""
    global _running
    procs, _running = _running or [], None
    live = [proc for proc in procs if proc.poll() is None]
    for proc in live:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if not live:
        return
    for install in installs().values():
        here = os.path.dirname(os.path.realpath(install.binary))
        for name in TEMPLATES:
            try:
                os.unlink(os.path.join(here, _TMP.format(name=name)))
            except FileNotFoundError:
                pass


@pytest.fixture(scope="session")
def real_templates() -> Iterator[None]:
    """The real smolvm's disk templates are expanded (see the module docstring)."""
    wait_for_expansion()
    yield
