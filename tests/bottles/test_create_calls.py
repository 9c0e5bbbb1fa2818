"""The smolvm calls one VM bottle's create makes, pinned (issue 38: each call is a process of
the CLI, ~50-100 ms here; nothing is asked twice, and the binary's version and features are
read once per daemon, at its start).

Through the daemon's real service tree and the fake smolvm (``tests/fakes/smolvm``, a TEST
DOUBLE), whose call log is the CLI's argv as the daemon ran it. As root (the gate's netguard
needs it) the daemon runs smolvm's per-VM uids: each machine's uid is reserved between its
create and its start, in the machine's directory, which smolvm is asked for (``machine
data-dir``) until its answer showed its layout: in a daemon's first create only.
"""

from __future__ import annotations

from typing import Any

from bottlenet.bottles.egresswatch import EgressWatch
from tests.bottles.test_vm_e2e import E2ECase

#: The daemon's start: the version and the features (two --help), and recovery's listing.
AT_START = ["--version", "machine create --help", "machine exec --help", "machine ls"]
#: Per machine, in order, for a socket-mode bottle with an egress policy and no bridge:
#: the sidecar's policy write and reload, the agent's launch gate (the VM pid is the one
#: ``machine start`` printed: no ``status`` after it).
SIDECAR = ["create", "start", "exec", "exec"]
AGENT = ["create", "start", "exec"]
#: With bottlenet's bridge: its start and its proof, in the agent.
BRIDGE = ["exec", "exec"]


def words(call: dict[str, Any]) -> str:
    """A call as ``--version``, ``machine SUB --help`` or ``machine SUB NAME``."""
    argv: list[str] = call["argv"]
    if argv[:1] != ["machine"]:
        return " ".join(argv)
    if "--help" in argv:
        return f"machine {argv[1]} --help"
    name = argv[argv.index("--name") + 1] if "--name" in argv else ""
    return " ".join(w for w in ("machine", argv[1], name) if w)


def per_machine(calls: list[str], machine: str) -> list[str]:
    return [c.split()[1] for c in calls if c.endswith(f" {machine}")]


class CreateCallsTests(E2ECase):
    async def test_one_create_makes_these_smolvm_calls(self) -> None:
        """A create makes 7 calls (9 with the bridge), in this order per machine, and asks
        neither the version, the features nor a machine's directory again: the daemon's
        start read the first two, its first create the layout of the third."""
        self.fake.set_faults("exec-netns")
        client = await self.start()
        assert self.root is not None
        # The egress watch polls every sidecar on a timer (``machine egress-events``): on a
        # loaded machine a create outlasts its interval, and its calls are not the create's.
        for svc in self.root:
            if isinstance(svc, EgressWatch):
                svc.stopService()  # its timer cancelled (a synchronous stop)
        await self.root.smolvm.version()  # the start's own reads, done
        self.assertEqual(sorted(words(c) for c in self.fake.calls()), sorted(AT_START))
        before = len(self.fake.calls())
        await client.create_bottle("b0", spec=self.spec_json(mode="socket"))
        first = [words(c) for c in self.fake.calls()[before:]]
        asked = [c for c in first if c.startswith("machine data-dir ")]
        self.assertIn(len(asked), (1, 2), first)  # both sides may ask before one answers
        for role, calls in (("sidecar", SIDECAR), ("agent", AGENT)):
            made = [c for c in per_machine(first, f"bn-b0-{role}") if c != "data-dir"]
            self.assertEqual(made, calls, first)
        for name, bridge in (("b1", "none"), ("b2", "bottlenet")):
            before = len(self.fake.calls())
            await client.create_bottle(name, spec=self.spec_json(mode="socket", bridge=bridge))
            made = [words(c) for c in self.fake.calls()[before:]]
            self.assertEqual(per_machine(made, f"bn-{name}-sidecar"), SIDECAR, made)
            agent = AGENT + (BRIDGE if bridge == "bottlenet" else [])
            self.assertEqual(per_machine(made, f"bn-{name}-agent"), agent, made)
            self.assertEqual(len(made), len(SIDECAR) + len(agent), made)
