"""Reconcile the state file with reality when the daemon starts.

VMs survive a daemon restart; listeners do not. So on start the daemon: re-binds the agent
endpoints of every live bottle on the same addresses and ports; tears down bottles whose
sidecar is gone (or whose raw ports are no longer its VM's, or whose endpoint cannot be
re-bound: fail closed); deletes machines that carry our owner label but that no bottle
claims (a create cut short by a crash); removes unclaimed socket directories. It never
touches a machine without our owner label.
"""

from __future__ import annotations

import os
from typing import Any

from attrs import evolve
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from bottlenet.bottles.isolation import MODE_ALIAS
from bottlenet.bottles.lifecycle import LOCALHOST, VMLifecycle, remove_bottle_dir
from bottlenet.bottles.model import LABEL_OWNER, STATE_DEGRADED, VMBottle
from bottlenet.bottles.registry import BottleRegistry
from bottlenet.bottles.store import State, StateError
from bottlenet.bottles.watch import pid_alive
from bottlenet.errors import BottlenetError
from bottlenet.forward.spec import (
    BOTTLE_NAME_RE,
    ForwardSpec,
    TCPListen,
    TCPTarget,
    UNIXListen,
    bottle_dir,
)
from vmctl.errors import VmctlError
from vmctl.ports import Ownership
from vmctl.smolvm import Machine


class Recovery:
    log = Logger()

    def __init__(
        self, registry: BottleRegistry, vms: VMLifecycle | None, state: State, state_dir: str
    ) -> None:
        self.registry = registry
        self.vms = vms
        self.state = state
        self.state_dir = state_dir

    async def run(self) -> None:
        self.registry.recovering = True
        try:
            await self._forward_only()
            await self._vm_bottles()
            self._remove_unclaimed_dirs()
        finally:
            self.registry.recovering = False
        try:
            self.registry.save()
        except BottlenetError:
            pass
        self.log.info(
            "recovery done: {n} bottle(s) restored",
            n=len([r for r in self.state.bottles if self.registry.has_bottle(r)]),
        )

    # -- forward-only -------------------------------------------------------------------

    async def _forward_only(self) -> None:
        for name, rec in sorted(self.state.bottles.items()):
            if rec.get("kind") != "forward":
                continue
            if self.registry.has_bottle(name):
                self.log.warn("persisted bottle {bottle} is shadowed by the config", bottle=name)
                continue
            alias, created = rec.get("alias"), rec.get("created_at")
            forwards = rec.get("forwards")
            if (
                not isinstance(alias, str)
                or not isinstance(created, int | float)
                or not isinstance(forwards, list)
            ):
                self.log.error("persisted bottle {bottle} is malformed; dropped", bottle=name)
                continue
            try:
                self.registry.adopt_forward_only(name, alias, float(created))
            except BottlenetError as e:
                self.log.error(
                    "persisted bottle {bottle} dropped: {err}", bottle=name, err=e.message
                )
                continue
            for fwd in forwards:
                try:
                    await self.registry.restore_forward(
                        name, str(fwd["label"]), str(fwd["target"]), int(fwd["port"])
                    )
                except (BottlenetError, KeyError, TypeError, ValueError) as e:
                    self.log.error(
                        "forward of {bottle} not restored: {err}",
                        bottle=name,
                        err=getattr(e, "message", type(e).__name__),
                    )

    # -- VM bottles ---------------------------------------------------------------------

    async def _list_ours(self, expected: bool) -> list[Machine] | None:
        """Our labelled machines; None when smolvm cannot tell (missing, failing)."""
        if self.vms is None:
            return None
        try:
            return await self.vms.smolvm.list(labels={LABEL_OWNER: self.registry.instance_id})
        except VmctlError as e:
            if not expected and e.code == "SMOLVM_UNAVAILABLE":
                # A forward-only daemon without smolvm: nothing to reconcile, nothing wrong.
                self.log.info("no smolvm: no machines to reconcile")
            else:
                self.log.error("cannot list smolvm machines: {err}", err=e.message)
            return None

    async def _vm_bottles(self) -> None:
        bottles: list[VMBottle] = []
        for name, rec in sorted(self.state.bottles.items()):
            if rec.get("kind") != "vm":
                continue
            try:
                bottles.append(VMBottle.from_state(name, rec))
            except StateError as e:
                self.log.error("persisted bottle {bottle} dropped: {err}", bottle=name, err=str(e))
        machines = await self._list_ours(expected=bool(bottles))
        by_name = {m.name: m for m in machines or []}
        claimed: set[str] = set()
        for vb in bottles:
            if self.registry.has_bottle(vb.name):
                self.log.warn("persisted bottle {bottle} is shadowed by the config", bottle=vb.name)
                continue
            if self.vms is None:
                self.log.error("bottle {bottle}: no smolvm; kept as degraded", bottle=vb.name)
                self.registry.adopt_vm(evolve(vb, state=STATE_DEGRADED))
                continue
            kept = await self._restore(vb, by_name if machines is not None else None)
            if kept:
                claimed |= {vb.sidecar_vm, vb.agent_vm}
        if machines is None or self.vms is None:
            return
        for m in machines:
            if m.name in claimed or m.labels.get(LABEL_OWNER) != self.registry.instance_id:
                continue
            self.log.warn(
                "deleting orphan machine {name} (ours, claimed by no bottle)", name=m.name
            )
            try:
                await self.vms.remove_machine(m.name)
            except VmctlError as e:
                self.log.error("could not delete orphan {name}: {err}", name=m.name, err=e.message)

    async def _restore(self, vb: VMBottle, machines: dict[str, Machine] | None) -> bool:
        """Re-bind a live bottle's endpoints; tear down one that cannot be restored."""
        assert self.vms is not None
        why = self._dead_reason(vb, machines)
        if why is None:
            why = await self._rebind(vb)
        if why is None:
            self.registry.adopt_vm(vb)
            self.registry.watch(vb)
            self.log.info("bottle {bottle} restored", bottle=vb.name)
            return True
        self.log.warn("bottle {bottle} torn down at recovery: {why}", bottle=vb.name, why=why)
        try:
            await self.vms.teardown(vb)
        except BottlenetError as e:
            self.log.error(
                "bottle {bottle}: teardown failed ({err}); kept as degraded",
                bottle=vb.name,
                err=e.message,
            )
            self.registry.adopt_vm(evolve(vb, state=STATE_DEGRADED))
            return True
        return False

    def _dead_reason(self, vb: VMBottle, machines: dict[str, Machine] | None) -> str | None:
        assert self.vms is not None
        if vb.state == STATE_DEGRADED:
            return "it was degraded"
        if machines is None:
            alive = pid_alive(vb.sidecar_pid)
        else:
            m = machines.get(vb.sidecar_vm)
            alive = m is not None and m.running and m.pid == vb.sidecar_pid
        if not alive:
            return "its sidecar VM is gone"
        for port in vb.raw_ports:
            check = self.vms.check_port(port, vb.sidecar_pid)
            if not check.owned and not (
                self.vms.options.allow_unverifiable_ports
                and check.ownership is Ownership.UNVERIFIABLE
            ):
                return f"raw port {port} is no longer held by its sidecar ({check.ownership.value})"
        return None

    async def _rebind(self, vb: VMBottle) -> str | None:
        assert self.vms is not None
        table = self.vms.table
        try:
            if vb.mode == MODE_ALIAS:
                assert vb.alias is not None
                self.vms.aliases.claim(vb.name, vb.alias)
            for e in vb.endpoints:
                listen: TCPListen | UNIXListen
                if e.host is not None:
                    alias = self.vms.aliases.alias_of(vb.name)
                    assert alias is not None and e.port is not None
                    listen = TCPListen(alias, e.port)
                else:
                    assert e.path is not None
                    listen = UNIXListen(e.path)
                target = TCPTarget(LOCALHOST, e.raw_port)
                await table.add(ForwardSpec(vb.name, e.service, listen, target))
        except BottlenetError as e:
            await table.remove_bottle(vb.name)
            return f"endpoint not restored: {e.message}"
        return None

    def _remove_unclaimed_dirs(self) -> None:
        root = os.path.join(self.state_dir, "bottles")
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return
        for n in names:
            if self.registry.has_bottle(n):
                continue
            self.log.info("removing unclaimed bottle directory {name}", name=n)
            remove_bottle_dir(bottle_dir(self.state_dir, n) if _valid(n) else os.path.join(root, n))


def _valid(name: str) -> bool:
    return BOTTLE_NAME_RE.fullmatch(name) is not None


class RecoveryService(Service):
    """Runs :class:`Recovery` once at start, after the config's bottles are bound."""

    log = Logger()

    def __init__(self, recovery: Recovery, after: Deferred[Any] | None = None) -> None:
        self.recovery = recovery
        self.after = after
        self.ready: Deferred[None] = Deferred()

    def startService(self) -> None:
        super().startService()
        self.recovery.registry.recovering = True
        gate: Deferred[None] = Deferred()

        def after_config(result: object) -> object:
            # Recover only once the config's bottles hold their names and aliases; if the
            # config failed the daemon is exiting, and recovery must not run half-way.
            if not isinstance(result, Failure):
                gate.callback(None)
            return result

        if self.after is None:
            gate.callback(None)
        else:
            self.after.addBoth(after_config)
        gate.addCallback(lambda _: Deferred.fromCoroutine(self.recovery.run()))
        gate.addCallbacks(lambda _: self.ready.callback(None), self._failed)

    def _failed(self, failure: Any) -> None:
        self.recovery.registry.recovering = False
        self.log.failure("recovery failed", failure)
        self.ready.callback(None)

    def stopService(self) -> None:
        super().stopService()
        vms = self.recovery.vms
        if vms is not None:
            vms.unwatch_all()
