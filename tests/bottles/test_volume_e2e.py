"""Volumes through the daemon's real service tree (in process, the fake smolvm test double in
``uid-drop`` mode: its VMMs are host processes as their per-VM uids, serving a volume only as
that uid may): who may have which directory, a parent swapped for a symlink mid-create, a
rename before the destroy, a crash's grant taken back at the next start, a revoke that fails
without stopping the teardown. Real second uids through ``setpriv``, as root."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from typing import Any

from twisted.internet.defer import Deferred

from bottlenet.bottles import posixacl, volumeaccess
from bottlenet.bottles.host import VMHost
from bottlenet.bottles.volumegrants import GrantBook
from bottlenet.bottles.volumes import Requester, VolumeRules, resolve
from bottlenet.errors import BottlenetError
from tests.bottles.harness import DaemonCase, in_thread, spec_doc
from tests.bottles.test_volumeaccess import named_users
from tests.control.test_scoped import _argv, _env
from tests.control.vmdaemon import SPEC_TOML
from vmctl.spec import Volume

SCOPED = 4243
ALICE = 4244
ACL = "system.posix_acl_access"


class VolumeRuleTests(DaemonCase):
    def setUp(self) -> None:
        super().setUp()
        if os.geteuid() != 0 or shutil.which("setpriv") is None:
            self.skipTest("needs root: per-VM uids and other uids through setpriv")
        self.fake.set_faults("exec-netns", "uid-drop")
        self.outside = tempfile.mkdtemp(prefix="bnvol-", dir="/var/tmp")
        self.addCleanup(shutil.rmtree, self.outside, True)
        os.chmod(self.outside, 0o755)

    def directory(self, *parts: str, owner: int = 0, mode: int = 0o755) -> str:
        path = os.path.join(self.outside, *parts)
        os.makedirs(path, exist_ok=True)
        os.chown(path, owner, owner)
        os.chmod(path, mode)
        return path

    def spec_json(self, volume: str) -> str:
        """A spec naming ``volume`` read-write."""
        doc = spec_doc(self.tmp)
        doc["agent"]["volumes"] = [f"{volume}:/tmp/work:rw"]
        return json.dumps(doc)

    def spec_file(self, volume: str) -> str:
        """A spec naming ``volume`` read-write, in a TOML file any uid may read."""
        image = spec_doc(self.tmp)["agent"]["image"]
        path = os.path.join(self.outside, "spec.toml")
        with open(path, "w") as f:
            f.write(SPEC_TOML.format(image=image) + f'volumes = ["{volume}:/tmp/work:rw"]\n')
        os.chmod(path, 0o644)
        return path

    def as_uid(self, uid: int, *args: str) -> Deferred[subprocess.CompletedProcess[bytes]]:
        argv = _argv(uid, self.control, *args)
        return in_thread(
            lambda: subprocess.run(argv, env=_env(), capture_output=True, cwd="/", timeout=120)
        )

    def agent_uid(self, bottle: str) -> int:
        """The uid reserved for the bottle's agent VMM (its record's)."""
        uid = self.registry.get_bottle(bottle).require_vms().agent_uid
        assert uid is not None
        return uid

    def left_as(self, uid: int) -> subprocess.Popen[bytes]:
        """What a compromised VMM leaves behind: a process of ``uid``'s that must die with
        the bottle's destroy (killed at the test's end if it did not)."""
        left = subprocess.Popen(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "300"],
            start_new_session=True,
        )
        self.addCleanup(lambda: left.poll() is None and (left.kill(), left.wait()))
        return left

    def creates(self) -> list[list[str]]:
        return [
            a for a in self.fake.argvs() if a[:2] == ["machine", "create"] and a[-1] != "--help"
        ]

    async def test_a_scoped_peers_rw_volume_on_a_directory_it_does_not_own_is_refused(
        self,
    ) -> None:
        """Issue 40's rule: uid 4243 (scoped) names a root-owned 0755 directory holding a
        ``passwd`` read-write; one line names the rule, nothing is granted or made (N1
        ``scoped``)."""
        victim = self.directory("sys", "etc")
        with open(os.path.join(victim, "passwd"), "w") as f:
            f.write("root:x:0:0:root:/root:/bin/sh\n")
        await self.start("--allow-uid", f"{SCOPED}:scoped")
        os.chmod(self.tmp, 0o711)
        os.chmod(self.control, 0o666)
        r = await self.as_uid(SCOPED, "bottle", "create", "v1", "--spec", self.spec_file(victim))
        self.assertEqual(r.returncode, 1, r.stderr)
        line = r.stderr.decode()
        self.assertTrue(line.startswith("error: INVALID_ARGUMENT: "), line)
        self.assertEqual(line.count("\n"), 1, line)
        self.assertTrue(
            line.endswith(
                f"agent.volumes[0] {victim!r}: a scoped peer's read-write volumes must lie "
                "under a --volume-root (and the daemon has none)\n"
            ),
            line,
        )
        self.assertEqual(named_users(victim), [])
        self.assertEqual(os.stat(victim).st_mode & 0o7777, 0o755)
        self.assertEqual(self.creates(), [])

    async def test_a_local_peer_may_not_have_a_directory_it_cannot_write(self) -> None:
        """A full-control ``--allow-uid`` peer: root's directory refused read-write (its uid
        may not write it); its own directory is granted to the agent's uid, and taken back."""
        victim = self.directory("root-owned")
        mine = self.directory("alice", owner=ALICE, mode=0o700)
        client = await self.start("--allow-uid", str(ALICE))
        os.chmod(self.tmp, 0o711)
        os.chmod(self.control, 0o666)
        r = await self.as_uid(ALICE, "bottle", "create", "v1", "--spec", self.spec_file(victim))
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(
            f"agent.volumes[0] {victim!r}: uid {ALICE} may not write it itself", r.stderr.decode()
        )
        self.assertEqual(named_users(victim), [])
        r = await self.as_uid(ALICE, "bottle", "create", "v2", "--spec", self.spec_file(mine))
        self.assertEqual(r.returncode, 0, r.stderr)
        agent = self.agent_uid("v2")
        self.assertEqual(named_users(mine), [agent])
        await client.destroy_bottle("v2")
        self.assertEqual(named_users(mine), [])
        self.assertEqual(os.stat(mine).st_mode & 0o7777, 0o700)

    async def test_a_parent_swapped_for_a_symlink_mid_create_never_moves_the_grant(
        self,
    ) -> None:
        """alice's ``proj`` (a real directory) is moved aside and replaced by a symlink to a
        root-owned directory's parent after the volume was resolved and before the grant (a
        real swap, at the agent's uid reservation): the grant goes to the directory first
        resolved, never to the root-owned one, and the create, whose VMM then serves the
        link's target, fails the gate's round trip and takes the grant back (N1b)."""
        alice = self.directory("alice", owner=ALICE)
        work = self.directory("alice", "proj", "work", owner=ALICE, mode=0o700)
        self.directory("alice", "proj", owner=ALICE)
        victim = self.directory("sys", "work")
        client = await self.start()
        reserve = VMHost.reserve_uid
        seen: dict[str, Any] = {}

        async def reserve_then_swap(host: VMHost, machine: str, *rest: Any) -> Any:
            reserved = await reserve(host, machine, *rest)
            if machine.endswith("-agent"):
                os.rename(os.path.join(alice, "proj"), os.path.join(alice, "proj.old"))
                os.symlink(os.path.dirname(victim), os.path.join(alice, "proj"))
                seen["uid"] = reserved.uid
            return reserved

        self.patch(VMHost, "reserve_uid", reserve_then_swap)
        check_started = VMHost.check_started_uid

        async def look_then_check(host: VMHost, bottle: str, reserved: Any) -> None:
            # the agent's VMM runs: where is its grant?
            seen["moved"] = named_users(os.path.join(alice, "proj.old", "work"))
            seen["victim"] = named_users(victim)
            await check_started(host, bottle, reserved)

        self.patch(VMHost, "check_started_uid", look_then_check)
        try:
            await client.create_bottle("s1", spec=self.spec_json(work))
        except BottlenetError as e:
            self.assertEqual(e.code, "ISOLATION_FAILED")
        moved = os.path.join(alice, "proj.old", "work")
        self.assertEqual(named_users(victim), [])
        self.assertEqual(os.stat(victim).st_mode & 0o7777, 0o755)
        self.assertEqual(os.listdir(victim), [])
        self.assertEqual(named_users(moved), [])  # taken back with the create
        self.assertEqual(GrantBook(self.state_dir).grants(), [])
        self.assertEqual((seen["moved"], seen["victim"]), ([seen["uid"]], []))

    async def test_a_parent_swapped_to_a_directory_the_vm_may_write_fails_the_gate(
        self,
    ) -> None:
        """As above, but the link points at a world-writable tree the VMM may write itself:
        its round trip lands there, not in the directory resolved, so the gate (which looks
        in that directory) refuses the create, and nothing of the create is left."""
        alice = self.directory("alice", owner=ALICE)
        work = self.directory("alice", "proj", "work", owner=ALICE, mode=0o700)
        self.directory("alice", "proj", owner=ALICE)
        scratch = self.directory("scratch", "work", mode=0o777)
        client = await self.start()
        reserve = VMHost.reserve_uid

        async def reserve_then_swap(host: VMHost, machine: str, *rest: Any) -> Any:
            reserved = await reserve(host, machine, *rest)
            if machine.endswith("-agent"):
                os.rename(os.path.join(alice, "proj"), os.path.join(alice, "proj.old"))
                os.symlink(os.path.dirname(scratch), os.path.join(alice, "proj"))
            return reserved

        self.patch(VMHost, "reserve_uid", reserve_then_swap)
        with self.assertRaises(BottlenetError) as info:
            await client.create_bottle("s2", spec=self.spec_json(work))
        self.assertEqual(info.exception.code, "ISOLATION_FAILED")
        self.assertEqual(named_users(os.path.join(alice, "proj.old", "work")), [])
        self.assertEqual(self.registry.list_bottles(), [])

    async def test_the_destroy_takes_the_grant_off_the_directory_it_was_made_on(self) -> None:
        """alice renames her project after the create and makes a new one at the old path
        (N3 ``keep``): ``bottle rm`` takes the entry off the directory granted, wherever it
        now is, and leaves the new one alone."""
        proj = self.directory("alice", "proj", owner=ALICE)
        work = self.directory("alice", "proj", "work", owner=ALICE, mode=0o700)
        client = await self.start()
        await client.create_bottle("k1", spec=self.spec_json(work))
        agent = self.agent_uid("k1")
        self.assertEqual(named_users(work), [agent])
        os.rename(proj, proj + ".old")
        self.directory("alice", "proj", "work", owner=ALICE, mode=0o700)
        await client.destroy_bottle("k1")
        self.assertEqual(named_users(os.path.join(proj + ".old", "work")), [])
        self.assertEqual(GrantBook(self.state_dir).grants(), [])

    async def test_a_grant_a_crash_left_is_taken_back_at_the_next_start(self) -> None:
        """A grant recorded and made for a uid no bottle holds (a create a crash cut short
        after its grant): the next start's recovery removes the entry and the record."""
        work = self.directory("left", mode=0o755)
        await self.start()
        await self.stop()
        book = GrantBook(self.state_dir)
        with resolve(
            [Volume(work, "/w")], ["agent.volumes[0]"], Requester.daemon(), VolumeRules(),
            reachable=True,
        ) as resolved:  # fmt: skip
            volumeaccess.grant(resolved, 2_065_000, book, "gone")
        self.assertEqual(named_users(work), [2_065_000])
        await self.start()
        self.assertEqual(named_users(work), [])
        self.assertEqual(os.stat(work).st_mode & 0o7777, 0o755)
        self.assertEqual(book.grants(), [])

    async def test_a_revoke_that_fails_does_not_stop_the_teardown(self) -> None:
        """The ACL cannot be written back at ``bottle rm``: the destroy still ends the VM's
        uid and releases the bottle's directory; the grant's record stays, and the next
        start takes it back (N3: the error once skipped ``end_uids`` and ``release``)."""
        work = self.directory("w", mode=0o755)
        client = await self.start()
        await client.create_bottle("f1", spec=self.spec_json(work))
        agent = self.agent_uid("f1")
        left = self.left_as(agent)
        real_write = posixacl.write

        def failing(fd: int, acl: posixacl.Acl) -> None:
            raise OSError(5, "Input/output error")

        self.patch(posixacl, "write", failing)
        await client.destroy_bottle("f1")
        self.assertFalse(os.path.exists(os.path.join(self.state_dir, "bottles", "f1")))
        self.assertIsNotNone(await in_thread(lambda: left.wait(timeout=30)))
        self.assertEqual(named_users(work), [agent])
        self.assertEqual([g.uid for g in GrantBook(self.state_dir).grants()], [agent])
        self.patch(posixacl, "write", real_write)
        await self.stop()
        await self.start()
        self.assertEqual(named_users(work), [])
        self.assertEqual(stat.S_IMODE(os.stat(work).st_mode), 0o755)

    async def test_a_grant_book_that_cannot_be_read_does_not_stop_the_teardown(self) -> None:
        """The grant records cannot be listed at ``bottle rm`` (an I/O error): logged, and the
        VM uid's processes are still ended and the bottle's directory released."""
        work = self.directory("w", mode=0o755)
        client = await self.start()
        await client.create_bottle("g1", spec=self.spec_json(work))
        agent = self.agent_uid("g1")
        left = self.left_as(agent)

        def unreadable(book: GrantBook, uid: int | None = None) -> list[Any]:
            raise OSError(5, "Input/output error")

        self.patch(GrantBook, "grants", unreadable)
        await client.destroy_bottle("g1")
        self.assertFalse(os.path.exists(os.path.join(self.state_dir, "bottles", "g1")))
        self.assertIsNotNone(await in_thread(lambda: left.wait(timeout=30)))
        self.assertEqual(named_users(work), [agent])  # taken back at the next start

    async def test_a_bottle_from_before_the_grant_records_still_gives_its_grant_back(
        self,
    ) -> None:
        """A bottle created by a daemon that kept no grant records (its record removed here):
        ``bottle rm`` still takes its agent uid's entry off each read-write volume, found
        without following links."""
        work = self.directory("old", mode=0o755)
        client = await self.start()
        await client.create_bottle("o1", spec=self.spec_json(work))
        agent = self.agent_uid("o1")
        book = GrantBook(self.state_dir)
        for g in book.grants():
            book.forget(g)
        self.assertEqual(named_users(work), [agent])
        await client.destroy_bottle("o1")
        self.assertEqual(named_users(work), [])
        self.assertEqual(os.stat(work).st_mode & 0o7777, 0o755)
