"""The suite does not depend on the signal dispositions it inherits.

Started as a script's background job (or by a CI runner that does the same) pytest inherits
SIGINT as ignored. The tests that stop a child with SIGINT give the child SIGINT's default
themselves (``tests.sigdefault``); this runs them in a pytest started that way (all but
``test_top_live_survives_the_daemon_going_away``, whose ``top`` is stopped the same way as
``test_top_live_exits_0_on_sigint_*``'s).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIGINT_TESTS = [
    "tests/cli/test_cli_ops.py::TopAndDownTests::test_top_live_exits_0_on_sigint_pipe",
    "tests/cli/test_cli_ops.py::TopAndDownTests::test_top_live_exits_0_on_sigint_pty",
]
if os.geteuid() == 0:  # the launcher's test needs root (it skips otherwise)
    SIGINT_TESTS.append(
        "tests/control/test_example_launcher.py::test_example_launcher_cleans_up_on_ctrl_c"
    )


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_sigint_tests_pass_when_the_suite_inherits_sigint_ignored() -> None:
    """The SIGINT tests pass in a pytest whose SIGINT is ignored (the child inherits that)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *SIGINT_TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_ignore_sigint,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    summary = done.stdout.strip().splitlines()[-1]
    expected = len(SIGINT_TESTS)
    assert re.fullmatch(rf"=* ?{expected} passed in [0-9.]+s( \(.*\))? ?=*", summary), summary
