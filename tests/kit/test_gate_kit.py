"""The gate's kit check (issue 36 item 3): the guest's kit must be the one the host built."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
from twisted.internet import defer
from twisted.internet.task import Clock

from bottlenet.bottles.probe import Gate, GateSettings
from bottlenet.kit.build import Kit, KitCache
from bottlenet.kit.program import KitRef
from bottlenet.probe.judge import judge
from bottlenet.probe.script import kit_request
from tests.kit.test_build import in_empty_root, needs_root
from tests.probe.test_gate_step import ENDPOINT, Table
from tests.probe.test_probe import NONCE, plan, transcript
from vmctl.smolvm import ExecResult

BUILT = "ab" * 32
OTHER = "cd" * 32


def with_kit(p: object, digest: str, end: str = "pass") -> bytes:
    """A passing transcript whose kit reported ``digest`` after its tool line."""
    text = transcript(p, end=end).decode()  # type: ignore[arg-type]
    return text.replace(
        f"BNP {NONCE} tool image\n", f"BNP {NONCE} tool kit\nBNP {NONCE} kit {digest}\n"
    ).encode()


def test_the_kit_the_host_built_passes() -> None:
    """The guest's kit reports the digest the host sent: judged as any run."""
    p = plan(kit=BUILT)
    assert judge(p, with_kit(p, BUILT), exit_code=0, witnessed=[str(p.own[0])]).passed


@pytest.mark.parametrize("seen", [OTHER, None], ids=["other-kit", "no-kit-line"])
def test_another_kit_or_none_is_refused(seen: str | None) -> None:
    """A kit with other bytes (or a run that names no kit) fails, whatever else it says."""
    p = plan(kit=BUILT)
    data = with_kit(p, seen) if seen else transcript(p)
    v = judge(p, data, exit_code=0, witnessed=[str(p.own[0])])
    assert not v.passed
    assert any("the guest's kit is not the one the host built" in x for x in v.problems), v


@needs_root
def test_the_kit_refuses_to_run_the_checks_when_its_bytes_differ(
    built_kit: tuple[KitCache, Kit],
) -> None:
    """In a root with nothing but the kit: sent another digest, the kit's probe says its
    own, ends ``kit-mismatch`` (exit 5) and runs no check; sent its own, it runs them."""
    _, kit = built_kit
    p = plan(kit=OTHER)
    out = in_empty_root(kit, "probe", stdin=kit_request(p))
    lines = out.stdout.decode().splitlines()
    assert out.returncode == 5, out
    assert lines[-2:] == [f"BNP {NONCE} kit {kit.digest}", f"BNP {NONCE} end kit-mismatch"]
    assert not any(" own " in ln for ln in lines)
    v = judge(p, out.stdout, exit_code=out.returncode)
    assert not v.passed and "refused" in v.describe()
    good = plan(kit=kit.digest, timeout=1.0)
    out = in_empty_root(kit, "probe", stdin=kit_request(good))
    assert f"BNP {NONCE} kit {kit.digest}" in out.stdout.decode()
    assert b" end " in out.stdout and b"kit-mismatch" not in out.stdout
    # the link report: the kit ships bottlenet.transparent's reader (pkg/), nothing of the root
    assert f"BNP {NONCE} link lo - " in out.stdout.decode(), out


@needs_root
def test_the_kits_dns_check_sees_a_name_that_resolves(
    built_kit: tuple[KitCache, Kit], tmp_path: Any
) -> None:
    """The gate's DNS check on the kit: a name the guest's /etc/hosts resolves is a leak
    (the kit carries ``encodings.idna``, which every ``getaddrinfo`` of a name needs; without
    it each lookup raised LookupError and read as "blocked")."""
    _, kit = built_kit
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n198.51.100.9 gate-leak.test\n")
    p = plan(kit=kit.digest, timeout=1.0, dns=("gate-leak.test",), own=(), witness=False)
    script = f'mount --bind {hosts} /etc/hosts && ip link set lo up && exec "$@"'
    out = subprocess.run(
        ["unshare", "--mount", "--net", "--propagation", "private", "sh", "-c", script, "sh",
         *kit.host_program.argv("probe")],
        input=kit_request(p), capture_output=True, timeout=120,
    )  # fmt: skip
    assert f"BNP {NONCE} dns gate-leak.test resolves" in out.stdout.decode(), out


def test_the_request_carries_the_plan_and_the_digest() -> None:
    """What the kit reads: the plan as guest.py knows it, and the digest it must have."""
    p = plan(kit=BUILT)
    request = json.loads(kit_request(p))
    assert request["kit"] == BUILT and request["plan"]["nonce"] == NONCE


class ForeignGuest:
    """``exec`` in a guest whose architecture is not the kit's: the loader cannot start."""

    def __init__(self) -> None:
        self.argv: list[str] = []

    def exec(self, name: str, argv: list[str], **kw: Any) -> Any:
        self.argv = list(argv)
        return defer.succeed(ExecResult(126, b"", b"exec format error\n", 0.1))


def test_a_guest_the_kit_cannot_start_in_gets_a_clear_error(tmp_path: Any) -> None:
    """The kit is the host's architecture; a guest that cannot run it (exec format error)
    fails the gate with one line naming the architecture, and no transcript is judged."""
    state = str(tmp_path)
    guest = ForeignGuest()
    gate = Gate(
        Clock(),
        guest,  # type: ignore[arg-type]
        Table(),  # type: ignore[arg-type]
        state_dir=state,
        settings=GateSettings(outside="198.18.0.1:9", dns_name="gate.invalid", home=state),
    )
    ref = KitRef(BUILT, "lib/ld-linux-x86-64.so.2")
    d = defer.Deferred.fromCoroutine(
        gate.run("b1", "bn-b1-agent", "socket", [ENDPOINT], other_bottle=None, kit=ref)
    )
    _plan, verdict = d.result  # type: ignore[attr-defined]
    assert guest.argv[-1] == "probe" and guest.argv[0].startswith("/run/bottlenet-kit/")
    machine = os.uname().machine
    assert verdict.problems == (
        f"bottlenet's guest kit could not start in the guest (exec format error): it is built "
        f"for {machine}, this host's architecture, and the guest must be {machine} too",
    )
