"""A sidecar whose services are slow to listen, end to end (issue 27 item 10): the daemon's
real service tree in process (``tests/bottles/harness.py``) and the fake smolvm (a TEST DOUBLE)
modelling smolvm's exposed sockets, which the VM process binds before the guest app listens
and which drop every connection until it does (``expose_ready_after``,
``expose_never_ready``); ``bottlenetctl`` runs as a person runs it where its output is checked.
Needs root (``exec-netns``).

The rules (a slow sidecar waited for with back-off, the silent service named, nothing left,
other bottles kept) are checked on a clock in ``tests/bottles/test_slow_sidecar.py`` and
``test_readiness.py`` (which also runs the real probe on sockets that hold, drop or are
absent); every create through the fake smolvm passes the real probe on its exposed sockets.
Here only what needs the daemon and the CLI: a socket that drops every connection fails the
create within ``--sidecar-ready-timeout``, and what ``bottlenetctl`` says."""

from __future__ import annotations

import os

from tests.bottles.harness import DaemonCase

from .vmdaemon import SPEC_TOML

EGRESS = "/run/bottlenet/egress.sock"


class SidecarReadyTests(DaemonCase):
    timeout = 240  # VM bottles through the fake and a bottlenetctl process: slow when loaded

    def setUp(self) -> None:
        super().setUp()
        if os.geteuid() != 0:
            self.skipTest("exec-netns (unshare) needs root")
        image = os.path.join(self.tmp, "agent.tar")
        open(image, "wb").close()
        self.spec = os.path.join(self.tmp, "spec.toml")
        with open(self.spec, "w") as f:
            f.write(SPEC_TOML.format(image=image))

    async def test_a_silent_sidecar_fails_the_create_and_the_cli_names_it(self) -> None:
        """A service that never answers within ``--sidecar-ready-timeout``: ``bottlenetctl``
        fails with SIDECAR_NOT_READY naming it and the bound, and no machine is left."""
        client = await self.start("--sidecar-ready-timeout", "0.5")
        self.fake.set_faults("exec-netns", expose_never_ready=[EGRESS])
        r = await self.ctl("--json", "bottle", "create", "b2", "--spec", self.spec)
        assert r.returncode != 0, r.stdout
        assert b"SIDECAR_NOT_READY" in r.stderr and b"egress" in r.stderr, r.stderr
        assert b"within 0.5 s" in r.stderr, r.stderr
        assert self.machines() == {}
        assert await client.all_bottles() == []
