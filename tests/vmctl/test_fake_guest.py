"""The fake smolvm's guest modes (a TEST DOUBLE; ``docs/smolvm.md``, "The fake's guest
modes"): the image's USER and PATH, the main container's command on that PATH, the guest's
``/tmp`` and ``/run``. Each models what the real smolvm does in a booted guest (its source is
named there); these tests show the fake really does it, so bottlenet's answers are tested
against something that fails the way a real guest would."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.fakes import FAKE_SMOLVM, FakeSmolvm

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="a user drop and exec-netns need root")

IMAGE = "registry.example/agent:1"
#: In the guest: a raw ICMP socket (the launch gate's control tries it first), then a bind of
#: port 80. (An unprivileged datagram ICMP socket needs ``ping_group_range``: ``1 0`` here.)
PRIVILEGED = (
    "import socket\n"
    "socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 80)); s.close(); print('privileged')\n"
)


def run(fake: FakeSmolvm, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FAKE_SMOLVM, *args],
        env=fake.environ(SMOLVM_DATA_DIR=fake.path, PATH="/opt/host-only:/usr/bin:/bin"),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def machine(fake: FakeSmolvm, image: dict[str, object], *cmd: str) -> None:
    """``m1`` from IMAGE (its config in ``fake-images.json``), created with ``-- cmd``."""
    fake.set_images({IMAGE: image})
    rest = ["--", *cmd] if cmd else []
    r = run(fake, "machine", "create", "--name", "m1", "-I", IMAGE, *rest)
    assert r.returncode == 0, r.stderr


def guest(
    fake: FakeSmolvm, *argv: str, user: str | None = None
) -> subprocess.CompletedProcess[str]:
    who = ["-u", user] if user else []
    return run(fake, "machine", "exec", "--name", "m1", *who, "--", *argv)


@root_only
def test_image_user_has_no_capability_and_root_has_all(fake_smolvm: FakeSmolvm) -> None:
    """Without ``-u`` a command runs as the image's USER with no capability (no ICMP socket,
    no bind below 1024, no ``/run/bottlenet``); ``-u 0:0`` runs it as root, which can."""
    fake_smolvm.set_faults("exec-netns")
    machine(fake_smolvm, {"user": "4242:4243"}, "sleep", "infinity")
    assert run(fake_smolvm, "machine", "start", "--name", "m1").returncode == 0
    r = guest(fake_smolvm, "/bin/sh", "-c", "id -u; id -g; grep ^CapEff /proc/self/status")
    assert r.stdout.split() == ["4242", "4243", "CapEff:", "0000000000000000"], r
    r = guest(fake_smolvm, "/usr/bin/python3", "-I", "-c", PRIVILEGED)
    assert r.returncode == 1 and "PermissionError" in r.stderr, r
    r = guest(fake_smolvm, "mkdir", "/run/bottlenet")
    assert r.returncode == 1 and "Permission denied" in r.stderr, r
    r = guest(fake_smolvm, "/usr/bin/python3", "-I", "-c", PRIVILEGED, user="0:0")
    assert (r.returncode, r.stdout) == (0, "privileged\n"), r
    assert guest(fake_smolvm, "mkdir", "/run/bottlenet", user="0:0").returncode == 0


def test_guest_path_is_the_images_never_the_hosts(fake_smolvm: FakeSmolvm) -> None:
    """A guest command's PATH is the image's Env, or smolvm's default when it sets none;
    the CLI's own PATH (``/opt/host-only:...``) never reaches it."""
    machine(fake_smolvm, {}, "sleep", "infinity")
    assert run(fake_smolvm, "machine", "start", "--name", "m1").returncode == 0
    r = guest(fake_smolvm, "/bin/sh", "-c", 'echo "$PATH"')
    assert r.stdout == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n", r
    run(fake_smolvm, "machine", "delete", "--name", "m1", "-f")
    machine(fake_smolvm, {"env": ["PATH=/usr/bin:/bin", "LANG=C"]}, "sleep", "infinity")
    assert run(fake_smolvm, "machine", "start", "--name", "m1").returncode == 0
    r = guest(fake_smolvm, "/bin/sh", "-c", 'echo "$PATH $LANG"')
    assert r.stdout == "/usr/bin:/bin C\n", r


def test_start_fails_when_sleep_is_not_on_the_image_path(fake_smolvm: FakeSmolvm) -> None:
    """bottlenet's wait command ``sleep infinity`` needs ``sleep`` on the image's PATH, or
    ``machine start`` fails (``crun create``) and no VM process is left."""
    machine(fake_smolvm, {"env": ["PATH=/nonexistent"]}, "sleep", "infinity")
    r = run(fake_smolvm, "machine", "start", "--name", "m1")
    assert r.returncode == 1, r
    assert "agent operation failed: start background CMD" in r.stderr, r
    assert "`sleep` not found" in r.stderr
    assert fake_smolvm.live_pids() == []
    assert fake_smolvm.state()["machines"]["m1"]["state"] != "running"


@root_only
def test_guest_tmp_is_kept_across_execs_and_fresh_at_each_start(fake_smolvm: FakeSmolvm) -> None:
    """The guest's /tmp (the container's tmpfs) keeps a file between execs, not across a
    stop and start."""
    fake_smolvm.set_faults("exec-netns")
    machine(fake_smolvm, {}, "sleep", "infinity")
    assert run(fake_smolvm, "machine", "start", "--name", "m1").returncode == 0
    assert guest(fake_smolvm, "touch", "/tmp/kept").returncode == 0
    assert guest(fake_smolvm, "test", "-e", "/tmp/kept").returncode == 0
    assert run(fake_smolvm, "machine", "stop", "--name", "m1").returncode == 0
    assert run(fake_smolvm, "machine", "start", "--name", "m1").returncode == 0
    assert guest(fake_smolvm, "test", "-e", "/tmp/kept").returncode == 1


@root_only
@pytest.mark.parametrize(("version", "kind"), [("1.32.2", "tmpfs"), ("1.37.3", "disk")])
def test_guest_tmp_is_ram_in_132_and_disk_in_137(
    fake_smolvm: FakeSmolvm, version: str, kind: str
) -> None:
    """1.32's guest /tmp is a tmpfs; 1.37's a directory on the machine's disk (its help:
    "holds as much as the disk does"); both emptied at each start."""
    fake_smolvm.set_faults("exec-netns", version=version)
    machine(fake_smolvm, {}, "sleep", "infinity")
    assert run(fake_smolvm, "machine", "start", "--name", "m1").returncode == 0
    fs = guest(fake_smolvm, "stat", "-f", "-c", "%T", "/tmp").stdout.strip()
    assert (fs == "tmpfs") is (kind == "tmpfs"), fs
    assert run(fake_smolvm, "machine", "delete", "--name", "m1", "-f").returncode == 0
