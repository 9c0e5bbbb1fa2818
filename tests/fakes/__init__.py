"""Helpers for the fake smolvm (``tests/fakes/smolvm``), a TEST DOUBLE of the smolvm CLI.

``FakeSmolvm(path)`` gives a state directory for one test, fault injection through
``fake-faults.json`` (which reaches the fake even through vmctl's environment scrubbing),
the recorded calls, and ``cleanup()`` which kills every process the fake ever started there
and reports any survivor. Use ``FakeSmolvmMixin`` in trial TestCases, or the ``fake_smolvm``
pytest fixture (``tests/vmctl/conftest.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterable, Mapping
from typing import Any

from vmctl.uidranges import Ledger

FAKE_SMOLVM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smolvm")
#: A PATH that finds a plain python3 quickly (the fake's shebang is /usr/bin/env python3).
FAST_PATH = "/usr/bin:/bin"
#: Per-VM uids (as root): the host-wide uid ledger every daemon of the test suite shares
#: (``--uid-ledger``), so two tests, or two suites, running at once never give their VMs the
#: same uid (each data dir claims blocks of its own, vmctl.uidranges), and no test touches
#: the host's own ledger. The fake's registry itself starts at 2000000, as smolvm's does.
UID_LEDGER = "/tmp/bottlenet-test-uid-ranges"
#: The version every fake of this test run plays unless a test names one (``set_faults``'
#: ``version``): ``BOTTLENET_FAKE_SMOLVM=1.37.3`` runs the suite's VM tests against the fake's
#: 1.37 model (``.ci/run`` does, for the VM tiers), else the fake's own default (1.32.2).
PLAYED_VERSION = os.environ.get("BOTTLENET_FAKE_SMOLVM") or None
#: The version the fakes of this run report: ``PLAYED_VERSION``, else the fake's own default.
PLAYED = PLAYED_VERSION or "1.32.2"
#: Whether they play 1.37's model (``tests/fakes/smolvm_impl.py`` ``V137``).
PLAYS_137 = tuple(int(x) for x in PLAYED.split("-")[0].split(".")[:2]) >= (1, 37)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()
    except OSError:
        return None


def process_alive(pid: int, started: str | None = None) -> bool:
    """True for a live, non-zombie process (with the given start time, when known)."""
    fields = _stat_fields(pid)
    if fields is None:
        if not os.path.exists("/proc/self/stat"):  # not Linux
            try:
                os.kill(pid, 0)
            except OSError:
                return False
            return True
        return False
    if fields[0] in ("Z", "X"):
        return False
    return started in (None, "?") or fields[19] == started


class FakeSmolvm:
    """One fake-smolvm state directory (``SMOLVM_DATA_DIR``)."""

    binary = FAKE_SMOLVM

    #: The uid ledger the daemons over this fake use (``--uid-ledger``).
    uid_ledger = UID_LEDGER

    def __init__(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        self.path = os.path.abspath(path)
        if PLAYED_VERSION is not None:
            self.set_faults()

    def environ(self, **extra: str) -> dict[str, str]:
        """A small source environment for vmctl (it is scrubbed again by vmctl)."""
        env = {"PATH": FAST_PATH, "HOME": self.path, "LANG": "C.UTF-8"}
        env.update(extra)
        return env

    def set_faults(self, *fail: str, **settings: Any) -> None:
        """Write ``fake-faults.json``: ``fail`` names plus settings such as port_clash=1."""
        data = dict(settings)
        data["fail"] = list(fail)
        if PLAYED_VERSION is not None:
            data.setdefault("version", PLAYED_VERSION)
        with open(os.path.join(self.path, "fake-faults.json"), "w") as fh:
            json.dump(data, fh)

    def set_images(self, images: Mapping[str, Mapping[str, object]]) -> None:
        """Write ``fake-images.json``: an image's path -> its config (``user``, ``bare``,
        ``entrypoint``; ``{}``: no image has one)."""
        with open(os.path.join(self.path, "fake-images.json"), "w") as fh:
            json.dump(images, fh)

    def calls(self) -> list[dict[str, Any]]:
        """Every recorded call: ``argv`` (after the program name), ``env``, ``env_keys``."""
        try:
            with open(os.path.join(self.path, "calls.jsonl")) as fh:
                return [json.loads(line) for line in fh if line.strip()]
        except FileNotFoundError:
            return []

    def argvs(self) -> list[list[str]]:
        return [c["argv"] for c in self.calls()]

    def vm_dir(self, machine: str) -> str:
        """The fake's VM dir of ``machine`` (what its ``machine data-dir`` prints)."""
        digest = hashlib.sha256(machine.encode()).hexdigest()[:16]
        return os.path.join(self.path, ".cache", "smolvm", "vms", digest)

    def state(self) -> dict[str, Any]:
        try:
            with open(os.path.join(self.path, "fake-state.json")) as fh:
                data: dict[str, Any] = json.load(fh)
                return data
        except FileNotFoundError:
            return {"machines": {}}

    def spawned(self) -> list[tuple[int, str, str]]:
        """(pid, start time, kind) of every process the fake started in this directory."""
        try:
            with open(os.path.join(self.path, "fake-pids.txt")) as fh:
                rows = [line.split() for line in fh if line.strip()]
        except FileNotFoundError:
            return []
        return [(int(r[0]), r[1], r[2]) for r in rows if len(r) == 3]

    def live_pids(self) -> list[int]:
        return [pid for pid, started, _ in self.spawned() if process_alive(pid, started)]

    def cleanup(self, grace: float = 1.0) -> list[int]:
        """Kill every process the fake started here; return those that survived (none)."""
        targets = [(p, s) for p, s, _ in self.spawned() if process_alive(p, s)]
        _signal_all(targets, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(process_alive(p, s) for p, s in targets) and time.monotonic() < deadline:
            time.sleep(0.02)
        _signal_all([(p, s) for p, s in targets if process_alive(p, s)], signal.SIGKILL)
        deadline = time.monotonic() + 3
        while any(process_alive(p, s) for p, s in targets) and time.monotonic() < deadline:
            time.sleep(0.02)
        survivors = [p for p, s in targets if process_alive(p, s)]
        if not survivors and os.geteuid() == 0 and os.path.isdir(self.uid_ledger):
            # Its VMs are gone: its uid blocks go back to the suite's ledger at once.
            Ledger(self.uid_ledger).release(os.path.join(self.path, ".cache", "smolvm", "uids"))
        return survivors


def _signal_all(targets: Iterable[tuple[int, str]], sig: int) -> None:
    for pid, _ in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class FakeSmolvmMixin:
    """For trial TestCases: ``self.fake`` is a fresh FakeSmolvm, cleaned (and checked) after."""

    fake: FakeSmolvm

    def setUpFake(self) -> FakeSmolvm:
        self.fake = FakeSmolvm(tempfile.mkdtemp(prefix="fake-smolvm-"))
        self.addCleanup(self._checkNoSurvivors)  # type: ignore[attr-defined]
        return self.fake

    def _checkNoSurvivors(self) -> None:
        survivors = self.fake.cleanup()
        shutil.rmtree(self.fake.path, ignore_errors=True)
        assert not survivors, f"fake smolvm processes survived cleanup: {survivors}"
