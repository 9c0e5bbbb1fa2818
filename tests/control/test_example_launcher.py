"""``examples/launcher.py`` end to end against the fake smolvm (non-interactive form): it
creates a VM bottle, prints the stamped env, runs the command, destroys the bottle, and
nothing is left: no bottle, no machine, no fake VM or guest process, no state."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from tests.sigdefault import sigint_default

from .daemon_helpers import ENV, REPO
from .vmdaemon import VMDaemon, wait_for

EXAMPLE = os.path.join(REPO, "examples", "launcher.py")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="exec-netns (unshare) needs root")


def argv(d: VMDaemon, *extra: str) -> list[str]:
    return [
        sys.executable,
        EXAMPLE,
        "--control",
        d.control,
        "--agent-image",
        d.image,
        "--sidecar-image",
        "registry.example/sidecar:1",
        "--name",
        "ex1",
        *extra,
    ]


def assert_nothing_left(d: VMDaemon) -> None:
    with d.client() as c:
        assert list(c.all_bottles()) == []
    assert d.fake.state()["machines"] == {}
    wait_for(lambda: d.fake.live_pids() == [], 30, "every fake process to end")
    with open(os.path.join(d.state, "state.json")) as f:
        assert json.load(f)["bottles"] == {}
    assert not os.path.exists(os.path.join(d.state, "bottles", "ex1"))


def test_example_launcher_runs_and_leaves_nothing() -> None:
    d = VMDaemon().start()
    try:
        r = subprocess.run(
            argv(d, "--command", 'echo "proxy=$HTTPS_PROXY"; echo oops >&2; exit 3'),
            env=ENV,
            cwd=REPO,
            capture_output=True,
            timeout=180,
        )
        out = r.stdout.decode()
        assert r.returncode == 3, (out, r.stderr, d.log())
        assert "bottle ex1: ready" in out
        assert "  HTTPS_PROXY=http://127.0.0.1:3128" in out
        assert "proxy=http://127.0.0.1:3128" in out
        assert b"oops" in r.stderr and b"bottle ex1 destroyed" in r.stderr
        assert_nothing_left(d)
    finally:
        assert not d.cleanup()


def test_example_launcher_cleans_up_on_ctrl_c() -> None:
    d = VMDaemon().start()
    try:
        p = subprocess.Popen(
            argv(d, "--command", "echo running; exec sleep 1000"),
            env=ENV,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=sigint_default,
        )
        assert p.stdout is not None
        seen = b""
        deadline = time.monotonic() + 120
        while b"running" not in seen:
            assert time.monotonic() < deadline, seen
            if select.select([p.stdout], [], [], 1)[0]:
                chunk = os.read(p.stdout.fileno(), 4096)
                assert chunk, seen
                seen += chunk
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 130, err
        assert b"bottle ex1 destroyed" in err
        assert_nothing_left(d)
    finally:
        assert not d.cleanup()


def test_example_launcher_defaults_to_bottlenetctls_control_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Without --control or $BOTTLENET_CONTROL it dials the daemon's default socket (as
    bottlenetctl does), not a usage error."""
    env = {k: v for k, v in ENV.items() if k != "BOTTLENET_CONTROL"}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    r = subprocess.run(
        [sys.executable, EXAMPLE, "--agent-image", "/x/agent.tar", "--sidecar-image", "s:1"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    expected = os.path.join(str(tmp_path), "bottlenet", "control.sock")
    assert r.returncode != 2, r.stderr
    assert f"cannot reach the bottlenet daemon at {expected}" in r.stderr
