"""The fake smolvm's launcher (a TEST DOUBLE's): it imports the body, so the body's byte code is
cached as any module's is, keeps its name semantics, and re-execs itself for VMs."""

from __future__ import annotations

import importlib.util
import marshal
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fakes import FAKE_SMOLVM, FakeSmolvm

BODY_NAME = "smolvm_impl.py"
BODY = os.path.join(os.path.dirname(FAKE_SMOLVM), BODY_NAME)
NOTE = "note: no packed assets found for '{}'"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs the fake as another uid")


@pytest.fixture
def copy() -> Iterator[str]:
    """The launcher and its body copied to a fresh directory any uid can read: its path."""
    top = tempfile.mkdtemp(prefix="fake-launcher-")
    os.chmod(top, 0o755)
    shutil.copy(FAKE_SMOLVM, os.path.join(top, "smolvm"))
    shutil.copy(BODY, os.path.join(top, "smolvm_impl.py"))
    try:
        yield os.path.join(top, "smolvm")
    finally:
        shutil.rmtree(top, ignore_errors=True)


def call(
    launcher: str, *args: str, env_extra: dict[str, str] | None = None, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """One call in a state dir of its own (writable by any uid)."""
    state = tempfile.mkdtemp(prefix="fake-launcher-state-")
    os.chmod(state, 0o777)
    env = {"PATH": "/usr/bin:/bin", "HOME": state, "SMOLVM_DATA_DIR": state, **(env_extra or {})}
    try:
        return subprocess.run(
            [launcher, *args], env=env, capture_output=True, text=True, timeout=30, **kw
        )
    finally:
        shutil.rmtree(state, ignore_errors=True)


def cache_of(launcher: str) -> str:
    """Where the launcher at ``launcher`` caches its body's code."""
    return importlib.util.cache_from_source(os.path.join(os.path.dirname(launcher), BODY_NAME))


def plant(launcher: str, source: str) -> None:
    """Replace the cached code with ``source``'s, under the header that matches the real body."""
    path = cache_of(launcher)
    with open(path, "rb") as fh:
        head = fh.read(16)
    with open(path, "wb") as fh:
        fh.write(head + marshal.dumps(compile(source, "planted", "exec")))


PLANTED = "def main(argv):\n    print('planted')\n    return 0\n"


def test_the_cache_is_written_once_and_then_run(copy: str) -> None:
    """The first call writes the body's pyc (even under PYTHONDONTWRITEBYTECODE); the next
    runs the code in it, not the source."""
    r = call(copy, "--version", env_extra={"PYTHONDONTWRITEBYTECODE": "1"})
    assert r.stdout == "smolvm 1.32.2\n"
    assert os.path.exists(cache_of(copy))
    plant(copy, PLANTED)
    assert call(copy, "--version").stdout == "planted\n"


def test_an_edited_body_is_run_as_edited(copy: str) -> None:
    """An edit of the body is seen at the next call (its cache is not run stale)."""
    assert call(copy, "--version").stdout == "smolvm 1.32.2\n"
    body = os.path.join(os.path.dirname(copy), BODY_NAME)
    with open(body) as fh:
        text = fh.read()
    with open(body, "w") as fh:
        fh.write(text.replace('VERSION = "1.32.2"', 'VERSION = "1.32.10"', 1))
    assert call(copy, "--version").stdout == "smolvm 1.32.10\n"
    assert call(copy, "--version").stdout == "smolvm 1.32.10\n"  # and from its new cache


@needs_root
def test_another_uid_runs_without_writing_the_cache(copy: str) -> None:
    """A uid that cannot write next to the body still gets the fake (compiled for itself)."""
    r = call(copy, "--version", user=65534, group=65534, extra_groups=[])
    assert (r.returncode, r.stdout, r.stderr) == (0, "smolvm 1.32.2\n", "")
    assert not os.path.exists(os.path.dirname(cache_of(copy)))
    assert call(copy, "--version").returncode == 0  # root writes it, uid 65534 reads it
    plant(copy, PLANTED)
    r = call(copy, "--version", user=65534, group=65534, extra_groups=[])
    assert r.stdout == "planted\n"


def test_a_link_under_another_name_is_that_name(copy: str) -> None:
    """A link named ``smol-vmm`` finds the body; the note names it unless a pack lies beside."""
    other = tempfile.mkdtemp(prefix="fake-launcher-link-")
    try:
        link = os.path.join(other, "smol-vmm")
        os.symlink(copy, link)
        r = call(link, "--version")
        assert r.stdout == "smolvm 1.32.2\n"
        assert r.stderr.startswith(NOTE.format("smol-vmm")), r.stderr
        open(link + ".smolmachine", "w").close()
        assert call(link, "--version").stderr == ""
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_a_vm_is_the_launcher_re_executed(fake_smolvm: FakeSmolvm) -> None:
    """``machine start`` runs the "VMM" as ``python LAUNCHER _boot-vm DIR`` (this path)."""
    env = fake_smolvm.environ(SMOLVM_DATA_DIR=fake_smolvm.path)
    for args in (["create", "--name", "a", "-I", "alpine"], ["start", "--name", "a"]):
        subprocess.run([FAKE_SMOLVM, "machine", *args], env=env, check=True, timeout=60)
    with open(os.path.join(fake_smolvm.vm_dir("a"), "agent.pid")) as fh:
        pid = int(fh.read().split()[0])
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        argv = fh.read().split(b"\0")[:-1]
    assert argv[1:] == [FAKE_SMOLVM.encode(), b"_boot-vm", fake_smolvm.vm_dir("a").encode()]
