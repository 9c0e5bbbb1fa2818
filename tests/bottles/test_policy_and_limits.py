"""SetEgressPolicy, BUSY, --max-bottles, and in-process restarts (fake smolvm test double)."""

from __future__ import annotations

import os
import subprocess

from twisted.logger import capturedLogs

from bottlenet.bottles.states import Lifecycle
from bottlenet.errors import BottlenetError, Busy, InvalidArgument, ResourceExhausted
from tests.bottles.harness import DaemonCase, in_thread, sleep
from tests.fakes import FAKE_SMOLVM
from tests.netio import ping_tcp, ping_unix


class EgressPolicyTests(DaemonCase):
    async def test_set_policy_then_failed_reload_keeps_previous(self) -> None:
        client = await self.start("--unsafe-skip-isolation-probe")
        reload_flag = os.path.join(self.tmp, "reload-ok")
        reload = ("/bin/sh", "-c", f'test -e "{reload_flag}"')
        open(reload_flag, "w").close()
        await client.create_bottle("e1", spec=self.spec_json(reload=reload))
        policy = os.path.join(self.tmp, "policy.txt")

        hosts = await client.set_egress_policy(
            "e1", ["example.org", "*.pypi.org", "Bücher.de".lower()]
        )
        self.assertEqual(hosts, ("example.org", "*.pypi.org", "xn--bcher-kva.de"))
        with open(policy) as f:
            self.assertEqual(f.read(), "example.org\n*.pypi.org\nxn--bcher-kva.de\n")
        self.assertEqual((await client.bottle_status("e1")).policy, hosts)

        os.unlink(reload_flag)  # the sidecar's reload now fails
        with self.assertRaises(BottlenetError) as cm:
            await client.set_egress_policy("e1", ["evil.example"])
        self.assertEqual(cm.exception.code, "SMOLVM_FAILED")
        self.assertIn("reload", str(cm.exception))
        self.assertEqual((await client.bottle_status("e1")).policy, hosts)
        self.assertEqual(self.state_file()["bottles"]["e1"]["policy"], list(hosts))
        with open(policy) as f:  # the previous file was put back
            self.assertEqual(f.read(), "example.org\n*.pypi.org\nxn--bcher-kva.de\n")

        for bad in (["UPPER.example"], ["1.2.3.4"], ["a" * 300], ["x.example"] * 2 + [""]):
            with self.assertRaises(InvalidArgument):
                await client.set_egress_policy("e1", bad)
        with self.assertRaises(InvalidArgument):
            await client.set_egress_policy("e1", [f"h{i}.example" for i in range(257)])

    async def test_policy_needs_a_vm_bottle(self) -> None:
        client = await self.start()
        await client.create_bottle("plain")
        with self.assertRaises(InvalidArgument):
            await client.set_egress_policy("plain", ["example.org"])
        with self.assertRaises(InvalidArgument):
            await client.verify_bottle("plain")


class LimitTests(DaemonCase):
    async def test_busy_and_max_bottles(self) -> None:
        client = await self.start("--unsafe-skip-isolation-probe", "--max-bottles", "2")
        first = client.create_bottle("m1", spec=self.spec_json())
        # while m1 is being created: BUSY for a second operation on it
        await self._until(lambda: self.registry.state_of("m1") is Lifecycle.CREATING)
        with self.assertRaises(Busy):
            await client.destroy_bottle("m1")
        with self.assertRaises(Busy):
            await client.create_bottle("m1")
        await client.create_bottle("m2")  # forward-only counts too
        with self.assertRaises(ResourceExhausted):
            await client.create_bottle("m3")
        await first
        with self.assertRaises(BottlenetError) as cm:
            await client.create_bottle("m1")
        self.assertEqual(cm.exception.code, "ALREADY_EXISTS")
        await client.destroy_bottle("m1")
        await client.create_bottle("m3")

    async def _until(self, cond: object) -> None:
        for _ in range(500):
            if cond():  # type: ignore[operator]
                return
            await sleep(0.01)
        self.fail("condition never held")


class RestartTests(DaemonCase):
    async def test_restart_restores_vm_and_forward_only_bottles(self) -> None:
        client = await self.start("--unsafe-skip-isolation-probe")
        b = await client.create_bottle("r1", spec=self.spec_json(mode="socket", listen="tcp"))
        plain = await client.create_bottle("plain", alias="127.77.0.5")
        ep = await client.add_forward(
            "plain", "web", f"127.0.0.1:{self.registry.get_bottle('r1').require_vms().raw_ports[0]}"
        )
        # a labelled machine of ours that no bottle claims, one of another owner, one unlabelled
        env = self.fake.environ(SMOLVM_DATA_DIR=self.fake.path)
        owner = f"bottlenet.owner={self.registry.instance_id}"
        for name, labels in (
            ("orphan", ["--label", owner]),
            ("foreign", ["--label", "bottlenet.owner=someoneelse"]),
            ("unlabelled", []),
        ):
            subprocess.run(
                [FAKE_SMOLVM, "machine", "create", "--name", name, *labels],
                env=env,
                check=True,
                capture_output=True,
            )
        await self.stop()  # VMs survive the daemon

        self.assertEqual(len(self.fake.live_pids()), 2)
        client = await self.start("--unsafe-skip-isolation-probe")
        again = await client.bottle_status("r1")
        self.assertEqual([e.endpoint for e in again.endpoints], [e.endpoint for e in b.endpoints])
        self.assertEqual(again.env, b.env)
        for e in again.endpoints:
            assert e.host_path is not None
            self.assertEqual(await in_thread(ping_unix, e.host_path), b"ping")
        self.assertEqual((await client.bottle_status("plain")).alias, plain.alias)
        forwards = (await client.list_forwards("plain")).items
        self.assertEqual([f.endpoint for f in forwards], [ep.forward.endpoint])
        assert ep.port is not None
        self.assertEqual(await in_thread(ping_tcp, "127.77.0.5", ep.port), b"ping")
        self.assertEqual(
            sorted(self.machines()), ["bn-r1-agent", "bn-r1-sidecar", "foreign", "unlabelled"]
        )

    async def test_restart_tears_down_bottle_whose_sidecar_is_gone(self) -> None:
        client = await self.start("--unsafe-skip-isolation-probe")
        await client.create_bottle("g1", spec=self.spec_json(mode="socket"))
        sidecar_pid = self.registry.list_bottles()[0].require_vms().sidecar_pid
        await self.stop()
        os.kill(sidecar_pid, 9)
        client = await self.start("--unsafe-skip-isolation-probe")
        self.assertEqual((await client.list_bottles()).total, 0)
        self.assertEqual(self.machines(), {})
        self.assertEqual(self.fake.live_pids(), [])
        self.assertEqual(self.state_file()["bottles"], {})
        self.assertFalse(os.path.exists(os.path.join(self.state_dir, "bottles", "g1")))

    async def test_restart_tears_down_bottle_whose_raw_port_someone_else_holds(self) -> None:
        """docs/bottles.md recovery step 3: a raw port is trusted again only if the sidecar's
        VM process still owns it. Here a squatter (this test) holds the port the state file
        names: the bottle must be torn down, never re-bound to relay into the squatter."""
        import copy
        import socket

        from bottlenet.bottles.store import State, StateStore

        client = await self.start("--unsafe-skip-isolation-probe")
        # Raw ports exist only for a sidecar that serves TCP (the opt-in ``listen = "tcp"``).
        await client.create_bottle("q1", spec=self.spec_json(mode="socket", listen="tcp"))
        await self.stop()
        squatter = socket.create_server(("127.0.0.1", 0))
        self.addCleanup(squatter.close)
        # Edit the stored state as a whole (snapshot + journal), written back as a snapshot.
        store = StateStore(self.state_dir)
        state = store.load()
        bottles = copy.deepcopy(dict(state.bottles))
        record = bottles["q1"]
        endpoints = record["vm"]["endpoints"] if "vm" in record else record["endpoints"]
        endpoints[0]["raw_port"] = squatter.getsockname()[1]
        store.save(State(state.instance_id, bottles))
        store.close()
        with capturedLogs() as events:
            client = await self.start("--unsafe-skip-isolation-probe")
        self.assertEqual((await client.list_bottles()).total, 0)
        self.assertEqual(self.machines(), {})
        why = [e for e in events if "torn down at recovery" in e.get("log_format", "")]
        self.assertEqual(len(why), 1)
        self.assertIn("no longer held by its sidecar", why[0]["why"])
