"""bottlenetctl selftest's verdicts: each FAIL path from what was observed, without a VM."""

from __future__ import annotations

import argparse
import io
import json
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import IO, Any

import pytest

from bottlenet.cli import selftest as st
from bottlenet.cli.selftest import Check, ExecSeen, Verdict
from bottlenet.control.records import BottleRecord, EndpointRecord
from bottlenet.control.results import HelloResult
from bottlenet.errors import (
    BridgeFailed,
    InvalidArgument,
    IsolationFailed,
    KvmUnavailable,
    SmolvmFailed,
)
from vmctl import residue


def hello(available: bool = True, kit: str | None = "ready: kit 0123 (x86_64)") -> HelloResult:
    v = "1.32.2" if available else None
    return HelloResult("1.0", 1, ("vms",), available, v, None, "one", guest_kit=kit)


def record(**kw: Any) -> BottleRecord:
    base: dict[str, Any] = dict(
        name="t", alias=None, source="control", state="running", created_at=0.0, forwards=1,
        mode="socket", sidecar_vm="bn-t-sidecar", agent_vm="bn-t-agent", probe="PASS",
        bridge="running (3128)", workload="running",
        endpoints=(EndpointRecord("egress", "unix:/run/bottle/egress.sock"),),
    )  # fmt: skip
    return BottleRecord(**{**base, **kw})


def verdicts(checks: list[Check]) -> dict[str, Verdict]:
    return {c.step: c.verdict for c in checks}


def test_smolvm_unavailable_fails_with_the_fix() -> None:
    """A daemon without smolvm: the smolvm line FAILs and says how to get one."""
    checks = st.judge_hello(hello(available=False), "/c.sock")
    assert verdicts(checks) == {
        "daemon": "PASS",
        "smolvm": "FAIL",
        "privilege": "PASS",
        "kit": "PASS",
    }
    assert "bottlenet[vm]" in checks[1].fix


def test_the_kit_line_says_whether_an_image_needs_python3() -> None:
    """The kit line: PASS with the kit's digest, FAIL naming the fallback and the fix."""
    ready = st.judge_kit("ready: kit 8c61f6dea8cd (x86_64, 16.7 MiB) at /s/kit/k")
    assert ready.verdict is Verdict.PASS and "8c61f6dea8cd" in ready.seen
    off = st.judge_kit("off: turned off (--guest-kit off); guest commands use the image's python3")
    assert off.verdict is Verdict.FAIL and "--guest-kit" in off.fix


@pytest.mark.parametrize(
    ("error", "failed", "passed"),
    [
        (KvmUnavailable("KVM is not usable on this host"), "kvm", ("images",)),
        (IsolationFailed("own endpoint does not connect"), "gate", ("images", "kvm", "sidecar")),
        (BridgeFailed("bind 80: EACCES"), "bridge", ("images", "kvm", "sidecar", "gate")),
    ],
)
def test_a_create_error_fails_the_step_it_names(
    error: Exception, failed: str, passed: tuple[str, ...]
) -> None:
    """The step a create error's code names FAILs; the steps before it passed."""
    assert isinstance(error, st.BottlenetError)
    checks = st.judge_create_error(error)
    assert [c for c in checks if c.verdict is Verdict.FAIL] == [
        Check(failed, Verdict.FAIL, f"{error.code}: {error.message}", st.FIXES[failed])
    ]
    assert [c.step for c in checks if c.verdict is Verdict.PASS] == list(passed)


def test_sidecar_not_ready_fails_the_sidecar_line() -> None:
    """SIDECAR_NOT_READY (a code this client may not know as a class) is the sidecar's FAIL."""

    class NotReady(st.BottlenetError):
        code = "SIDECAR_NOT_READY"

    checks = st.judge_create_error(NotReady("service egress did not answer"))
    assert verdicts(checks) == {"images": "PASS", "kvm": "PASS", "sidecar": "FAIL"}
    assert "/run/bottlenet" in checks[-1].fix


def test_a_volume_refusal_fails_the_volume_line() -> None:
    """A create refused over a volume is the volume's FAIL, not KVM's."""
    checks = st.judge_create_error(InvalidArgument("volume /srv/x: uid 2000001 cannot write it"))
    assert verdicts(checks) == {"volume": "FAIL"}


def test_another_create_error_is_said_whole() -> None:
    """An error no step names FAILs the VM start with the daemon's own words."""
    checks = st.judge_create_error(SmolvmFailed("machine create: bad image"))
    assert verdicts(checks) == {"images": "SKIP", "kvm": "FAIL"}
    assert "SMOLVM_FAILED: machine create: bad image" in checks[1].seen


def test_a_missing_image_fails_the_images_line_not_kvm() -> None:
    """A spec image the host does not have (the quickstart's example paths on a new host) is
    the images line's FAIL, with where a first image comes from; KVM is not named
    (newcomer-3 trap 5)."""
    error = InvalidArgument("agent.image: local image '/var/lib/bottles/x.tar' does not exist")
    checks = st.judge_create_error(error)
    assert verdicts(checks) == {"images": "FAIL"}
    assert "docker save" in checks[0].fix and "docs/sidecar.md" in checks[0].fix


def test_a_skipped_gate_is_a_failure() -> None:
    """A daemon run with --unsafe-skip-isolation-probe does not pass the gate line."""
    checks = st.judge_created(record(probe="SKIPPED (--unsafe-skip-isolation-probe)"))
    assert verdicts(checks)["gate"] is Verdict.FAIL
    assert checks[-1].fix == st.FIXES["gate-skipped"]
    assert verdicts(st.judge_created(record())) == {"images": "PASS", "kvm": "PASS",
                                                    "sidecar": "PASS", "gate": "PASS"}  # fmt: skip


def test_bridge_off_or_unreachable_fails() -> None:
    """The bridge line needs a running bridge and every service port reachable in the guest."""
    assert st.judge_bridge(record(bridge="off"), {3128: "ok"}).verdict is Verdict.FAIL
    bad = st.judge_bridge(record(), {3128: "ok", 9418: "exit 1: refused"})
    assert bad.verdict is Verdict.FAIL and "127.0.0.1:9418 exit 1: refused" in bad.seen
    assert st.judge_bridge(record(), {3128: "ok"}).verdict is Verdict.PASS


def test_exec_lines() -> None:
    """exec-root wants uid 0 printed; exec-user any identity, with exit 0."""
    assert st.judge_exec_root(ExecSeen(0, "0\n", "")).verdict is Verdict.PASS
    wrong = st.judge_exec_root(ExecSeen(0, "1000\n", ""))
    assert wrong.verdict is Verdict.FAIL and "'1000'" in wrong.seen
    refused = st.judge_exec_root(ExecSeen(None, "", "", "BUSY: 6 sessions"))
    assert refused.verdict is Verdict.FAIL and "BUSY: 6 sessions" in refused.seen
    assert st.judge_exec_user(ExecSeen(0, "uid=1000(node)\n", "")).verdict is Verdict.PASS
    failed = st.judge_exec_user(ExecSeen(126, "", "unable to find user node\n"))
    assert failed.verdict is Verdict.FAIL and "unable to find user node" in failed.seen


def test_volume_round_trip_both_ways() -> None:
    """Each direction of the volume round trip can fail on its own."""
    ok = st.judge_volume("/v", None, "a", "b", "a", "b")
    assert ok.verdict is Verdict.PASS
    guest = st.judge_volume("/v", "the guest's write: exit 1", None, "b", "a", "b")
    assert guest.verdict is Verdict.FAIL and "guest to host" in guest.seen
    host = st.judge_volume("/v", None, "a", None, "a", "b")
    assert host.verdict is Verdict.FAIL and "host to guest" in host.seen


def test_workload_line() -> None:
    """The workload must run until told, exit 7 and leave its line in the logs."""
    mark = st.WORKLOAD_MARK
    assert st.judge_workload("running", 7, mark).verdict is Verdict.PASS
    assert st.judge_workload("exited", 7, mark).verdict is Verdict.FAIL
    assert st.judge_workload("running", 127, mark).verdict is Verdict.FAIL
    assert st.judge_workload("running", 7, "").verdict is Verdict.FAIL


def test_events_in_order() -> None:
    """The bottle's life must appear on the event stream, in order."""
    assert st.judge_events(["created", "ready", "workload_exited", "destroyed"]).verdict == "PASS"
    late = st.judge_events(["created", "workload_exited", "ready", "destroyed"])
    assert late.verdict is Verdict.FAIL and "ready" in late.seen
    assert st.judge_events([]).verdict is Verdict.FAIL


def test_teardown_line() -> None:
    """A failed destroy or any leftover FAILs the teardown line, naming it."""
    assert st.judge_teardown(None, []).verdict is Verdict.PASS
    left = st.judge_teardown(None, ["machine bn-t-agent still exists (running)"])
    assert left.verdict is Verdict.FAIL and "bn-t-agent" in left.seen
    assert st.judge_teardown("SMOLVM_FAILED: x", []).verdict is Verdict.FAIL


def test_workload_waits_for_its_go_file_with_a_bound() -> None:
    """The workload is plain POSIX sh that waits for its go file, bounded, then exits 7."""
    argv = st.GuestTools().workload("b1")
    assert argv[:2] == ["/bin/sh", "-c"]
    assert "/tmp/.bottlenet-selftest-go-b1" in argv[2] and f"-lt {st.WORKLOAD_WAIT * 10}" in argv[2]
    assert argv[2].endswith(f"exit {st.WORKLOAD_EXIT}")


def test_spec_from_images_and_from_a_file() -> None:
    """The throwaway spec adds the selftest's workload and volume to the user's spec."""
    args = argparse.Namespace(name="b1", agent_image="/a.tar", sidecar_image="side",
                              service=["egress:3128", "git:9418"])  # fmt: skip
    doc = st.build_spec(None, args, "/var/tmp/v")
    assert [s["guest_port"] for s in doc["sidecar"]["service"]] == [3128, 9418]
    assert doc["agent"]["volumes"] == ["/var/tmp/v:/var/tmp/v:rw"]
    base: dict[str, Any] = {
        "mode": "socket",
        "agent": {"image": "/a.tar", "volumes": ["/p:/work:ro"]},
    }
    doc = st.build_spec(base, args, "/var/tmp/v")
    assert doc["agent"]["volumes"] == ["/p:/work:ro", "/var/tmp/v:/var/tmp/v:rw"]
    assert base["agent"]["volumes"] == ["/p:/work:ro"]  # the user's own value is untouched


class _Scripted(st.Run):
    def __init__(self, checks: list[Check]) -> None:
        self._scripted = checks

    def _steps(self) -> Iterator[Check]:
        yield from self._scripted


def test_every_step_once_in_order() -> None:
    """Steps a run passed by are SKIP, in their place, and each step is reported once."""
    run = _Scripted([Check("daemon", Verdict.PASS, ""), Check("kvm", Verdict.FAIL, "x"),
                     Check("teardown", Verdict.PASS, "")])  # fmt: skip
    lines = list(run.checks())
    assert [c.step for c in lines] == list(st.STEPS)
    assert [c.step for c in lines if c.verdict is Verdict.SKIP] == [
        s for s in st.STEPS if s not in ("daemon", "kvm", "teardown")
    ]


def test_render_cleans_what_the_daemon_said() -> None:
    """Control characters from the daemon or guest never reach the terminal raw."""
    text = st.render(Check("gate", Verdict.FAIL, "evil\x1b[2Jline", "fix it"))
    assert "\x1b" not in text and "fix: fix it" in text


# -- vmctl.residue: smolvm's uid registry and /proc, read as hostile ground --------------------


def _registry(tmp: str) -> tuple[str, str]:
    reg = os.path.join(tmp, ".cache", "smolvm", "uids")
    vms = os.path.join(tmp, ".cache", "smolvm", "vms")
    os.makedirs(reg)
    os.makedirs(vms)
    return reg, vms


def test_stale_reservations(tmp_path: Any) -> None:
    """An entry whose VM dir is gone is stale, and so is a process that still runs as it."""
    reg, vms = _registry(str(tmp_path))
    os.makedirs(os.path.join(vms, "live"))
    for uid, vm in ((2000000, "live"), (2000001, "gone")):
        with open(os.path.join(reg, str(uid)), "w") as f:
            f.write(vm)
    assert residue.stale_reservations(str(tmp_path)) == {2000001: "gone"}
    proc = tmp_path / "proc"
    for pid, uid in ((10, 2000000), (11, 2000001), (12, 0)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "status").write_text(f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    assert residue.uid_leftovers(str(tmp_path), proc_root=str(proc)) == [
        "uid 2000001 is still reserved for VM gone, whose directory is gone",
        "pid 11 still runs as VM uid 2000001, whose machine is gone",
    ]


def test_planted_entries_are_not_followed_or_waited_on(tmp_path: Any) -> None:
    """A FIFO, a symlink or a path-like id in the registry is stale, never opened through."""
    reg, vms = _registry(str(tmp_path))
    os.makedirs(os.path.join(vms, "live"))
    target = os.path.join(str(tmp_path), "t")
    with open(target, "w") as f:
        f.write("live")
    os.mkfifo(os.path.join(reg, "2000002"))
    os.symlink(target, os.path.join(reg, "2000003"))
    with open(os.path.join(reg, "2000004"), "w") as f:
        f.write("../vms/live")
    done: list[dict[int, str]] = []
    reader = threading.Thread(target=lambda: done.append(residue.stale_reservations(str(tmp_path))))
    reader.daemon = True  # a reader stuck on the FIFO must not hold the test run
    reader.start()
    reader.join(30)
    assert done, "stale_reservations blocked on a FIFO in the registry"
    assert set(done[0]) == {2000002, 2000003, 2000004}


def test_kvm_fix_fits_the_privilege_model() -> None:
    """Under per-VM uids the KVM fix speaks of smolvm's VM uids, else of the kvm group."""
    error = KvmUnavailable("KVM is not usable on this host")
    assert "kvm group" in st.judge_create_error(error)[-1].fix
    assert "2000000" in st.judge_create_error(error, per_vm_uids=True)[-1].fix


def test_skips_say_which_step_failed() -> None:
    """A step not reached says which failed step stopped the run."""
    run = _Scripted([Check("daemon", Verdict.PASS, ""), Check("kvm", Verdict.FAIL, "x")])
    skipped = [c for c in run.checks() if c.verdict is Verdict.SKIP]
    assert {c.seen for c in skipped if st.STEPS.index(c.step) > st.STEPS.index("kvm")} == {
        "not reached (kvm failed)"
    }


def test_session_end_line() -> None:
    """The command must show in the guest, then be gone after its session ended."""
    assert st.judge_session_end(True, True, 30).verdict is Verdict.PASS
    stayed = st.judge_session_end(True, False, 30)
    assert stayed.verdict is Verdict.FAIL and "still ran 30 s" in stayed.seen
    assert st.judge_session_end(False, True, 30).verdict is Verdict.FAIL


def test_the_counter_does_not_count_itself() -> None:
    """The guest-side counter finds a process by its marker, and never its own argv."""
    import subprocess
    import sys

    marker = "bottlenet-selftest-unit-" + os.urandom(4).hex()
    count = [sys.executable, "-c", st.COUNTER, marker[::-1]]
    assert subprocess.run(count, capture_output=True, text=True, check=True).stdout == "0\n"
    sleeper = subprocess.Popen([sys.executable, "-c", st.SLEEPER, marker])
    try:
        seen = subprocess.run(count, capture_output=True, text=True, check=True).stdout
    finally:
        sleeper.kill()
        sleeper.wait()
    assert seen == "1\n"


def test_the_host_side_of_the_volume_trusts_nothing_the_guest_put_there(tmp_path: Any) -> None:
    """A FIFO is not read (no block), and a planted link is never written through."""
    fifo = tmp_path / "from-guest"
    os.mkfifo(fifo)
    assert st._read_text(str(fifo)) is None
    target = tmp_path / "target"
    target.write_text("keep\n")
    (tmp_path / "from-host").symlink_to(target)
    st._write_new(str(tmp_path / "from-host"), "token\n")
    assert target.read_text() == "keep\n"
    st._write_new(str(tmp_path / "fresh"), "token\n")
    assert st._read_text(str(tmp_path / "fresh")) == "token"


# -- a whole run over a daemon that answers as a good setup's does ----------------------------


class _GoodDaemon:
    """What :class:`st.Run` reads from a daemon whose bottle passes every check, without a
    daemon or a VM: its guest commands are answered here (the volume's on the host, for
    real), and its ``Leftovers`` answer is the test's."""

    path = "/c.sock"

    def __init__(self, leftovers: Sequence[str]) -> None:
        self.leftovers = tuple(leftovers)
        self.running: set[str] = set()  # markers of the attached commands that still run
        self.told: list[str] = []

    def hello(self) -> Any:
        """Before the create as the daemon's uid implies it; after, as its VMs showed it."""
        basis = "seen: bn-st-unit-sidecar's VM process ran as uid 2000001"
        return hello()._replace(vm_uids_basis=basis if "CreateBottle" in self.told else None)

    def watch(self, bottle: str) -> None:
        pass

    def call(self, c: Any) -> Any:
        self.told.append(c.command)
        answers = {
            "CreateBottle": record(name=c.arguments.get("name")),
            "BottleStatus": record(),
            "DestroyBottle": None,
            "Leftovers": self.leftovers,
        }
        return answers[c.command]

    def exec(self, bottle: str, argv: Sequence[str], *, stdout: IO[bytes], **kw: Any) -> int:
        argv = list(argv)
        if argv == ["id", "-u"]:
            stdout.write(b"0\n")
        elif argv == ["id"]:
            stdout.write(b"uid=0(root) gid=0(root)\n")
        elif argv[:3] == ["python3", "-c", st.COUNTER]:
            stdout.write(b"%d\n" % (argv[3][::-1] in self.running))
        elif argv[:2] == ["/bin/sh", "-c"]:  # the guest's write: echo TOKEN > VOLUME/from-guest
            _, token, _, path = argv[2].split()
            with open(path, "w") as f:
                f.write(token + "\n")
        elif argv[0] == "cat":
            with open(argv[1], "rb") as f:
                stdout.write(f.read())
        return 0  # and the bridge's connect to each service port, the workload's go file

    @contextmanager
    def start_exec(self, request: Any) -> Iterator[None]:
        self.running.add(request.argv[-1])
        try:
            yield None
        finally:
            self.running.discard(request.argv[-1])  # its session ended, and so did it

    def events(self, bottle: str, *, idle: float) -> Iterator[Any]:
        if "DestroyBottle" in self.told:
            yield SimpleNamespace(kind="destroyed", exit_code=None)
            return
        for kind in ("created", "ready"):
            yield SimpleNamespace(kind=kind, exit_code=None)
        yield SimpleNamespace(kind="workload_exited", exit_code=st.WORKLOAD_EXIT)

    def logs(self, bottle: str, *, stdout: IO[bytes], **kw: Any) -> None:
        stdout.write(st.WORKLOAD_MARK.encode() + b"\n")


def _run(daemon: _GoodDaemon, volume: str) -> tuple[bool, dict[str, Any]]:
    """``cmd_selftest --json`` against ``daemon``: whether it raised SelftestFailed (bottlenetctl
    exits 1 on it), and its report."""
    options = argparse.Namespace(name="st-unit", agent_image=None, sidecar_image=None,
                                 service=None, volume_dir=volume)  # fmt: skip
    inv: Any = SimpleNamespace(options=options, spec_json=json.dumps({"mode": "socket"}),
                               json=True, vm_timeout=60.0)  # fmt: skip
    out = io.StringIO()
    try:
        st.cmd_selftest(daemon, inv, out)  # type: ignore[arg-type]
    except st.SelftestFailed:
        return True, json.loads(out.getvalue())
    return False, json.loads(out.getvalue())


def test_a_good_runs_json_report_passes_every_line(tmp_path: Any) -> None:
    """``--json`` on a good setup: ok, no failure (exit 0), every step PASS once, in order,
    teardown last. (The whole run against a daemon process is test_selftest.py's, in text.)"""
    failed, report = _run(_GoodDaemon([]), str(tmp_path))
    assert not failed and report["ok"] is True and report["bottle"] == "st-unit"
    assert [(c["step"], c["verdict"]) for c in report["checks"]] == [
        (step, "PASS") for step in st.STEPS
    ], report
    [privilege] = [c for c in report["checks"] if c["step"] == "privilege"]
    assert privilege["seen"] == "one (seen: bn-st-unit-sidecar's VM process ran as uid 2000001)"


def test_a_stale_uid_reservation_fails_the_teardown_line_alone(tmp_path: Any) -> None:
    """The same good run, but the daemon's Leftovers names a uid still reserved for a VM that
    is gone: the one FAIL is teardown, saying it, and the command fails (exit 1). The daemon's
    side (Leftovers reads smolvm's registry) is test_selftest.py's."""
    left = "uid 2065000 is still reserved for VM 0123456789abcdef, whose directory is gone"
    failed, report = _run(_GoodDaemon([left]), str(tmp_path))
    verdicts = [(c["step"], c["verdict"]) for c in report["checks"]]
    assert failed and report["ok"] is False
    assert [step for step, v in verdicts if v == "FAIL"] == ["teardown"], report
    assert [step for step, v in verdicts if v == "PASS"] == list(st.STEPS[:-1])
    teardown = report["checks"][-1]
    assert teardown["step"] == "teardown"
    assert "uid 2065000 is still reserved for VM 0123456789abcdef" in teardown["seen"]


def test_a_known_code_names_its_step_even_when_its_message_says_volume() -> None:
    """An ISOLATION_FAILED naming a writable read-only volume is the gate's failure (its
    code says so), not the volume step's."""
    error = IsolationFailed("leak: the read-only volume /data is writable in the guest")
    checks = st.judge_create_error(error)
    assert [(c.step, c.verdict) for c in checks if c.verdict is not Verdict.PASS] == [
        ("gate", Verdict.FAIL)
    ]


def test_a_service_port_of_0_is_refused(tmp_path: Any) -> None:
    """``--service NAME:0`` is not a port: refused before anything is made."""
    daemon = _GoodDaemon([])
    options = argparse.Namespace(name="st-unit", agent_image=None, sidecar_image=None,
                                 service=["egress:0"], volume_dir=str(tmp_path))  # fmt: skip
    inv: Any = SimpleNamespace(options=options, spec_json=json.dumps({"mode": "socket"}),
                               json=True, vm_timeout=60.0)  # fmt: skip
    with pytest.raises(InvalidArgument, match="a port 1-65535"):
        st.cmd_selftest(daemon, inv, io.StringIO())  # type: ignore[arg-type]
    assert daemon.told == []


def test_a_run_that_skips_its_steps_fails(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that ends early with SKIP lines and no FAIL (nothing was checked) is no pass:
    ``ok`` is false and the command fails (exit 1)."""

    class Skipping:
        def __init__(self, *args: Any) -> None:
            pass

        def checks(self) -> Iterator[Check]:
            yield Check("daemon", Verdict.PASS, "ok")
            for step in st.STEPS[1:]:
                yield Check(step, Verdict.SKIP, "not reached")

    monkeypatch.setattr(st, "Run", Skipping)
    failed, report = _run(_GoodDaemon([]), str(tmp_path))
    assert failed and report["ok"] is False
