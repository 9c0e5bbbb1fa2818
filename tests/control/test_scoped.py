"""Scoped control peers (``--allow-uid UID:scoped``, issue 28): a real second uid (``setpriv``,
the system ``python3`` with this project on its path) runs ``bottlenetctl`` against the
daemon's real service tree (in process, fake smolvm test double) and is confined to the
bottles it created; the daemon's own uid keeps full control."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from typing import Any

from twisted.internet.defer import Deferred

from tests.bottles.harness import DaemonCase, in_thread

SYSTEM_PYTHON = "/usr/bin/python3"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALICE, BOB = 4243, 4244


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

    async def test_a_scoped_uid_is_confined_to_its_own_bottles(self) -> None:
        """It creates and uses its bottles; another's name is NOT_FOUND for everything;
        listings and events show its own only; Drain is PERMISSION_DENIED."""
        client = await self.start(
            "--allow-uid", f"{ALICE}:scoped", "--allow-uid", f"{BOB}:scoped", vm_bottles=False
        )
        os.chmod(self.control, 0o666)  # as a systemd socket's group would let them reach it
        r = await self.as_uid(ALICE, "bottle", "create", "a1", "--owner", "alice-actor")
        self.assertEqual(r.returncode, 0, r.stderr)
        r = await self.as_uid(BOB, "bottle", "create", "b1")
        self.assertEqual(r.returncode, 0, r.stderr)
        await client.create_bottle("r1")  # the daemon's own uid: full control

        r = await self.as_uid(ALICE, "--json", "bottle", "ls")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(b'"a1"', r.stdout)
        self.assertNotIn(b'"b1"', r.stdout)
        self.assertNotIn(b'"r1"', r.stdout)
        for args in (
            ("bottle", "status", "b1"),
            ("bottle", "rm", "b1"),
            ("bottle", "rm", "r1"),
            ("bottle", "renew", "r1", "60"),
            ("forward", "add", "b1", "web", "--to", "127.0.0.1:9"),
            ("forward", "ls", "r1"),
            ("stats", "b1"),
        ):
            r = await self.as_uid(ALICE, *args)
            self.assertEqual(r.returncode, 1, (args, r.stdout, r.stderr))
            self.assertIn(b"error: NOT_FOUND:", r.stderr, args)
        r = await self.as_uid(ALICE, "forward", "add", "a1", "web", "--to", "127.0.0.1:9")
        self.assertEqual(r.returncode, 0, r.stderr)
        r = await self.as_uid(ALICE, "--json", "forward", "ls")
        self.assertIn(b'"a1"', r.stdout)
        r = await self.as_uid(ALICE, "node", "drain")
        self.assertEqual(r.returncode, 1)
        self.assertIn(b"error: PERMISSION_DENIED:", r.stderr)
        r = await self.as_uid(ALICE, "node", "info")
        self.assertEqual(r.returncode, 0, r.stderr)

        # events: another's bottle is never shown, its own are
        watcher = self.as_uid(ALICE, "events", "--count", "2")
        await self.when_logged(f"uid={ALICE}")
        await self.when_logged("watches events")
        await client.create_bottle("r2")
        await client.destroy_bottle("r1")
        r = await self.as_uid(ALICE, "bottle", "rm", "a1")
        self.assertEqual(r.returncode, 0, r.stderr)
        r = await self.as_uid(ALICE, "bottle", "create", "a2")
        self.assertEqual(r.returncode, 0, r.stderr)
        seen: Any = await watcher
        lines = seen.stdout.decode().splitlines()
        self.assertEqual(
            [line.split()[1:3] for line in lines], [["destroyed", "a1"], ["created", "a2"]]
        )

        names = sorted(b.name for b in await client.all_bottles())
        self.assertEqual(names, ["a2", "b1", "r2"])
        # the creator survives a restart: still BOB's, still hidden from ALICE
        await self.stop()
        await self.start(
            "--allow-uid", f"{ALICE}:scoped", "--allow-uid", f"{BOB}:scoped", vm_bottles=False
        )
        os.chmod(self.control, 0o666)
        r = await self.as_uid(ALICE, "bottle", "rm", "b1")
        self.assertIn(b"error: NOT_FOUND:", r.stderr)
        r = await self.as_uid(BOB, "bottle", "rm", "b1")
        self.assertEqual(r.returncode, 0, r.stderr)
