"""The daemon with the REAL smolvm wheel, each tested version, on a host that cannot boot.

No ``--smolvm`` and no smolvm on PATH: the daemon must find the ``smolmachines`` wheel and its
assets by itself (the venv's, or a ``--target`` prefix of another tested version on its
``PYTHONPATH``: ``tests/vmctl/realclis.py``), say so in Hello (``bottlenetctl status``), and a
socket-mode VM bottle create must fail with one typed error that names KVM and leave nothing
behind: no machine in ``machine ls --json``, no VMM process, no bottle. These hosts' KVM runs
only PVM guests (and a root daemon's VM process drops to its own uid), so ``machine start``
always fails here.

The daemon runs in a network namespace of its own with only ``lo`` (``unshare -n``): the real
smolvm dials public resolvers (IPv6, port 443) when it starts a machine with ``--net`` (the
sidecar), and no packet may leave the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from bottlenet.control.blocking import BlockingControlClient
from bottlenet.errors import KvmUnavailable
from tests.bottles.harness import spec_doc
from tests.control.daemon_helpers import REPO
from tests.fakes import UID_LEDGER
from tests.vmctl.realclis import prefix_of, real_install, versions
from tests.vmctl.test_contract import _vmm_processes, kvm_usable
from tests.vmctl.wheeltemplates import real_templates
from vmctl.install import SmolvmInstall, find_wheel
from vmctl.runner import build_env

__all__ = ["real_templates"]  # the fixture: the wheel's disk templates expanded once

TWIST = os.path.join(os.path.dirname(sys.executable), "twist")


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-n", "true"], check=False).returncode == 0


@versions
@pytest.mark.skipif(kvm_usable(), reason="this host says its KVM boots smolvm VMs")
@pytest.mark.usefixtures("real_templates")
@pytest.mark.skipif(not _can_unshare(), reason="needs root for a network namespace of its own")
def test_wheel_found_and_kvm_failure_leaves_nothing(version: str) -> None:
    """Issue 35's done-when, per version: found by itself, ``status`` says the version (tested),
    and the create fails with one typed error naming KVM (no rootfs noise: 1.37 reads
    SMOLVM_AGENT_ROOTFS as a directory only) leaving no machine, VMM, bottle or uid entry."""
    wheel = real_install(version)
    tmp = tempfile.mkdtemp(prefix="bnk-", dir="/tmp")
    state, control = os.path.join(tmp, "s"), os.path.join(tmp, "c.sock")
    env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8"}  # no smolvm on PATH
    daemon = _daemon(state, control, env, wheel)
    try:
        hello = _wait_hello(control, daemon)
        assert hello is not None and hello.smolvm_available
        assert hello.smolvm_version == version and hello.smolvm_tested is True
        assert hello.smolvm_source is not None and wheel.binary in hello.smolvm_source
        assert f"smolmachines {version} wheel" in hello.smolvm_source

        doc = spec_doc(tmp, egress=False)
        doc["sidecar"]["image"] = "alpine"  # a name with no registry host: no lookup at create
        with BlockingControlClient(control, timeout=300) as c:
            with pytest.raises(KvmUnavailable) as info:
                c.create_bottle("k1", spec=json.dumps(doc))
            message = str(info.value)
            assert info.value.code == "KVM_UNAVAILABLE"
            assert "KVM is not usable on this host" in message
            for noise in ("rootfs", "Usage", "KvmContext", "SMOLVM_FAILED"):
                assert noise not in message, message
            assert c.list_bottles().total == 0
        # nothing left: no machine in smolvm's own listing, no VMM process, no bottle dir
        smolvm_state = os.path.join(state, "smolvm")
        ls = subprocess.run(
            [wheel.binary, "machine", "ls", "--json", "--state-dir", smolvm_state],
            env=build_env(env, None, wheel.env()), capture_output=True, timeout=60, check=True,
        )  # fmt: skip
        assert json.loads(ls.stdout) == []
        assert _vmm_processes(smolvm_state) == []
        assert not os.path.exists(os.path.join(state, "bottles", "k1"))
        uids = os.path.join(smolvm_state, ".cache", "smolvm", "uids")
        held = [n for n in os.listdir(uids) if n.isdigit()] if os.path.isdir(uids) else []
        assert held == [], held  # no uid reservation left behind (trap 10)
    finally:
        _stop(daemon)
        shutil.rmtree(tmp, ignore_errors=True)


#: Tries, as another uid, to list the state dir, read each daemon file and connect to the
#: control socket; prints one word per attempt: ``ok`` or the errno name.
_PROBE = """
import errno, os, socket, sys
state, control = sys.argv[1], sys.argv[2]
def attempt(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
out = [attempt(lambda: os.listdir(state))]
for name in ("state.json", "state.journal", "daemon.lock"):
    out.append(attempt(lambda: open(os.path.join(state, name), "rb").close()))
out.append(attempt(lambda: socket.socket(socket.AF_UNIX).connect(control)))
print(" ".join(out))
"""


def _assert_unreachable_by_other_uids(state: str, control: str) -> None:
    """smolvm's first VMM uid and nobody (65534) can neither list the 0701 state dir nor read
    a daemon file in it nor talk to the control socket."""
    present = [n for n in ("state.json", "state.journal", "daemon.lock") if os.path.exists(
        os.path.join(state, n))]  # fmt: skip
    assert "state.json" in present and "daemon.lock" in present
    for uid in (2_000_000, 65534):
        probe = subprocess.run(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
             "/usr/bin/python3", "-c", _PROBE, state, control],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        words = probe.stdout.split()
        listing, files, connect = words[0], words[1:4], words[4]
        assert listing == "EACCES", (uid, words)
        for name, word in zip(("state.json", "state.journal", "daemon.lock"), files, strict=True):
            assert word == ("EACCES" if name in present else "ENOENT"), (uid, name, words)
        assert connect == "EACCES", (uid, words)


def _daemon(
    state: str, control: str, env: dict[str, str], wheel: SmolvmInstall | None = None
) -> subprocess.Popen[bytes]:
    """``twist bottlenet`` in a network namespace with only ``lo``, the wheel's smolvm (that of
    ``wheel``'s prefix, put first on the daemon's ``PYTHONPATH``, when given)."""
    path = REPO if wheel is None else os.pathsep.join([prefix_of(wheel), REPO])
    return subprocess.Popen(
        ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", TWIST, "bottlenet",
         "--state-dir", state, "--control", f"unix:{control}", "--uid-ledger", UID_LEDGER],
        env={**env, "PYTHONPATH": path}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip


def _wait_hello(control: str, daemon: subprocess.Popen[bytes] | None = None):  # type: ignore[no-untyped-def]
    """Hello once the daemon answers and has learnt smolvm's version (or None after 60 s)."""
    hello = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if daemon is not None and daemon.poll() is not None:
            err = daemon.stderr.read().decode() if daemon.stderr else ""
            raise AssertionError(f"daemon exited {daemon.returncode}: {err[-2000:]}")
        try:
            with BlockingControlClient(control, timeout=5) as c:
                hello = c.hello()
                if hello.smolvm_version is not None:
                    return hello
        except Exception:
            pass
        time.sleep(0.1)
    return hello


def _stop(daemon: subprocess.Popen[bytes]) -> None:
    if daemon.poll() is not None:
        return
    os.killpg(daemon.pid, signal.SIGTERM)
    try:
        daemon.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait()


@pytest.mark.skipif(
    find_wheel() is None, reason="the smolmachines wheel (bottlenet[vm]) is not installed"
)
@pytest.mark.skipif(kvm_usable(), reason="this host says its KVM boots smolvm VMs")
@pytest.mark.usefixtures("real_templates")
@pytest.mark.skipif(not _can_unshare(), reason="needs root for a network namespace of its own")
def test_root_daemon_restarts_on_its_state_dir_after_a_real_machine_start() -> None:
    """smolvm's start adds o+x to the state dir (per-VM uid traverse); the daemon still restarts."""
    tmp = tempfile.mkdtemp(prefix="bnr-", dir="/tmp")
    state, control = os.path.join(tmp, "s"), os.path.join(tmp, "c.sock")
    env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8"}
    daemon = _daemon(state, control, env)
    try:
        assert _wait_hello(control, daemon) is not None
        with BlockingControlClient(control, timeout=300) as c:
            kept = c.create_bottle("kept")
            doc = spec_doc(tmp, egress=False)
            doc["sidecar"]["image"] = "alpine"
            with pytest.raises(KvmUnavailable):
                c.create_bottle("k1", spec=json.dumps(doc))
            assert [b.name for b in c.list_bottles().items] == ["kept"]
        assert os.stat(state).st_mode & 0o7777 == 0o701  # what smolvm 1.32.2 does as root
        _assert_unreachable_by_other_uids(state, control)
        _stop(daemon)
        daemon = _daemon(state, control, env)
        hello = _wait_hello(control, daemon)
        assert hello is not None and hello.smolvm_available
        assert hello.vm_uids == "per-VM uids"  # a root daemon: smolvm drops each VMM's uid
        with BlockingControlClient(control, timeout=30) as c:
            c.ping()
            again = c.list_bottles().items
        assert [(b.name, b.alias) for b in again] == [("kept", kept.alias)]
    finally:
        _stop(daemon)
        shutil.rmtree(tmp, ignore_errors=True)


@versions
@pytest.mark.skipif(kvm_usable(), reason="this host says its KVM boots smolvm VMs")
@pytest.mark.usefixtures("real_templates")
@pytest.mark.skipif(not _can_unshare(), reason="needs root for a network namespace of its own")
def test_selftest_against_the_real_smolvm_fails_only_kvm(version: str) -> None:
    """``bottlenetctl selftest`` with each real smolvm where KVM cannot boot: the one FAIL is
    ``kvm`` with the fix, the teardown line PASSes, and smolvm lists no machine after."""
    wheel = real_install(version)
    tmp = tempfile.mkdtemp(prefix="bnk-", dir="/tmp")
    state, control = os.path.join(tmp, "s"), os.path.join(tmp, "c.sock")
    env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8"}  # no smolvm on PATH
    image = os.path.join(tmp, "agent.tar")
    with open(image, "wb") as f:
        f.write(b"\0" * 1024)
    daemon = _daemon(state, control, env, wheel)
    try:
        assert _wait_hello(control, daemon) is not None
        r = subprocess.run(
            [sys.executable, "-m", "bottlenet.cli", "--control", control, "--json", "selftest",
             "--agent-image", image, "--sidecar-image", "alpine"],
            env={**env, "PYTHONPATH": REPO}, capture_output=True, timeout=600,
        )  # fmt: skip
        report = json.loads(r.stdout)
        failed = [c for c in report["checks"] if c["verdict"] == "FAIL"]
        assert r.returncode == 1 and [c["step"] for c in failed] == ["kvm"], report
        assert failed[0]["seen"].startswith("KVM_UNAVAILABLE: ") and failed[0]["fix"]
        verdicts = {c["step"]: c["verdict"] for c in report["checks"]}
        assert verdicts["smolvm"] == verdicts["teardown"] == "PASS", report
        ls = subprocess.run(
            [wheel.binary, "machine", "ls", "--json", "--state-dir", os.path.join(state, "smolvm")],
            env=build_env(env, None, wheel.env()), capture_output=True, timeout=60, check=True,
        )  # fmt: skip
        assert json.loads(ls.stdout) == []
    finally:
        _stop(daemon)
        shutil.rmtree(tmp, ignore_errors=True)
