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


def _env(**extra: str) -> dict[str, str]:
    site = sysconfig.get_paths()["purelib"]
    return {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8",
            "PYTHONPATH": f"{site}:{REPO}", **extra}  # fmt: skip


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

    def as_uid(
        self, uid: int, *args: str, capability: str | None = None
    ) -> Deferred[subprocess.CompletedProcess[bytes]]:
        """``bottlenetctl ARGS`` run by ``uid`` (off the reactor thread), with
        ``$BOTTLENET_CAPABILITY`` when one is given."""
        argv = _argv(uid, self.control, *args)
        env = _env() if capability is None else _env(BOTTLENET_CAPABILITY=capability)
        return in_thread(
            lambda: subprocess.run(argv, env=env, capture_output=True, cwd="/", timeout=120)
        )

    async def test_a_real_second_uid_is_scoped_by_its_peer_credentials(self) -> None:
        """The kernel's word on the peer's uid makes it scoped: its create prints the
        capability, with which (``$BOTTLENET_CAPABILITY``) it lists and removes its own bottle
        only; another's name is ``error: NOT_FOUND:`` and drain is
        ``error: PERMISSION_DENIED:`` (exit 1). The rules in full: ``test_scoped_rules.py``."""
        client = await self.start("--allow-uid", f"{ALICE}:scoped", vm_bottles=False)
        os.chmod(self.control, 0o666)  # as a systemd socket's group would let them reach it
        await client.create_bottle("r1")  # the daemon's own uid: full control
        r = await self.as_uid(ALICE, "bottle", "create", "a1", "--owner", "alice-actor")
        self.assertEqual(r.returncode, 0, r.stderr)
        said = r.stdout.decode().splitlines()
        self.assertTrue(said[0].startswith("created a1 on "), said)
        self.assertTrue(said[1].startswith("capability "), said)
        capability = said[1].split()[1].rstrip(":")
        r = await self.as_uid(ALICE, "--json", "bottle", "ls", capability=capability)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(b'"a1"', r.stdout)
        self.assertNotIn(b'"r1"', r.stdout)
        r = await self.as_uid(ALICE, "--json", "bottle", "ls")  # no capability: none of them
        self.assertEqual((r.returncode, r.stdout.strip()), (0, b"[]"), r.stderr)
        for given in (capability, None):
            r = await self.as_uid(ALICE, "bottle", "rm", "r1", capability=given)
            self.assertEqual(r.returncode, 1, (r.stdout, r.stderr))
            self.assertIn(b"error: NOT_FOUND:", r.stderr)
        r = await self.as_uid(ALICE, "node", "drain")
        self.assertEqual(r.returncode, 1)
        self.assertIn(b"error: PERMISSION_DENIED:", r.stderr)
        self.assertEqual(len(await client.all_bottles()), 2)
        r = await self.as_uid(ALICE, "bottle", "rm", "a1", capability=capability)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual([b.name for b in await client.all_bottles()], ["r1"])
