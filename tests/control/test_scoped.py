"""Scoped control peers (``--allow-uid UID:scoped``, issue 28): a real second uid (``setpriv``,
the system ``python3`` with this project on its path) runs ``bottlenetctl`` against the
daemon's real service tree (in process, fake smolvm test double): the process-level proof
that the kernel's peer credentials make a uid scoped, and what ``bottlenetctl`` prints. The
scope's rules (every command, events, a restart) are checked in process in
``test_scoped_rules.py``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig

from twisted.internet.defer import Deferred

from tests.bottles.harness import DaemonCase, in_thread

SYSTEM_PYTHON = "/usr/bin/python3"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALICE = 4243


def _env() -> dict[str, str]:
    site = sysconfig.get_paths()["purelib"]
    return {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8",
            "PYTHONPATH": f"{site}:{REPO}"}  # fmt: skip


def _argv(uid: int, control: str, *args: str) -> list[str]:
    return [
        "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
        SYSTEM_PYTHON, "-m", "bottlenet.cli", "--control", control, *args,
    ]  # fmt: skip


class ScopedPeerTests(DaemonCase):
    def setUp(self) -> None:
        super().setUp()
        if os.geteuid() != 0 or shutil.which("setpriv") is None:
            self.skipTest("needs root and setpriv to be a second uid")
        probe = subprocess.run(
            _argv(ALICE, "/nonexistent", "--version"), env=_env(), capture_output=True, cwd="/"
        )
        if probe.returncode != 0:
            self.skipTest("the system python3 cannot run bottlenetctl as another uid")

    def as_uid(self, uid: int, *args: str) -> Deferred[subprocess.CompletedProcess[bytes]]:
        """``bottlenetctl ARGS`` run by ``uid`` (off the reactor thread)."""
        argv = _argv(uid, self.control, *args)
        return in_thread(
            lambda: subprocess.run(argv, env=_env(), capture_output=True, cwd="/", timeout=120)
        )

    async def test_a_real_second_uid_is_scoped_by_its_peer_credentials(self) -> None:
        """The kernel's word on the peer's uid makes it scoped: it creates and lists its own
        bottle only; another's name is ``error: NOT_FOUND:`` and drain is
        ``error: PERMISSION_DENIED:`` (exit 1). The rules in full: ``test_scoped_rules.py``."""
        client = await self.start("--allow-uid", f"{ALICE}:scoped", vm_bottles=False)
        os.chmod(self.control, 0o666)  # as a systemd socket's group would let them reach it
        await client.create_bottle("r1")  # the daemon's own uid: full control
        r = await self.as_uid(ALICE, "bottle", "create", "a1", "--owner", "alice-actor")
        self.assertEqual(r.returncode, 0, r.stderr)
        r = await self.as_uid(ALICE, "--json", "bottle", "ls")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(b'"a1"', r.stdout)
        self.assertNotIn(b'"r1"', r.stdout)
        r = await self.as_uid(ALICE, "bottle", "rm", "r1")
        self.assertEqual(r.returncode, 1, (r.stdout, r.stderr))
        self.assertIn(b"error: NOT_FOUND:", r.stderr)
        r = await self.as_uid(ALICE, "node", "drain")
        self.assertEqual(r.returncode, 1)
        self.assertIn(b"error: PERMISSION_DENIED:", r.stderr)
        names = sorted(b.name for b in await client.all_bottles())
        self.assertEqual(names, ["a1", "r1"])
