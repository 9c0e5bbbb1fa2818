"""The guest kit: built from the installed package, cached by its inputs, self-contained."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

import pytest
from twisted.internet.defer import Deferred, maybeDeferred

from bottlenet.kit import guest
from bottlenet.kit.build import Kit, KitCache, KitUnavailable, elf_facts, find_inputs
from bottlenet.kit.keeper import KitKeeper, KitState
from bottlenet.kit.program import GUEST_DIR


def run(argv: list[str], stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, input=stdin, capture_output=True, timeout=60)


def in_empty_root(kit: Kit, *words: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    """The kit's program in a root that holds nothing but the kit at its guest path: no
    shell, no python3, no libc (a mount namespace and chroot; needs root)."""
    root = tempfile.mkdtemp(prefix="kit-root-")
    try:
        os.makedirs(root + GUEST_DIR)
        script = f'mount --bind {kit.root} {root}{GUEST_DIR} && exec chroot {root} "$@"'
        return run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                "sh",
                *kit.program.argv(*words),
            ],
            stdin,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chroot and mount need root")


@needs_root
def test_the_kit_runs_where_there_is_nothing_else(built_kit: tuple[KitCache, Kit]) -> None:
    """No libc, no shell, no python3 in the root: the kit's own loader runs its program."""
    _, kit = built_kit
    p = in_empty_root(kit, "version")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["machine"] == os.uname().machine
    p = in_empty_root(kit, "digest")
    assert p.stdout.decode().strip() == kit.digest  # the guest sees the bytes the host built
    assert in_empty_root(kit, "whoami").stdout == b"0:0\n"


@needs_root
def test_the_bridges_reach_check_runs_in_the_empty_root(built_kit: tuple[KitCache, Kit]) -> None:
    """A guest program that needs sockets: nothing listens, so each port is refused."""
    _, kit = built_kit
    request = json.dumps({"nonce": "ab12", "ports": [[1, "tcp:127.0.0.1:1"]], "timeout": 2.0})
    p = in_empty_root(kit, "reach", stdin=request.encode())
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode().split()[:3] == ["BNB", "reach", "1"]


def test_a_cached_kit_is_used_and_a_changed_one_built_again(
    built_kit: tuple[KitCache, Kit],
) -> None:
    """Same inputs, same kit (no build); a byte changed on disk: built again, never used."""
    cache, kit = built_kit
    again = cache.ensure()
    assert again.digest == kit.digest and again.built_in == 0.0
    victim = os.path.join(kit.root, "app", "probe.pyc")
    os.chmod(os.path.dirname(victim), 0o755)
    os.chmod(victim, 0o644)
    with open(victim, "ab") as fh:
        fh.write(b"\0")
    assert not cache.verify(kit)
    rebuilt = cache.ensure()
    assert rebuilt.built_in > 0
    assert cache.verify(rebuilt)
    assert rebuilt.digest == guest.tree_digest(rebuilt.root)


def test_the_key_follows_the_guest_programs(built_kit: tuple[KitCache, Kit]) -> None:
    """A change of any guest program's bytes is a new key (so a new kit)."""
    inputs = find_inputs()
    changed = type(inputs)(
        inputs.python,
        inputs.machine,
        inputs.loader,
        inputs.modules,
        inputs.libraries,
        {**inputs.sources, "probe": inputs.sources["probe"] + "\n# changed\n"},
        inputs.pyversion,
    )
    assert changed.key() != inputs.key()


def test_a_static_or_foreign_program_is_refused() -> None:
    """The kit needs an ELF interpreter with a loader: anything else is a clear refusal."""
    with tempfile.NamedTemporaryFile() as fh:
        fh.write(b"#!/bin/sh\n")
        fh.flush()
        with pytest.raises(KitUnavailable, match="not a 64-bit"):
            elf_facts(fh.name)
    busybox = shutil.which("busybox")
    if busybox and b"ld-linux" not in open(busybox, "rb").read(4096):
        with pytest.raises(KitUnavailable, match="statically linked"):
            elf_facts(busybox)


def test_tree_digest_sees_a_new_file_and_a_mode(tmp_path: object) -> None:
    """Anything added or re-moded changes the digest."""
    d = str(tmp_path)
    with open(os.path.join(d, "a"), "w") as fh:
        fh.write("x")
    first = guest.tree_digest(d)
    os.chmod(os.path.join(d, "a"), 0o600)
    second = guest.tree_digest(d)
    os.mkfifo(os.path.join(d, "f"))
    third = guest.tree_digest(d)  # a FIFO is listed, never opened (no hang)
    assert len({first, second, third}) == 3


def _now(f: object) -> Deferred[object]:
    """Runs the blocking call at once (the keeper's thread, made synchronous)."""
    return maybeDeferred(f)  # type: ignore[arg-type]


def test_the_keeper_builds_again_when_the_kit_changed(built_kit: tuple[KitCache, Kit]) -> None:
    """checked(): a verified kit as it is; a changed one is built again before any mount."""
    cache, _ = built_kit
    keeper = KitKeeper(None, cache, run=_now)
    keeper.startService()
    assert keeper.state is KitState.READY and keeper.kit is not None
    kit = keeper.kit
    got: list[object] = []
    Deferred.fromCoroutine(keeper.checked()).addCallback(got.append)
    assert got == [kit]
    victim = os.path.join(kit.root, "kit.json")
    os.chmod(kit.root, 0o755)
    os.chmod(victim, 0o644)
    with open(victim, "a") as fh:
        fh.write(" ")
    Deferred.fromCoroutine(keeper.checked()).addCallback(got.append)
    assert isinstance(got[1], Kit) and cache.verify(got[1])
    assert keeper.describe().startswith("ready: kit ")


def test_the_keeper_falls_back_and_says_why() -> None:
    """No kit (off, or a build that failed): None, and the reason names the fallback."""
    off = KitKeeper(None, None, run=_now)
    off.startService()
    assert off.state is KitState.OFF
    assert "image's python3" in off.describe()

    class Broken(KitCache):
        def ensure(self) -> Kit:
            raise KitUnavailable("no loader here")

    keeper = KitKeeper(None, Broken("/nonexistent"), run=_now)
    keeper.startService()
    got: list[object] = []
    Deferred.fromCoroutine(keeper.checked()).addCallback(got.append)
    assert got == [None]
    assert keeper.describe() == (
        "unavailable: no loader here; guest commands use the image's python3 and /bin/sh"
    )
