"""The kit's guest programs, run through the kit on this host as a guest runs them."""

from __future__ import annotations

import os
import select
import subprocess

from bottlenet.kit.build import Kit, KitCache
from tests.fakes import process_alive
from tests.vmctl.test_sessionend import QUIET, wait_until


def test_an_attached_command_ends_with_its_session(built_kit: tuple[KitCache, Kit]) -> None:
    """``session``: the pipes dropped (the agent's end of a session) end the command."""
    _, kit = built_kit
    p = subprocess.Popen(
        kit.host_program.argv("session", *QUIET),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        process_group=0,
    )
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], 20)
    assert ready
    child = int(p.stdout.readline())
    for pipe in (p.stdin, p.stdout, p.stderr):
        assert pipe is not None
        pipe.close()
    assert wait_until(lambda: not process_alive(child))
    assert p.wait(20) != 0


def test_the_workload_steps(built_kit: tuple[KitCache, Kit], tmp_path: object) -> None:
    """prepare, run (as another uid where root), wait and logs through the kit."""
    _, kit = built_kit
    prog = kit.host_program
    d = os.path.join(str(tmp_path), "w")
    env = {"PATH": "/usr/bin:/bin"}
    assert (
        subprocess.run(prog.argv("workload", "prepare", d, "no-such-cmd"), env=env).returncode
        == 127
    )
    assert subprocess.run(prog.argv("workload", "prepare", d, "echo"), env=env).returncode == 0
    assert oct(os.stat(d).st_mode & 0o777) == "0o755"
    user = "65534" if os.geteuid() == 0 else str(os.getuid())
    os.chmod(str(tmp_path), 0o755)
    run = subprocess.run(
        prog.argv("workload", "run", d, user, "sh", "-c", "id -u; echo two; exit 3"), env=env
    )
    assert run.returncode == 0
    waited = subprocess.run(prog.argv("workload", "wait", d), capture_output=True, timeout=30)
    assert waited.stdout == b"3\n"
    logs = subprocess.run(prog.argv("workload", "logs", d, "1"), capture_output=True)
    assert logs.stdout == b"two\n"
    logs = subprocess.run(prog.argv("workload", "logs", d, "5"), capture_output=True)
    assert logs.stdout == f"{user}\ntwo\n".encode()


def test_write_is_atomic_and_bounded(built_kit: tuple[KitCache, Kit], tmp_path: object) -> None:
    """``write PATH``: stdin lands whole at PATH; more than the bound is refused."""
    _, kit = built_kit
    path = os.path.join(str(tmp_path), "policy")
    p = subprocess.run(kit.host_program.argv("write", path), input=b"a\nb\n")
    assert p.returncode == 0
    with open(path, "rb") as fh:
        assert fh.read() == b"a\nb\n"
    big = subprocess.run(kit.host_program.argv("write", path), input=b"x" * (2 << 20))
    assert big.returncode == 1
