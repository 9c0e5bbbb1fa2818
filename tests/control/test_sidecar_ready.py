"""A sidecar whose services are slow to listen, end to end (issue 27 item 10): a real daemon and
the fake smolvm (a TEST DOUBLE) modelling smolvm's exposed sockets, which the VM process binds
before the guest app listens and which drop every connection until it does
(``expose_ready_after``, ``expose_never_ready``). Needs root (``exec-netns``)."""

from __future__ import annotations

import json
import os

import pytest

from tests import netguard

from .vmdaemon import VMDaemon

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not netguard.active(), reason="exec-netns needs root and the netguard"
)

EGRESS = "/run/bottlenet/egress.sock"


def test_a_slow_sidecar_is_waited_for_and_a_silent_one_fails_the_create() -> None:
    """Services that answer 1.5 s after the start: the create waits and succeeds. A service
    that never answers: SIDECAR_NOT_READY naming it, and no machine is left."""
    d = VMDaemon("--sidecar-ready-timeout", "4").start()
    try:
        d.fake.set_faults("exec-netns", version="1.32.2", expose_ready_after=1.5)
        d.create_vm_bottle("b1")
        d.fake.set_faults("exec-netns", version="1.32.2", expose_never_ready=[EGRESS])
        r = d.ctl("--json", "bottle", "create", "b2", "--spec", d.spec)
        assert r.returncode != 0, r.stdout
        assert b"SIDECAR_NOT_READY" in r.stderr and b"egress" in r.stderr, r.stderr
        machines = {m for m in d.fake.state()["machines"]}
        assert machines == {"bn-b1-sidecar", "bn-b1-agent"}, machines
        listed = json.loads(d.ctl("--json", "bottle", "ls").stdout)
        assert [b["name"] for b in listed] == ["b1"], listed
    finally:
        assert not d.cleanup()
