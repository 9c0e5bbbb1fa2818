"""A failure at every step of create rolls back everything done so far (fake smolvm).

Each step is failed twice over: by a fault the fake smolvm (a test double) can inject where
it can, and by wrapping the lifecycle's own step function so it fails right *after* doing its
work (so that step's own undo is exercised too).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

from twisted.internet.defer import Deferred, fail

from bottlenet.bottles.lifecycle import VMLifecycle
from bottlenet.control.client import ControlClient
from bottlenet.errors import BindRefused, BottlenetError, SmolvmFailed
from tests.bottles.harness import DaemonCase
from vmctl.ports import Ownership, PortCheck

STEPS = ("step_allocate", "step_sidecar", "step_bind", "step_egress", "step_agent")


def _after(step: str, mode: str) -> Callable[[RollbackTests], Awaitable[None]]:
    async def test(self: RollbackTests) -> None:
        await self._after_step(step, mode)

    test.__doc__ = f"A failure right after {step} ({mode} mode) leaves nothing behind."
    return test


class RollbackTests(DaemonCase):
    async def _create_fails(
        self, client: ControlClient, code: str, mode: str = "socket", **spec: Any
    ) -> None:
        try:
            await client.create_bottle("rb", spec=self.spec_json(mode=mode, **spec))
        except BottlenetError as e:
            self.assertEqual(e.code, code, str(e))
        else:
            self.fail("create succeeded")
        await self.assertNothingLeft(client)

    async def assertNothingLeft(self, client: ControlClient) -> None:
        self.assertEqual(self.machines(), {})
        self.assertEqual(self.fake.live_pids(), [])
        assert self.root is not None
        self.assertEqual(self.root.table.list(), [])
        self.assertFalse(os.path.exists(os.path.join(self.state_dir, "bottles", "rb")))
        self.assertEqual(self.state_file()["bottles"], {})
        self.assertEqual((await client.list_bottles()).total, 0)
        self.assertIsNone(self.registry._aliases.alias_of("rb"))
        self.assertNotIn("rb", self.registry._busy)

    def fail_after(self, step: str) -> None:
        vms = self.registry.vms
        assert vms is not None
        original: Callable[..., Awaitable[None]] = getattr(vms, step)

        async def wrapped(*args: Any) -> None:
            await original(*args)
            raise SmolvmFailed(f"injected after {step}")

        setattr(vms, step, wrapped)

    async def _after_step(self, step: str, mode: str) -> None:
        self.fake.set_faults("exec-netns")
        extra = ("--alias-iptables-fallback", "--unsafe-skip-isolation-probe")
        client = await self.start(*(extra if mode == "alias" else ()))
        self.fail_after(step)
        await self._create_fails(client, "SMOLVM_FAILED", mode=mode)
        # and the same name can be created again afterwards
        vms = self.registry.vms
        assert vms is not None
        setattr(vms, step, getattr(VMLifecycle, step).__get__(vms))
        b = await client.create_bottle("rb", spec=self.spec_json(mode=mode))
        self.assertEqual(b.state, "ready")
        await client.destroy_bottle("rb")

    # One test per step and mode (each well inside the timeout on a loaded machine): the
    # steps used to run in one test whose total went past trial's 60 s under load.
    for _step in STEPS:
        locals()[f"test_after_{_step}_socket_mode"] = _after(_step, "socket")
    for _step in ("step_allocate", "step_bind", "step_agent"):
        locals()[f"test_after_{_step}_alias_mode"] = _after(_step, "alias")
    del _step

    async def test_sidecar_start_fails(self) -> None:
        self.fake.set_faults("exec-netns", fail_start=["bn-rb-sidecar"])
        await self._create_fails(await self.start(), "SMOLVM_FAILED")

    async def test_raw_port_not_owned(self) -> None:
        self.fake.set_faults("exec-netns")
        client = await self.start()
        vms = self.registry.vms
        assert vms is not None
        vms.check_port = lambda port, pid: PortCheck(port, pid, Ownership.FOREIGN, "injected")
        await self._create_fails(client, "SMOLVM_FAILED")

    async def test_directory_taken(self) -> None:
        self.fake.set_faults("exec-netns")
        client = await self.start()
        # a leftover socket directory (recovery removes those; create never reuses one)
        os.makedirs(os.path.join(self.state_dir, "bottles", "rb"), mode=0o700)
        with open(os.path.join(self.state_dir, "bottles", "rb", "keep"), "w"):
            pass
        try:
            await client.create_bottle("rb", spec=self.spec_json())
        except BottlenetError as e:
            self.assertEqual(e.code, "SMOLVM_FAILED")
        else:
            self.fail("create succeeded")
        self.assertEqual(self.machines(), {})
        self.assertTrue(os.path.exists(os.path.join(self.state_dir, "bottles", "rb", "keep")))

    async def test_second_bind_refused(self) -> None:
        self.fake.set_faults("exec-netns")
        client = await self.start()
        assert self.root is not None
        table = self.root.table
        original = table.add
        calls = []

        def add(spec: Any) -> Deferred[Any]:
            calls.append(spec)
            if len(calls) == 2:
                return fail(BindRefused("cannot listen: injected"))
            return original(spec)

        table.add = add  # type: ignore[method-assign]
        await self._create_fails(client, "BIND_REFUSED")
        self.assertEqual(len(calls), 2)

    async def test_egress_reload_fails(self) -> None:
        self.fake.set_faults("exec-netns")
        await self._create_fails(await self.start(), "SMOLVM_FAILED", reload=("/bin/false",))

    async def test_agent_start_fails(self) -> None:
        self.fake.set_faults("exec-netns", fail_start=["bn-rb-agent"])
        await self._create_fails(await self.start(), "SMOLVM_FAILED")

    async def test_probe_fails(self) -> None:
        await self._create_fails(await self.start(), "ISOLATION_FAILED")

    async def test_workload_fails(self) -> None:
        # (no exec-netns: the fake wraps a netns exec in a shell that always starts)
        await self._create_fails(
            await self.start("--unsafe-skip-isolation-probe"),
            "SMOLVM_FAILED",
            workload=("/nonexistent/agent",),
        )

    async def test_state_write_fails(self) -> None:
        self.fake.set_faults("exec-netns")
        client = await self.start()
        store = self.registry._store
        assert store is not None

        def broken(state: object) -> None:
            raise OSError(28, "No space left on device")

        store.save = broken  # type: ignore[method-assign]
        try:
            await client.create_bottle("rb", spec=self.spec_json())
        except BottlenetError as e:
            self.assertEqual(e.code, "UNAVAILABLE")
        else:
            self.fail("create succeeded")
        self.assertEqual(self.machines(), {})
        self.assertEqual(self.fake.live_pids(), [])
        self.assertEqual(self.root.table.list() if self.root else None, [])
        self.assertFalse(os.path.exists(os.path.join(self.state_dir, "bottles", "rb")))
