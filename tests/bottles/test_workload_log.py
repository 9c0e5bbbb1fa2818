"""The workload's log in the guest is bounded (``workload.LOG_CAP``, one rotation): the guest's
``/tmp`` is a RAM tmpfs with no size (fidelity.md #7). The wrapper and ``bottle logs``' tail are
guest shell and python; here they run on the host, as root (the wrapper's user drop needs it),
in a directory of their own, exactly as bottlenet sends them to the guest."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from bottlenet.bottles import workload

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the wrapper drops to its user as root")

#: The workload: numbered 1 KiB lines, 2.5 times the cap in all.
LINES = workload.LOG_CAP * 5 // 2 // 1024
CHATTY = (
    "import sys\n"
    f"for i in range({LINES}):\n"
    "    sys.stdout.write('%08d ' % i + 'x' * 1014 + '\\n')\n"
)


@pytest.fixture
def agent_vm() -> Iterator[str]:
    """A machine name whose guest directory (``/tmp/.bottlenet-workload-NAME``) is ours."""
    name = "bn-logcap-" + secrets.token_hex(4)
    yield name
    shutil.rmtree(workload.guest_dir(name), ignore_errors=True)


def run(argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": "/usr/bin:/bin"}
    return subprocess.run(argv, env=env, capture_output=True, timeout=120, check=False)


def test_a_chatty_workload_keeps_at_most_two_caps_and_its_newest_lines(agent_vm: str) -> None:
    """2.5 caps of output: ``log`` and ``log.1`` each at most the cap, the exit code written,
    and ``bottle logs``' tail shows the last lines."""
    argv = ("/usr/bin/python3", "-I", "-c", CHATTY)
    assert run(workload.prepare_argv(argv, agent_vm)).returncode == 0
    wrapped = workload.wrap(argv, agent_vm, "65534")
    assert run(wrapped).returncode == 0  # the wrapper returns when the workload has ended
    d = workload.guest_dir(agent_vm)
    with open(os.path.join(d, "exit")) as f:
        assert f.read() == "0\n"
    sizes = [os.path.getsize(os.path.join(d, n)) for n in ("log", "log.1")]
    assert all(0 < s <= workload.LOG_CAP for s in sizes), sizes
    assert sum(sizes) < 2 * workload.LOG_CAP < LINES * 1024
    tail = run(workload.logs_argv(agent_vm, 3, follow=False))
    last = [line[:8] for line in tail.stdout.splitlines()]
    assert last == [b"%08d" % i for i in range(LINES - 3, LINES)], tail
