"""The fake smolvm itself (a test double): CLI forms, exit codes, and the leak-free fixture."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from tests.fakes import FAKE_SMOLVM, PLAYED, PLAYS_137, FakeSmolvm, process_alive


def run(fake: FakeSmolvm, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FAKE_SMOLVM, *args],
        env=fake.environ(SMOLVM_DATA_DIR=fake.path, **env),
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )


def test_version_and_override(fake_smolvm: FakeSmolvm) -> None:
    assert run(fake_smolvm, "--version").stdout == f"smolvm {PLAYED}\n"
    assert run(fake_smolvm, "-V", FAKE_SMOLVM_VERSION="1.7.0").stdout == "smolvm 1.7.0\n"
    fake_smolvm.set_faults(version="1.6.4")
    assert run(fake_smolvm, "--version").stdout == "smolvm 1.6.4\n"


def test_usage_errors_exit_2(fake_smolvm: FakeSmolvm) -> None:
    for args in (
        ["machine", "create", "positional"],
        ["machine", "create", "--name", "a", "-p", "127.0.0.1:80:80"],
        ["machine", "create", "--name", "a", "-p", "0:80"],
        ["machine", "frobnicate"],
        ["machine", "exec", "-n", "a", "--", "true"],  # exec has no -n
        ["machine", "delete"],
    ):
        r = run(fake_smolvm, *args)
        assert r.returncode == 2, args
        assert r.stderr.startswith("error: "), args


def test_runtime_errors_exit_1(fake_smolvm: FakeSmolvm) -> None:
    r = run(fake_smolvm, "machine", "start", "--name", "nope")
    assert (r.returncode, r.stderr) == (1, "Error: vm not found: nope\n")
    r = run(fake_smolvm, "machine", "status", "--name", "nope", "--json")
    assert ("vm not found: nope" if PLAYS_137 else "machine 'nope' not found") in r.stderr
    r = run(fake_smolvm, "machine", "create", "--name", "a", "-v", "/nonexistent-xyz:/g")
    assert (r.returncode, r.stderr) == (1, "Error: mount source not found: /nonexistent-xyz\n")
    # 1.32 accepts a registry image on a network-less machine at create; 1.9 refused it.
    r = run(
        fake_smolvm, "machine", "create", "--name", "a", "-I", "alpine", FAKE_SMOLVM_VERSION="1.9.2"
    )
    assert r.returncode == 1 and "must be pulled from a registry" in r.stderr
    r = run(fake_smolvm, "machine", "create", "--name", "a", "-I", "alpine")
    assert r.returncode == 0


def test_json_errors_and_state_dir(fake_smolvm: FakeSmolvm, tmp_path: Path) -> None:
    state = str(tmp_path / "s")
    r = run(fake_smolvm, "machine", "start", "--state-dir", state, "--error-format", "json",
            "--name", "nope")  # fmt: skip
    assert json.loads(r.stderr) == {"error": {"code": "NOT_FOUND", "message": "vm not found: nope"}}
    r = run(fake_smolvm, "machine", "create", "--state-dir", state, "--name", "a")
    assert r.returncode == 0 and os.path.exists(os.path.join(state, "fake-state.json"))
    assert run(fake_smolvm, "machine", "ls", "--json").stdout.strip() == "[]"  # other state


def test_failed_start_leaves_an_orphan_only_stop_kills(fake_smolvm: FakeSmolvm) -> None:
    """As smolvm: agent.pid is written before the ready wait and the record turns running
    only at the end, so a start killed half-way leaves a VMM behind a `created` record;
    delete does not kill it, stop does."""
    fake_smolvm.set_faults("slow-start", slow_start=30)
    assert run(fake_smolvm, "machine", "create", "--name", "a").returncode == 0
    env = fake_smolvm.environ(SMOLVM_DATA_DIR=fake_smolvm.path)
    p = subprocess.Popen([FAKE_SMOLVM, "machine", "start", "--name", "a"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 20
    while not fake_smolvm.live_pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    [vmm] = fake_smolvm.live_pids()
    p.kill()
    p.wait()
    [listed] = json.loads(run(fake_smolvm, "machine", "ls", "--json").stdout)
    assert (listed["state"], listed["pid"]) == ("created", None)
    assert process_alive(vmm)
    r = run(fake_smolvm, "machine", "stop", "--name", "a")
    assert r.returncode == 0 and "orphaned _boot-vm" in r.stderr
    assert not process_alive(vmm)


def test_unreachable_is_a_live_vmm(fake_smolvm: FakeSmolvm) -> None:
    assert run(fake_smolvm, "machine", "create", "--name", "a").returncode == 0
    assert run(fake_smolvm, "machine", "start", "--name", "a").returncode == 0
    fake_smolvm.set_faults(unreachable=["a"])
    [listed] = json.loads(run(fake_smolvm, "machine", "ls", "--json").stdout)
    assert listed["state"] == "unreachable" and process_alive(listed["pid"])
    assert listed["state_reason"]


def test_entrypoint_runs_on_start_unless_a_command_replaces_it(
    fake_smolvm: FakeSmolvm, tmp_path: Path
) -> None:
    marker = tmp_path / "entrypoint-ran"
    image = tmp_path / "img.tar"
    image.write_bytes(b"x")
    fake_smolvm.set_images({str(image): {"entrypoint": ["/bin/sh", "-c", f"date > {marker}"]}})
    for name, cmd in (("wait", ["--", "sleep", "infinity"]), ("plain", [])):
        assert run(fake_smolvm, "machine", "create", "--name", name, "-I", str(image),
                   *cmd).returncode == 0  # fmt: skip
    assert run(fake_smolvm, "machine", "start", "--name", "wait").returncode == 0
    assert not marker.exists()
    assert run(fake_smolvm, "machine", "start", "--name", "plain").returncode == 0
    deadline = time.monotonic() + 20
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.exists()


def test_calls_recorded_and_cleanup_kills(fake_smolvm: FakeSmolvm) -> None:
    assert run(fake_smolvm, "machine", "create", "--name", "a", "--label", "k=v").returncode == 0
    r = run(fake_smolvm, "machine", "start", "--name", "a")
    assert r.returncode == 0 and r.stderr == "Starting machine 'a'...\n"
    pid = int(r.stdout.split("PID: ")[1].rstrip(")\n"))
    assert process_alive(pid)
    with open(fake_smolvm.path + "/" + "calls.jsonl") as f:
        calls = [json.loads(line) for line in f]
    assert [c["argv"][:2] for c in calls] == [["machine", "create"], ["machine", "start"]]
    assert calls[0]["env"]["SMOLVM_DATA_DIR"] == fake_smolvm.path
    [listed] = json.loads(run(fake_smolvm, "machine", "ls", "--json").stdout)
    assert (listed["name"], listed["state"], listed["pid"], listed["labels"]) == (
        "a",
        "running",
        pid,
        {"k": "v"},
    )
    assert fake_smolvm.live_pids() == [pid]
    assert fake_smolvm.cleanup() == []
    assert not process_alive(pid)
    assert json.loads(run(fake_smolvm, "machine", "ls", "--json").stdout)[0]["state"] == "stopped"


def test_exec_detached_pid_recorded(fake_smolvm: FakeSmolvm) -> None:
    run(fake_smolvm, "machine", "create", "--name", "a")
    run(fake_smolvm, "machine", "start", "--name", "a")
    r = run(fake_smolvm, "machine", "exec", "--name", "a", "-d", "--", "sleep", "30")
    pid = int(r.stdout)
    assert pid in fake_smolvm.live_pids()
    # the fixture's teardown kills it (and the VM) and asserts nothing survives


def _machine(fake: FakeSmolvm, *create: str) -> None:
    assert run(fake, "machine", "create", "--name", "a", *create).returncode == 0
    assert run(fake, "machine", "start", "--name", "a").returncode == 0


def _state(fake: FakeSmolvm) -> str:
    [listed] = json.loads(run(fake, "machine", "ls", "--json").stdout)
    state: str = listed["state"]
    return state


def test_the_agent_serves_a_few_connections_at_once(fake_smolvm: FakeSmolvm) -> None:
    """``agent_connections`` (issue 27 item 4): with every connection held by a session the
    state ping fails (``unreachable``) and the next exec waits until one ends."""
    fake_smolvm.set_faults(agent_connections=2)
    _machine(fake_smolvm)
    env = fake_smolvm.environ(SMOLVM_DATA_DIR=fake_smolvm.path)
    held = [
        subprocess.Popen(
            [FAKE_SMOLVM, "machine", "exec", "--name", "a", "-i", "--", "sh", "-c", "echo in; cat"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    for p in held:
        assert p.stdout is not None and p.stdout.readline() == b"in\n"
    assert _state(fake_smolvm) == "unreachable"
    third = subprocess.Popen(
        [FAKE_SMOLVM, "machine", "exec", "--name", "a", "--", "echo", "third"],
        env=env,
        stdout=subprocess.PIPE,
    )
    for p in held:
        p.communicate(b"", timeout=30)
    out, _ = third.communicate(timeout=30)
    assert (third.returncode, out) == (0, b"third\n")
    assert _state(fake_smolvm) == "running"


def test_an_interactive_timeout_kills_only_the_wrapper(fake_smolvm: FakeSmolvm) -> None:
    """``exec -i --timeout`` (issue 27 item 5): exit 124, and the command lives on."""
    _machine(fake_smolvm)
    pidfile = os.path.join(fake_smolvm.path, "cmd.pid")
    r = subprocess.run(
        [FAKE_SMOLVM, "machine", "exec", "--name", "a", "-i", "--timeout", "1s", "--",
         "sh", "-c", f"echo $$ > {pidfile}; exec sleep 300"],
        env=fake_smolvm.environ(SMOLVM_DATA_DIR=fake_smolvm.path),
        stdin=subprocess.PIPE,
        capture_output=True,
        timeout=30,
    )  # fmt: skip
    assert r.returncode == 124
    with open(pidfile) as fh:
        assert process_alive(int(fh.read()))  # the fixture's cleanup kills it


def test_exposed_services_drop_connections_until_ready(fake_smolvm: FakeSmolvm) -> None:
    """``expose_never_ready`` (issue 27 item 10): the socket is bound but every connection is
    dropped; a service not named answers (echo)."""
    import socket

    fake_smolvm.set_faults(expose_never_ready=["/run/slow.sock"])
    slow, fast = (os.path.join(fake_smolvm.path, n) for n in ("slow.sock", "fast.sock"))
    _machine(
        fake_smolvm, "--expose-socket", f"/run/slow.sock:{slow}", "--expose-socket",
        f"/run/fast.sock:{fast}",
    )  # fmt: skip
    for path, answer in ((slow, b""), (fast, b"ping")):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(20)
            s.connect(path)
            try:
                s.sendall(b"ping")
                got = s.recv(4)
            except (BrokenPipeError, ConnectionResetError):  # dropped before or after the send
                got = b""
            assert got == answer, path
