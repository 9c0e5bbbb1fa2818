"""Issue 19: the same daemon as a plain user (the systemd unit's ``User=bottlenet``).

smolvm started by a non-root user cannot drop privileges: every VMM runs as the daemon's uid
(``one uid``). The daemon runs here as uid 4242 (``setpriv``, the system ``python3`` with this
interpreter's site-packages) against the fake smolvm; the test, as root, talks to it with
``--allow-uid 0``. Without root to make namespaces the launch gate is skipped
(``--unsafe-skip-isolation-probe``); ``test_vm_e2e.py`` covers the gate.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator

import pytest

from bottlenet.bottles.store import JOURNAL_FILE, STATE_FILE
from bottlenet.control.blocking import BlockingControlClient
from bottlenet.paths import LOCK_NAME
from tests.bottles.harness import spec_doc
from tests.bottles.test_vm_e2e import _as_uid, _echo_as
from tests.control.daemon_helpers import stop, wait_ready
from tests.fakes import FAKE_SMOLVM, FakeSmolvm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The daemon's user: no VMM uid drop, one uid for every VMM.
DAEMON_UID = 4242
SYSTEM_PYTHON = "/usr/bin/python3"


def _daemon_env(home: str) -> dict[str, str]:
    site = sysconfig.get_paths()["purelib"]
    return {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8",
            "PYTHONPATH": f"{site}:{REPO}"}  # fmt: skip


def _as_daemon_user(*argv: str) -> list[str]:
    uid = str(DAEMON_UID)
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]


def _runnable(home: str) -> bool:
    """The system python runs this project's daemon as the plain uid (same minor version)."""
    if not os.path.exists(SYSTEM_PYTHON) or shutil.which("setpriv") is None:
        return False
    probe = subprocess.run(
        _as_daemon_user(SYSTEM_PYTHON, "-c", "import sys, twisted, bottlenet.tap; "
                        "print(sys.version_info[:2])"),
        env=_daemon_env(home), capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    return probe.returncode == 0 and probe.stdout.strip() == str(sys.version_info[:2])


@pytest.fixture
def tmp() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="bnn-", dir="/tmp")
    try:
        yield path
    finally:
        FakeSmolvm(os.path.join(path, "f")).cleanup()
        shutil.rmtree(path, ignore_errors=True)


def _chown_tree(path: str, uid: int) -> None:
    os.chown(path, uid, uid)
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            os.lchown(os.path.join(root, name), uid, uid)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start the daemon as another uid")
def test_plain_user_daemon_carries_bytes_and_keeps_other_uids_out(tmp: str) -> None:
    """As uid 4242: ``status`` says ``one uid``, bytes flow through the agent endpoints to the
    sidecar for the VMMs' uid (the daemon's), and uid 65534 reaches none of the bottle's
    sockets nor reads the state file."""
    if not _runnable(tmp):
        pytest.skip("the system python3 cannot run this interpreter's site-packages")
    state, control, data = (os.path.join(tmp, n) for n in ("s", "c.sock", "f"))
    os.mkdir(data)
    with open(os.path.join(data, "fake-faults.json"), "w") as fh:
        json.dump({"fail": ["uid-drop"]}, fh)  # asked for, but no root: no drop (as smolvm)
    spec = json.dumps(spec_doc(tmp))
    _chown_tree(tmp, DAEMON_UID)
    daemon = subprocess.Popen(
        _as_daemon_user(SYSTEM_PYTHON, "-m", "twisted", "bottlenet", "--state-dir", state,
                        "--control", f"unix:{control}", "--allow-uid", "0", "--smolvm",
                        FAKE_SMOLVM, "--smolvm-data-dir", data,
                        "--unsafe-skip-isolation-probe"),
        env=_daemon_env(tmp), cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_ready(control, daemon)
        with BlockingControlClient(control, timeout=60) as c:
            assert c.hello().vm_uids == "one uid"
            b = c.create_bottle("n1", spec=spec)
            endpoints = [e.host_path for e in b.endpoints if e.host_path]
            assert len(endpoints) == 2
            bdir = os.path.join(state, "bottles", "n1")
            sidecar = sorted(os.path.join(bdir, "sidecar", n) for n in os.listdir(
                os.path.join(bdir, "sidecar")))  # fmt: skip
            assert len(sidecar) == 2
            # the VMMs run as the daemon's user: bytes both ways for that uid
            assert _echo_as(DAEMON_UID, endpoints) == endpoints
            for path in (bdir, state, os.path.dirname(sidecar[0]), *endpoints):
                st = os.stat(path)
                assert st.st_uid == DAEMON_UID and st.st_mode & 0o077 == 0, path
            assert {os.lstat(p).st_uid for p in sidecar} == {DAEMON_UID}
            assert not os.path.exists(os.path.join(data, ".cache", "smolvm", "uids"))
            # nobody else (one process as uid 65534 for both kinds of try)
            files = [os.path.join(state, n) for n in (STATE_FILE, JOURNAL_FILE, LOCK_NAME)]
            assert all(os.path.exists(f) for f in files)
            reached = _as_uid(65534, ("echo", endpoints + sidecar + [control]), ("read", files))
            assert reached == [[], []]
            c.destroy_bottle("n1")
        assert not os.path.exists(bdir)
    finally:
        stop(daemon)
