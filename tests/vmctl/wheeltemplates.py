"""The real smolvms' disk templates, unpacked once per test session before any real start.

The ``smolmachines`` wheel ships ``storage-template.ext4.zst`` and ``overlay-template.ext4.zst``
(sparse 20 GiB and 10 GiB ext4 images). smolvm expands them next to its binary on the first
``machine start`` after an install and reuses them from then on (8 to 19 s, strace). The daemon
unpacks them itself at start (:mod:`vmctl.templates`, issue 38); here the same production code
runs in a background process per tested wheel, started when the session has collected a test
that starts a real smolvm, so the decode overlaps the tests before it; those wait for it through
:func:`real_templates`. So every contract test that starts a real smolvm also checks that
smolvm takes bottlenet's unpacked templates (and ``test_contract.py`` that it expands nothing
more). Without a decoder, or with templates already there, nothing is done and smolvm expands
them itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.vmctl.realclis import installs
from vmctl import templates

#: The unpack, as the daemon does it (``$1``: the wheel's ``smol`` directory).
_SCRIPT = "import sys; from vmctl.templates import unpack; unpack(sys.argv[1])"

#: The unpacks in flight or done, one process per wheel (two cores: they run side by side).
_running: list[subprocess.Popen[bytes]] | None = None


def start_expansion() -> None:
    """Start decoding every real smolvm's missing templates in the background (at most once;
    each tested version's wheel has its own, ``tests/vmctl/realclis.py``)."""
    global _running
    if _running is not None:
        return
    _running = []
    for install in installs().values():
        here = os.path.dirname(os.path.realpath(install.binary))
        if templates.unpackable(here):
            _running.append(
                subprocess.Popen(
                    [sys.executable, "-c", _SCRIPT, here],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,  # its own group: stop_expansion ends it
                )
            )


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
        for name in os.listdir(here):
            if name.startswith(".") and ".bottlenet-" in name and not name.endswith(".lock"):
                os.unlink(os.path.join(here, name))  # a killed unpack's private file


@pytest.fixture(scope="session")
def real_templates() -> Iterator[None]:
    """The real smolvm's disk templates are expanded (see the module docstring)."""
    wait_for_expansion()
    yield
