"""``bottlenetctl selftest`` run as a user runs it, against a daemon process.

The daemon drives the fake smolvm (``tests/fakes/smolvm``, a TEST DOUBLE whose "VMs" are host
processes; with ``exec-netns``, which needs root, its exec runs in a network-less namespace, so
the launch gate has something real to check). Each fake fault that a first real boot can meet
gives exactly the FAIL line it should; against the real smolvm of the ``vm`` extra on this
host (no bootable KVM) the one FAIL is ``kvm``, and nothing is left behind.

A whole run is costly (a VM bottle made, used and destroyed): the good setup runs once, in
text, with a non-root image user; its ``--json`` report is checked over a stub daemon in
``test_selftest_unit.py`` (the failing runs here are ``--json``). A stale uid reservation is
checked here as the daemon's ``Leftovers`` answer, and the teardown line it fails there.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from bottlenet.cli.selftest import STEPS
from tests.control.vmdaemon import VMDaemon

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="the fake's isolating stand-in (exec-netns) needs root and unshare",
)


@pytest.fixture(scope="module")
def daemon() -> Iterator[VMDaemon]:
    d = VMDaemon().start()  # the default sidecar-ready timeout: no good run races it
    try:
        yield d
    finally:
        assert d.cleanup() == []


def selftest(d: VMDaemon, *args: str) -> tuple[int, dict[str, Any]]:
    """Run ``bottlenetctl --json selftest --spec`` and parse its report."""
    r = d.ctl("--json", "selftest", "--spec", d.spec, *args, timeout=300)
    report: dict[str, Any] = json.loads(r.stdout)
    assert "Traceback" not in r.stderr.decode(), r.stderr
    return r.returncode, report


def lines(report: dict[str, Any], verdict: str) -> list[str]:
    return [c["step"] for c in report["checks"] if c["verdict"] == verdict]


def test_a_good_setup_passes_every_line_one_text_line_a_check(daemon: VMDaemon) -> None:
    """A good setup whose agent image's USER is not root (the fake's images file), without
    --json: a line per check (PASS, the step, what was seen), every line PASS ending with
    teardown, exit 0; exec-user names that user (bottlenet's own execs run with -u 0); the
    bottle gone with nothing left. (A good run's --json report: test_selftest_unit.py.)"""
    daemon.fake.set_faults("exec-netns")
    daemon.fake.set_images({daemon.image: {"user": "4242:4243"}})
    try:
        r = daemon.ctl("selftest", "--spec", daemon.spec, "--name", "st-text", timeout=300)
    finally:
        daemon.fake.set_images({})
    out = r.stdout.decode().splitlines()
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr.decode(), r.stderr
    assert [line.split()[:2] for line in out][:3] == [
        ["PASS", "daemon"], ["PASS", "smolvm"], ["PASS", "privilege"]
    ]  # fmt: skip
    assert len(out) == len(STEPS) and all(line.startswith("PASS") for line in out)
    assert [line.split()[1] for line in out] == [*STEPS]  # every step once, teardown last
    (user,) = [line for line in out if line.split()[1] == "exec-user"]
    assert "4242:4243" in user  # the kit's whoami, as the image's user
    with daemon.client() as c:
        assert c.list_bottles().total == 0


def test_a_bare_image_passes_every_line_on_the_kit(daemon: VMDaemon) -> None:
    """An agent image with nothing in it (no python3, no shell, no coreutils: the fake's
    ``bare`` mode with no program at all): the selftest's own guest commands run on the kit
    (its wait-for workload, idle, procs, reach, write, read, whoami), every line PASS."""
    daemon.fake.set_faults("exec-netns")
    daemon.fake.set_images({daemon.image: {"bare": []}})
    try:
        code, report = selftest(daemon, "--name", "st-bare")
    finally:
        daemon.fake.set_images({})
    assert code == 0, report
    assert lines(report, "PASS") == [*STEPS], report
    (root,) = [c for c in report["checks"] if c["step"] == "exec-root"]
    assert root["seen"] == "`whoami (the kit's)` with -u 0 printed 0:0", root
    with daemon.client() as c:
        assert c.list_bottles().total == 0


def test_kvm_missing_is_the_one_failure(daemon: VMDaemon) -> None:
    """No usable KVM: exactly one FAIL (kvm) with the fix for a root daemon's VM uids; nothing
    left behind."""
    daemon.fake.set_faults("exec-netns", "kvm")
    code, report = selftest(daemon)
    assert code == 1 and report["ok"] is False and lines(report, "FAIL") == ["kvm"]
    kvm = next(c for c in report["checks"] if c["step"] == "kvm")
    assert kvm["seen"].startswith("KVM_UNAVAILABLE: ") and "/dev/kvm" in kvm["fix"]
    assert "2000000" in kvm["fix"]  # the test runs as root: smolvm's per-VM uids
    assert lines(report, "PASS") == ["daemon", "smolvm", "privilege", "kit", "images", "teardown"]


def test_a_missing_image_is_the_images_line_not_kvm(daemon: VMDaemon) -> None:
    """An agent image the host does not have (the quickstart's example path on a new host):
    the one FAIL is ``images``, naming the path and where a first image comes from; no VM was
    made, nothing is left (newcomer-3 trap 5)."""
    spec = os.path.join(daemon.dir, "missing-image.toml")
    with open(daemon.spec) as f:
        text = f.read().replace(daemon.image, "/var/lib/bottles/no-such-image.tar")
    with open(spec, "w") as f:
        f.write(text)
    r = daemon.ctl("--json", "selftest", "--spec", spec, timeout=300)
    report: dict[str, Any] = json.loads(r.stdout)
    assert r.returncode == 1 and lines(report, "FAIL") == ["images"], report
    images = next(c for c in report["checks"] if c["step"] == "images")
    assert "/var/lib/bottles/no-such-image.tar" in images["seen"] and "docker save" in images["fix"]
    assert lines(report, "PASS") == ["daemon", "smolvm", "privilege", "kit", "teardown"]


def test_a_sidecar_that_never_answers_fails_the_sidecar_line() -> None:
    """An exposed service that never listens: the one FAIL is sidecar, naming the service.
    A daemon of its own, whose sidecar-ready timeout (waited out here) is short: no other
    create of this module races it."""
    d = VMDaemon("--sidecar-ready-timeout", "0.5").start()
    try:
        d.fake.set_faults("exec-netns", expose_never_ready=["/run/bottlenet/egress.sock"])
        code, report = selftest(d)
    finally:
        assert d.cleanup() == []
    assert code == 1 and lines(report, "FAIL") == ["sidecar"], report
    sidecar = next(c for c in report["checks"] if c["step"] == "sidecar")
    assert sidecar["seen"].startswith("SIDECAR_NOT_READY: ") and "egress" in sidecar["seen"]
    assert lines(report, "PASS") == [
        "daemon", "smolvm", "privilege", "kit", "images", "kvm", "teardown"
    ]  # fmt: skip


def test_a_leaky_guest_fails_the_gate(daemon: VMDaemon) -> None:
    """The plain fake's exec runs on the host: the gate FAILs with its verdict."""
    daemon.fake.set_faults()
    code, report = selftest(daemon)
    assert code == 1 and lines(report, "FAIL") == ["gate"]
    gate = next(c for c in report["checks"] if c["step"] == "gate")
    assert gate["seen"].startswith("ISOLATION_FAILED: ")
    assert "teardown" in lines(report, "PASS")


def test_a_stale_uid_reservation_is_a_leftover_the_teardown_line_reads(daemon: VMDaemon) -> None:
    """A uid still reserved in smolvm's registry for a VM that is gone: the daemon's Leftovers
    (what selftest's teardown line reads) names it. That a good run with it fails that line
    alone, exit 1, is tests/cli/test_selftest_unit.py's (a whole run over a stub daemon)."""
    registry = os.path.join(daemon.fake.path, ".cache", "smolvm", "uids")
    os.makedirs(registry, exist_ok=True)
    entry = os.path.join(registry, "2065000")
    with open(entry, "w") as f:
        f.write("0123456789abcdef")  # no such VM dir
    try:
        with daemon.client() as c:
            left = c.leftovers("selftest-gone")
    finally:
        os.unlink(entry)
    assert any("uid 2065000 is still reserved for VM 0123456789abcdef" in x for x in left), left


def test_without_spec_or_images_one_error_line(daemon: VMDaemon) -> None:
    """Neither --spec nor both images: one clear error line, no traceback, nothing created."""
    r = daemon.ctl("selftest", "--agent-image", "/a.tar")
    err = r.stderr.decode()
    assert r.returncode == 1 and err.count("\n") == 1, err
    assert "selftest needs --spec FILE.toml, or --agent-image and --sidecar-image" in err
