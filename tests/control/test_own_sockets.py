"""Issue 13 item 1: a forward can never point at the daemon's own control socket.

The in-process daemon (the tap's real service tree) with its control socket at the default
place when ``XDG_RUNTIME_DIR`` is unset: ``<state-dir>/control.sock``. Before the fix a forward
to it was accepted, and every uid reaching the forward spoke to the control plane as the daemon.
"""

from __future__ import annotations

import os

from bottlenet.errors import InvalidArgument
from bottlenet.forward.spec import targets_dir
from tests.bottles.harness import DaemonCase


class OwnSocketTargetTests(DaemonCase):
    async def test_control_socket_is_never_a_target(self) -> None:
        self.control = os.path.join(self.state_dir, "control.sock")
        client = await self.start()
        await client.create_bottle("evil")
        for target in (
            f"unix:{self.control}",
            f"unix:{self.state_dir}/bottles/evil/x.sock",
            f"unix:{self.state_dir}/targets/other/x.sock",
        ):
            with self.assertRaises(InvalidArgument):
                await client.add_forward("evil", "ctl", target, 0)
        # Reached by another name inside the bottle's own target directory: a hard link.
        tdir = targets_dir(self.state_dir, "evil")
        os.makedirs(tdir, mode=0o700)
        os.link(self.control, os.path.join(tdir, "ctl.sock"))
        with self.assertRaises(InvalidArgument) as info:
            await client.add_forward("evil", "ctl", f"unix:{tdir}/ctl.sock", 0)
        assert "daemon's own sockets" in info.exception.message
        page = await client.list_forwards("evil")
        assert page.items == ()
