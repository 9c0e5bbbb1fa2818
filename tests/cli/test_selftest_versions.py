"""The self-test's ``smolvm`` line for an untested version, and its fix for a stale uid
reservation (issue 35; newcomer-3 traps 9 and 10)."""

from __future__ import annotations

from bottlenet.cli import selftest as st
from bottlenet.cli.selftest import Verdict
from bottlenet.control.results import HelloResult


def hello(version: str, tested: bool | None) -> HelloResult:
    return HelloResult(
        "1.0", 1, ("vms",), True, version, "/x/smol-vmm (from --smolvm)", "one", None, tested,
        ("1.32.2", "1.37.3"),
    )  # fmt: skip


def test_an_untested_smolvm_is_a_warn_naming_the_tested_versions() -> None:
    """1.38.0: WARN (not PASS, not FAIL) naming 1.32.2 and 1.37.3, with a fix; a tested one,
    or an older daemon that does not say, PASSes."""
    (line,) = [c for c in st.judge_hello(hello("1.38.0", False), "/c") if c.step == "smolvm"]
    assert line.verdict is Verdict.WARN
    assert "1.38.0 is untested" in line.seen and "1.32.2 and 1.37.3" in line.seen
    assert line.fix
    for tested in (True, None):
        (ok,) = [c for c in st.judge_hello(hello("1.37.3", tested), "/c") if c.step == "smolvm"]
        assert ok.verdict is Verdict.PASS


def test_a_warn_alone_does_not_fail_the_run() -> None:
    """The run fails on FAIL and SKIP lines only: a WARN is said, not counted."""
    checks = [st.Check("smolvm", Verdict.WARN, "untested"), st.Check("kvm", Verdict.PASS, "")]
    assert [c for c in checks if c.verdict not in (Verdict.PASS, Verdict.WARN)] == []


def test_a_stale_uid_reservation_names_how_to_remove_it() -> None:
    """Trap 10: no machine to delete, so the fix names the registry file, the ps check and
    rm; a machine left too gets both fixes."""
    uid = "uid 2000000 is still reserved for VM 08081a742beae9db, whose directory is gone"
    line = st.judge_teardown(None, [uid])
    assert line.verdict is Verdict.FAIL
    assert ".cache/smolvm/uids/" in line.fix and "ps -u" in line.fix and "rm" in line.fix
    assert "smolvm machine delete" not in line.fix
    both = st.judge_teardown(None, ["machine bn-t-agent still exists (running)", uid])
    assert "smolvm machine delete" in both.fix and ".cache/smolvm/uids/" in both.fix
