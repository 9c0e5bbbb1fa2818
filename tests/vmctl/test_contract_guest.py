"""Contract tests for what the guest side of ``machine exec`` depends on, real CLI and fake
together (no boot: what the real 1.32.2 binary shows without one; the rest of each behaviour
is modelled by the fake and named in ``docs/smolvm.md``, "The fake smolvm").

* ``exec -u/--user`` and its default (the image's ``USER``): bottlenet's own commands go with
  ``-u 0:0`` (``vmctl.smolvm.GUEST_ROOT``), and both parsers take every such argv;
* the wheel binary's ``note: no packed assets found ...`` line: the fake's ``packed-note``
  mode prints the real text, and vmctl's :func:`strip_notes` removes both.
"""

from __future__ import annotations

import os
import subprocess

from bottlenet.bottles.workload import IMAGE_USER_ARGV, waiter_argv
from bottlenet.probe.script import ARGV as PROBE_ARGV
from tests.fakes import FAKE_SMOLVM
from tests.vmctl.test_contract import CLI, agree, clis
from vmctl.errors import NotRunning, strip_notes
from vmctl.smolvm import GUEST_ROOT
from vmctl.spec import exec_args

__all__ = ["clis"]  # the fixture, shared with test_contract


def _stderr(cli: CLI, *args: str, env: dict[str, str] | None = None) -> bytes:
    """A call's stderr as the binary wrote it (no note stripped)."""
    r = subprocess.run(
        [cli.install.binary, *args],
        env=env or cli.env,
        capture_output=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    return r.stderr


def test_exec_user_flag_and_its_default_are_the_real_ones(clis: dict[str, CLI]) -> None:
    """Both CLIs have ``-u``/``--user`` on exec; the real one says a command without it runs
    as the machine's user, then the image's USER (what the fake models)."""
    real_help = clis["real"].raw(["machine", "exec", "--help"]).stdout.decode()
    fake_help = clis["fake"].raw(["machine", "exec", "--help"]).stdout.decode()
    assert "-u, --user <USER>" in real_help
    assert "Defaults to the machine's configured user, then the image's USER" in real_help
    for flag in ("-u", "--user"):
        assert f"  {flag}\n" in fake_help
    assert clis["real"].features.exec_user and clis["fake"].features.exec_user


def test_bottlenets_root_execs_pass_both_parsers(clis: dict[str, CLI]) -> None:
    """The gate, the reach check, the bridge, the workload's prepare, wrapper and waiter
    (``-u 0:0``, plain, ``-i`` and ``-d``) and the image-user read (no ``-u``): a machine
    that is not running is the answer from both, never a usage error."""
    assert agree(clis, "create", "--name", "r1", "--cpus", "1", "--mem", "256").ok
    cases = [
        exec_args("r1", PROBE_ARGV, interactive=True, user=GUEST_ROOT, guest_timeout=60),
        exec_args("r1", ["/bin/sh", "-s"], interactive=True, user=GUEST_ROOT),
        exec_args("r1", ["/bin/agent"], {"K": "v"}, detach=True, user=GUEST_ROOT),
        exec_args("r1", waiter_argv("r1"), interactive=True, user=GUEST_ROOT),
        exec_args("r1", IMAGE_USER_ARGV, guest_timeout=30),
    ]
    for args in cases:
        out = agree(clis, "exec", *args[2:])
        assert isinstance(out.error, NotRunning), (args, out.r.stderr)
    assert agree(clis, "delete", "--name", "r1", "-f").ok


def test_packed_note_is_the_wheels_text_and_is_stripped(clis: dict[str, CLI]) -> None:
    """The wheel's binary prints the note first on every call; the fake in ``packed-note``
    mode prints the same line; :func:`strip_notes` leaves neither."""
    real = _stderr(clis["real"], "--version")
    fake_env = dict(clis["fake"].env, FAKE_SMOLVM_FAIL="packed-note")
    fake = _stderr(clis["fake"], "--version", env=fake_env)
    first = real.splitlines()[0]
    assert first.startswith(b"note: no packed assets found for 'smol-vmm'"), real
    assert fake.splitlines()[0] == first
    assert strip_notes(real) == strip_notes(fake) == b""
    # without the mode, the fake (named smolvm) is silent, as the real binary named smolvm is
    assert _stderr(clis["fake"], "--version") == b""
    assert os.path.basename(FAKE_SMOLVM) == "smolvm"
