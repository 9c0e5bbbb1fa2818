"""The daemon with the REAL smolvm of the ``bottlenet[vm]`` extra, on a host that cannot boot.

No ``--smolvm`` and no smolvm on PATH: the daemon must find the ``smolmachines`` wheel and its
assets by itself, say so in Hello (``bottlenetctl status``), and a socket-mode VM bottle create
must fail with one typed error that names KVM and leave nothing behind: no machine in
``machine ls --json``, no VMM process, no bottle. These hosts' KVM runs only PVM guests (and a
root daemon's VM process drops to its own uid), so ``machine start`` always fails here.
"""

from __future__ import annotations

import json
import os
import subprocess

from twisted.internet import reactor
from twisted.trial.unittest import SkipTest

from bottlenet.bottles.recovery import RecoveryService
from bottlenet.control.client import connect_control
from bottlenet.errors import KvmUnavailable
from bottlenet.tap import Options, build_service
from tests.bottles.harness import DaemonCase, sleep, spec_doc
from tests.vmctl.test_contract import _vmm_processes, kvm_usable
from vmctl.install import find_wheel
from vmctl.runner import build_env


class RealSmolvmTests(DaemonCase):
    timeout = 300  # the first real start unpacks the bundled agent rootfs (tens of seconds)

    async def test_wheel_found_and_kvm_failure_leaves_nothing(self) -> None:
        wheel = find_wheel()
        if wheel is None:
            raise SkipTest("the smolmachines wheel (bottlenet[vm]) is not installed")
        if kvm_usable():
            raise SkipTest("this host says its KVM boots smolvm VMs")
        saved = os.environ.get("PATH")
        os.environ["PATH"] = "/usr/bin:/bin"  # no smolvm there: the wheel's must be found
        self.addCleanup(os.environ.__setitem__, "PATH", saved or "")
        options = Options()
        options.parseOptions(["--state-dir", self.state_dir, "--control", f"unix:{self.control}"])
        root = build_service(options, reactor)
        root.startService()
        self.root = root
        self.addCleanup(self.stop)
        recovery = next(s for s in root if isinstance(s, RecoveryService))
        for _ in range(1500):
            if recovery.ready.called and os.path.exists(self.control):
                break
            await sleep(0.02)
        client = await connect_control(reactor, self.control, timeout=30)
        self.clients.append(client)
        for _ in range(500):  # the version/feature run at start is asynchronous
            hello = await client.hello()
            if hello.smolvm_version is not None:
                break
            await sleep(0.02)
        self.assertTrue(hello.smolvm_available)
        assert hello.smolvm_version is not None and hello.smolvm_source is not None
        self.assertTrue(hello.smolvm_version.startswith("1.32."), hello.smolvm_version)
        self.assertIn(wheel.binary, hello.smolvm_source)
        self.assertIn("smolmachines", hello.smolvm_source)

        doc = spec_doc(self.tmp, egress=False)
        doc["sidecar"]["image"] = "alpine"  # a name with no registry host: no lookup at create
        with self.assertRaises(KvmUnavailable) as cm:
            await client.create_bottle("k1", spec=json.dumps(doc))
        message = str(cm.exception)
        self.assertIn("KVM is not usable on this host", message)
        for noise in ("rootfs", "Usage", "KvmContext", "SMOLVM_FAILED"):
            self.assertNotIn(noise, message)
        self.assertEqual(cm.exception.code, "KVM_UNAVAILABLE")
        # nothing left: no bottle, no machine in smolvm's own listing, no VMM process
        self.assertEqual((await client.list_bottles()).total, 0)
        smolvm_state = os.path.join(self.state_dir, "smolvm")
        ls = subprocess.run(
            [wheel.binary, "machine", "ls", "--json", "--state-dir", smolvm_state],
            env=build_env({"PATH": "/usr/bin:/bin", "HOME": self.tmp}, None, wheel.env()),
            capture_output=True,
            timeout=60,
            check=True,
        )
        self.assertEqual(json.loads(ls.stdout), [])
        self.assertEqual(_vmm_processes(smolvm_state), [])
        self.assertFalse(os.path.exists(os.path.join(self.state_dir, "bottles", "k1")))
        self.assertEqual(self.state_file()["bottles"], {})
