"""smolvm 1.37 next to 1.32 (issue 35), against the fake's version knob (no real boot here).

What the real binaries show without a boot is pinned in ``test_contract.py`` per version; here:
an untested version is warned once and marked, the rootfs tarball must not go back into
``SMOLVM_AGENT_ROOTFS`` (1.37 refuses it), and the agent's admission refusals become BUSY
naming the bottle and the limit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from typing import Any

import pytest
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.logger import LogEvent, globalLogPublisher
from twisted.trial.unittest import TestCase

from bottlenet.bottles.vmerrors import map_vmctl
from bottlenet.errors import Busy
from tests.fakes import FAKE_SMOLVM, FakeSmolvmMixin
from vmctl.errors import AGENT_LIMITS, AgentBusy, classify
from vmctl.install import discover
from vmctl.runner import ProcessRunner, build_env
from vmctl.smolvm import Smolvm, SmolvmVersion, untested_note
from vmctl.spec import MachineSpec

LABELS = {"owner": "bottlenet-test"}


@pytest.mark.parametrize("phrase", sorted(AGENT_LIMITS))
def test_agent_admission_refusals_are_busy_naming_bottle_and_limit(phrase: str) -> None:
    """Each 1.37 agent refusal (its strings) is AgentBusy, and BUSY naming the bottle and the
    limit on the wire (never the guest's words: the limit comes from vmctl's table)."""
    stderr = json.dumps({"error": {"code": "SMOLVM_ERROR", "message": f"agent: {phrase}"}})
    err = classify(stderr.encode(), 1, "machine exec")
    assert isinstance(err, AgentBusy) and err.limit == AGENT_LIMITS[phrase]
    mapped = map_vmctl(err, "b7")
    assert isinstance(mapped, Busy) and mapped.code == "BUSY"
    assert "bottle b7" in mapped.message and AGENT_LIMITS[phrase] in mapped.message


def test_versions_tested_and_not() -> None:
    """1.32.2 and 1.37.3 are tested; 1.38.0 and a suffixed build are not, and the note names
    the tested ones and the extra's pin."""
    for text, tested in (("1.32.2", True), ("1.37.3", True), ("1.38.0", False),
                         ("1.37.3-rc1", False), ("1.37.2", False)):  # fmt: skip
        assert SmolvmVersion.parse(f"smolvm {text}".encode()).tested is tested, text
    note = untested_note(SmolvmVersion(1, 38, 0))
    assert "1.32.2, 1.37.3" in note and "<1.38" in note


def fake_install(top: str, version: str) -> str:
    """A wheel-shaped install of the fake at ``version``: its launcher copied, the module
    linked, libkrun stand-ins and an agent rootfs tarball beside it. Returns the binary."""
    here = os.path.join(top, "smol")
    os.makedirs(here, mode=0o755)
    binary = os.path.join(here, "smolvm")
    shutil.copy(FAKE_SMOLVM, binary)
    os.symlink(
        os.path.join(os.path.dirname(FAKE_SMOLVM), "smolvm_impl.py"),
        os.path.join(here, "smolvm_impl.py"),
    )
    for name in ("libkrun.so", "libkrunfw.so.5", "agent-rootfs.tar.zst"):
        with open(os.path.join(here, name), "wb") as f:
            f.write(b"\0" * 64)
    return binary


@pytest.mark.parametrize("version", ["1.32.2", "1.37.3"])
def test_the_tarball_back_in_smolvm_agent_rootfs_fails_on_137(
    tmp_path: os.PathLike[str], version: str
) -> None:
    """vmctl passes the fake's tarball in SMOLVM_AGENT_ROOTFS_TAR and the start works on both
    models; put back in SMOLVM_AGENT_ROOTFS it fails 1.37's start with ``Not a directory``
    (1.32 took it), as the real 1.37.3 does."""
    top = tempfile.mkdtemp(prefix="bn-v-")
    try:
        binary = fake_install(top, version)
        install = discover(binary, None, lambda: None)
        assert install is not None and install.rootfs_var == "SMOLVM_AGENT_ROOTFS_TAR"
        data = os.path.join(top, "d")
        env = build_env({"PATH": "/usr/bin:/bin", "HOME": top}, data, install.env())
        env_back = {k: v for k, v in env.items() if k != "SMOLVM_AGENT_ROOTFS_TAR"}
        env_back["SMOLVM_AGENT_ROOTFS"] = env["SMOLVM_AGENT_ROOTFS_TAR"]
        os.makedirs(data)
        with open(os.path.join(data, "fake-faults.json"), "w") as f:
            json.dump({"version": version, "fail": []}, f)

        def run(*args: str, e: dict[str, str] = env) -> subprocess.CompletedProcess[bytes]:
            return subprocess.run([binary, "machine", *args], env=e, capture_output=True,
                                  timeout=60)  # fmt: skip

        assert run("create", "--name", "m1").returncode == 0
        back = run("start", "--name", "m1", e=env_back)
        if version == "1.37.3":
            assert back.returncode == 1 and b"read agent rootfs: Not a directory" in back.stderr
        else:
            assert back.returncode == 0, back.stderr
            assert run("stop", "--name", "m1").returncode == 0
        ok = run("start", "--name", "m1")
        assert ok.returncode == 0, ok.stderr
        assert run("delete", "--name", "m1", "-f").returncode == 0
    finally:
        from tests.fakes import FakeSmolvm

        FakeSmolvm(os.path.join(top, "d")).cleanup()
        shutil.rmtree(top, ignore_errors=True)


class FakeVersions(FakeSmolvmMixin, TestCase):
    """vmctl over the fake, real reactor."""

    timeout = 60

    def setUp(self) -> None:
        self.setUpFake()
        self.warned: list[str] = []

        def observe(event: LogEvent) -> None:
            if event.get("log_level") is not None and event["log_level"].name == "warn":
                self.warned.append((event.get("log_format") or "").format(**event))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)

    def smolvm(self, **faults: Any) -> Smolvm:
        self.fake.set_faults(**faults)
        runner = ProcessRunner(reactor, grace=1.0)
        return Smolvm(runner, FAKE_SMOLVM, self.fake.path, environ=self.fake.environ())

    def test_an_untested_version_is_warned_once_and_marked(self) -> Deferred[None]:
        """A fake reporting 1.38.0: one warning line naming the tested versions, however
        often the version is asked; ``describe`` (the start log, ``status``) says untested."""
        smolvm = self.smolvm(version="1.38.0")

        async def go() -> None:
            for _ in range(3):
                assert str(await smolvm.version()) == "1.38.0"
            notes = [w for w in self.warned if "untested" in w]
            assert len(notes) == 1 and "1.32.2, 1.37.3" in notes[0], self.warned
            assert "smolvm 1.38.0 (untested)" in smolvm.describe()

        return Deferred.fromCoroutine(go())

    def test_a_tested_version_is_not_warned(self) -> Deferred[None]:
        smolvm = self.smolvm(version="1.37.3")

        async def go() -> None:
            await smolvm.version()
            assert not [w for w in self.warned if "untested" in w]
            assert "untested" not in smolvm.describe()

        return Deferred.fromCoroutine(go())

    def test_137_refuses_an_exec_past_the_agent_limit(self) -> Deferred[None]:
        """1.37's agent refuses an exec past its limit at once (1.32's queues it): AgentBusy,
        the limit named; the held one still runs."""
        smolvm = self.smolvm(version="1.37.3", agent_connections=1)

        async def go() -> None:
            await smolvm.create(MachineSpec("m1", labels=LABELS))
            await smolvm.start("m1")
            held = smolvm.exec("m1", ["sleep", "3"])
            await _until_slot_taken(self.fake.vm_dir("m1"))
            with self.assertRaises(AgentBusy) as info:
                await smolvm.exec("m1", ["true"])
            assert info.exception.limit == AGENT_LIMITS["exec was not admitted"]
            assert (await held).exit_code == 0
            await smolvm.remove("m1")

        return Deferred.fromCoroutine(go())


async def _until_slot_taken(vm_dir: str) -> None:
    """Until the fake's one agent connection is held (its flock taken)."""
    import fcntl

    from twisted.internet.task import deferLater

    path = os.path.join(vm_dir, "agent-connections", "0")
    for _ in range(1500):
        if os.path.exists(path):
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            finally:
                os.close(fd)
        await deferLater(reactor, 0.02, lambda: None)
    raise AssertionError("the exec never took the agent's connection")
