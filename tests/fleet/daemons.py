"""bottlenet daemons for fleet tests: one per node, each with its own state, control socket,
alias pool and fake-smolvm directory (the fake is a TEST DOUBLE whose "VMs" are host
processes; docs/smolvm.md)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Sequence
from unittest import mock

import attrs

from bottlenet.control.blocking import BlockingControlClient
from tests.control.daemon_helpers import start_daemon, stop, wait_ready
from tests.fakes import FAKE_SMOLVM, FakeSmolvm


@attrs.define
class NodeDaemon:
    """One node's daemon: started, stopped and started again on the same state."""

    root: str
    index: int
    extra: Sequence[str] = ()
    proc: subprocess.Popen[bytes] | None = None
    output: list[str] = attrs.field(factory=list)

    @property
    def state(self) -> str:
        return os.path.join(self.root, "state")

    @property
    def control(self) -> str:
        return os.path.join(self.root, "c.sock")

    @property
    def fake(self) -> FakeSmolvm:
        return FakeSmolvm(os.path.join(self.root, "vm"))

    def argv_extra(self) -> list[str]:
        return [
            "--alias-pool", f"127.{90 + self.index}.0.0/24",
            "--smolvm", FAKE_SMOLVM, "--smolvm-data-dir", self.fake.path,
            "--uid-ledger", self.fake.uid_ledger, "--unsafe-skip-isolation-probe", *self.extra,
        ]  # fmt: skip

    def start(self) -> None:
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self.proc = start_daemon(self.state, self.control, extra=self.argv_extra())
        wait_ready(self.control, self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            self.output.append(stop(self.proc))
            self.proc = None

    def client(self, timeout: float = 30) -> BlockingControlClient:
        """The daemon's control socket (a path: reachable from any namespace)."""
        return BlockingControlClient(self.control, timeout=timeout)

    def names(self) -> set[str]:
        with self.client() as c:
            return {b.name for b in c.all_bottles()}


#: Ray's head runs its dashboard process even without the dashboard, for one module
#: (``UsageStatsHead``) that, with usage statistics disabled, still asks the cloud metadata
#: address (169.254.169.254) unless ``~/ray_bootstrap_config.yaml`` exists, and still posts a
#: "disabled" report to Ray's server: both are kept on this machine.
QUIET_RAY = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
}


@contextlib.contextmanager
def quiet_ray(root: str) -> Iterator[dict[str, str]]:
    """While Ray's head starts: a HOME with a bootstrap config and the variables above."""
    home = os.path.join(root, "home")
    os.makedirs(home, exist_ok=True)
    with open(os.path.join(home, "ray_bootstrap_config.yaml"), "w") as f:
        f.write("provider:\n  type: local\n")
    env = {**QUIET_RAY, "HOME": home}
    with mock.patch.dict(os.environ, env):
        yield env
