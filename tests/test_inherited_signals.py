"""The suite does not depend on the signal dispositions it inherits.

Started as a script's background job (or by a CI runner that does the same) pytest inherits
SIGINT as ignored, and so does every child it starts. The tests that stop a child with SIGINT
give the child SIGINT's default themselves (``tests.sigdefault``); this runs them again with
SIGINT ignored in this very process while they run, which is what each child then inherits
(all but ``test_top_live_survives_the_daemon_going_away``, whose ``top`` is stopped the same
way as ``test_top_live_exits_0_on_sigint_*``'s). In process, not in a second pytest: the
children see the same disposition, and no second interpreter, collection and netguard is paid.
Twisted's reactor leaves an ignored SIGINT alone (it installs its handler only over Python's
default one), so the trial tests' children inherit it too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import unittest
from collections.abc import Callable, Iterator

#: The trial tests of ``tests/cli/test_cli_ops.py``'s ``TopAndDownTests`` that stop ``top``
#: with SIGINT.
TOP_SIGINT_TESTS = ("test_top_live_exits_0_on_sigint_pipe", "test_top_live_exits_0_on_sigint_pty")


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored in this process (so in every child it starts) for the block."""
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, saved)


def _passes(case: unittest.TestCase) -> None:
    """Run one test case; it must pass (not fail, error or skip)."""
    result = unittest.TestResult()
    case.run(result)
    problems = [text for _, text in (*result.errors, *result.failures)]
    assert result.testsRun == 1 and result.wasSuccessful(), "\n".join(problems)[-3000:]
    assert not result.skipped, result.skipped


def _launcher_test() -> Callable[[], None] | None:
    """``test_example_launcher_cleans_up_on_ctrl_c`` where it runs (root: exec-netns)."""
    if os.geteuid() != 0:
        return None
    from tests.control import test_example_launcher

    return test_example_launcher.test_example_launcher_cleans_up_on_ctrl_c


def test_sigint_tests_pass_when_the_suite_inherits_sigint_ignored() -> None:
    """The SIGINT tests pass while SIGINT is ignored in the runner (the children inherit it)."""
    from tests.cli import test_cli_ops  # a module, so that its tests are not collected here

    with _sigint_ignored():
        for name in TOP_SIGINT_TESTS:
            _passes(test_cli_ops.TopAndDownTests(name))
        launcher = _launcher_test()
        if launcher is not None:
            launcher()  # a plain function: it passes by returning
