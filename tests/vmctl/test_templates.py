"""smolvm's disk templates unpacked by the daemon at start (issue 38 item 2, vmctl.templates).

The unpack itself runs on small templates made here (the real ones: ``wheeltemplates.py``,
whose unpack is this code and whose tests then start the real smolvm on the result). The
daemon side runs against a fresh "install" of the fake smolvm (a copy of its launcher with
templates beside it): the fake expands templates it finds unexpanded at ``machine start``, as
smolvm does, and logs each one, so a test sees whether the first start had to.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import threading

import pytest
import zstandard
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.logger import LogEvent, globalLogPublisher
from twisted.trial.unittest import TestCase

from tests.fakes import FAKE_SMOLVM, FakeSmolvmMixin
from vmctl import templates
from vmctl.runner import ProcessRunner
from vmctl.service import VmctlService
from vmctl.smolvm import Smolvm
from vmctl.spec import MachineSpec

#: Each template: 3 MiB of zeros, a marker, 2 MiB of zeros (a hole each side).
BODY = bytes(3 << 20) + b"ext4 superblock here" + bytes(2 << 20)


def make_install(top: str) -> str:
    """A fresh wheel-shaped install of the fake: its launcher copied (the module linked) and
    compressed templates beside it, none expanded. Returns the directory."""
    here = os.path.join(top, "smol")
    os.makedirs(here, mode=0o755)
    shutil.copy(FAKE_SMOLVM, os.path.join(here, "smolvm"))
    impl = os.path.join(os.path.dirname(FAKE_SMOLVM), "smolvm_impl.py")
    os.symlink(impl, os.path.join(here, "smolvm_impl.py"))
    for name in templates.TEMPLATES:
        with open(os.path.join(here, name + ".zst"), "wb") as f:
            f.write(zstandard.ZstdCompressor().compress(BODY))
    return here


def test_unpack_is_exact_sparse_and_once(tmp_path: os.PathLike[str]) -> None:
    """Each template decodes to its bytes, its zero runs holes; a second unpack (another
    daemon of the install) finds nothing to do; no private file is left."""
    here = make_install(str(tmp_path))
    assert templates.missing(here) == list(templates.TEMPLATES)
    assert templates.unpack(here) == list(templates.TEMPLATES)
    for name in templates.TEMPLATES:
        path = os.path.join(here, name)
        with open(path, "rb") as f:
            assert f.read() == BODY
        assert os.stat(path).st_blocks * 512 < 2 << 20  # holes: 1 MiB written, not 5
    assert templates.missing(here) == [] and templates.unpack(here) == []
    assert not [n for n in os.listdir(here) if ".bottlenet-" in n and not n.endswith(".lock")]


def test_two_unpacks_at_once_take_turns(tmp_path: os.PathLike[str]) -> None:
    """Two first starts at once raced on smolvm's one ``.partial`` name: two unpacks at once
    take the lock in turn, each template is decoded once, and both end with it in place."""
    here = make_install(str(tmp_path))
    results: list[list[str]] = []
    threads = [
        threading.Thread(target=lambda: results.append(templates.unpack(here))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(n for r in results for n in r) == sorted(templates.TEMPLATES)
    assert templates.missing(here) == []


def test_a_stopped_unpack_leaves_nothing(tmp_path: os.PathLike[str]) -> None:
    """The daemon stops mid-unpack: Stopped, no template half-written, none in place."""
    here = make_install(str(tmp_path))
    stop = threading.Event()
    stop.set()
    with pytest.raises(templates.Stopped):
        templates.unpack(here, stop)
    assert templates.missing(here) == list(templates.TEMPLATES)
    assert [n for n in os.listdir(here) if not n.endswith((".zst", ".lock", ".py"))] == ["smolvm"]


class DaemonUnpacksTemplates(FakeSmolvmMixin, TestCase):
    """A daemon's vmctl service (real reactor) over a fresh install of the fake."""

    timeout = 60

    def setUp(self) -> None:
        self.setUpFake()
        self.top = tempfile.mkdtemp(prefix="bn-tpl-")
        self.addCleanup(shutil.rmtree, self.top, True)
        self.here = make_install(self.top)
        runner = ProcessRunner(reactor, grace=1.0)
        self.smolvm = Smolvm(
            runner,
            os.path.join(self.here, "smolvm"),
            self.fake.path,
            environ=self.fake.environ(),
        )
        self.service = VmctlService(runner, smolvm=self.smolvm)
        self.logged: list[str] = []

        def observe(event: LogEvent) -> None:
            fmt = event.get("log_format") or ""
            if "templates" in fmt:
                self.logged.append(fmt.format(**event))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)

    def expanded_by_smolvm(self) -> list[str]:
        try:
            with open(os.path.join(self.fake.path, "templates-expanded.log")) as f:
                return f.read().split()
        except FileNotFoundError:
            return []

    async def _start_vm(self) -> None:
        await self.smolvm.create(MachineSpec("t1", labels={"owner": "bottlenet-test"}))
        await self.smolvm.start("t1")
        await self.smolvm.remove("t1")

    def test_the_first_create_after_a_fresh_install_unpacks_nothing(self) -> Deferred[None]:
        """Started, the service unpacks the templates in the background; the first start then
        finds them, and smolvm (the fake) expands none."""
        self.service.startService()
        self.addCleanup(self.service.stopService)
        pending = self.smolvm.unpack_templates()
        assert pending is not None

        async def go() -> None:
            await pending
            assert templates.missing(self.here) == []
            await self._start_vm()
            assert self.expanded_by_smolvm() == []
            assert any("are ready" in line for line in self.logged), self.logged

        return Deferred.fromCoroutine(go())

    def test_a_start_that_comes_first_waits_and_says_so(self) -> Deferred[None]:
        """The unpack is held up (another daemon holds the lock): the start waits, its log
        says why, and once the unpack is done it goes on and smolvm expands nothing."""
        lock = os.open(os.path.join(self.here, templates.LOCK_NAME), os.O_RDWR | os.O_CREAT)
        fcntl.flock(lock, fcntl.LOCK_EX)
        self.service.startService()
        self.addCleanup(self.service.stopService)
        held = [lock]
        self.addCleanup(lambda: [os.close(fd) for fd in held])

        async def go() -> None:
            started = Deferred.fromCoroutine(self._start_vm())
            await Deferred.fromCoroutine(_until(lambda: any("waits" in x for x in self.logged)))
            assert not started.called
            assert self.expanded_by_smolvm() == []
            os.close(held.pop())  # the other daemon is done
            await started
            assert self.expanded_by_smolvm() == []
            assert templates.missing(self.here) == []

        return Deferred.fromCoroutine(go())

    def test_without_the_unpack_smolvm_expands_them_itself(self) -> Deferred[None]:
        """The control: no service started, the fake's first start expands both (so the
        tests above can fail)."""
        return Deferred.fromCoroutine(self._control())

    async def _control(self) -> None:
        await self._start_vm()
        assert sorted(self.expanded_by_smolvm()) == sorted(templates.TEMPLATES)


async def _until(condition: object, timeout: float = 30.0) -> None:
    """Wait (on the reactor) until ``condition()`` holds."""
    from twisted.internet.task import deferLater

    waited = 0.0
    while not condition():  # type: ignore[operator]
        if waited > timeout:
            raise AssertionError("condition never held")
        await deferLater(reactor, 0.02, lambda: None)
        waited += 0.02
