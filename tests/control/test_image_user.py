"""An agent image whose ``USER`` is not root, end to end: a real daemon, the fake smolvm with
``exec-netns`` (a TEST DOUBLE: one network namespace per network-less "VM"; needs root) and
an image ``USER`` from ``fake-images.json``. Without ``-u`` smolvm runs a command as that user
with no capability (fidelity.md #1; the fake drops to it with empty capability sets), so the
launch gate's ICMP control, the bridge's bind below 1024 and the workload wrapper's
``setuid`` all need bottlenet's own commands to run as the guest's root (``-u 0:0``)."""

from __future__ import annotations

import json
import os

import pytest

from tests import netguard

from .test_bridge import page_server
from .vmdaemon import VMDaemon, wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not netguard.active(), reason="exec-netns needs root and the netguard"
)

#: The image's USER: a uid with no capability in the guest (and no passwd entry here).
IMAGE_USER = "4242:4243"
#: A sidecar service on a guest port below 1024: the bridge binds it in the agent's guest.
SPEC = """\
mode = "socket"
[sidecar]
image = "registry.example/sidecar:1"
[[sidecar.service]]
name = "web"
guest_port = 80
env = ["WEB_URL=http://{{host}}:{{port}}/"]
[agent]
image = "{image}"
env = ["LANG=C.UTF-8"]
workload = ["/bin/sh", "-c", "id -u; id -g; python3 -I -c \\"{fetch}\\""]
"""
#: The workload, as the image's USER, fetches a page through the bridge on guest port 80.
FETCH = (
    "import os, urllib.request as u; "
    "print(u.urlopen(os.environ['WEB_URL'] + 'hello', timeout=20).read().decode())"
)


def image_user_daemon(port: int) -> VMDaemon:
    """A daemon whose agent image sets ``USER 4242:4243`` (the fake's images file)."""
    d = VMDaemon()
    relay = {"/run/bottlenet/web.sock": f"127.0.0.1:{port}"}
    d.fake.set_faults("exec-netns", expose_relay=relay)
    d.fake.set_images({d.image: {"user": IMAGE_USER}})
    return d


def test_non_root_image_user_gate_bridge_below_1024_and_workload_as_that_user() -> None:
    """The gate passes, the bridge listens on guest port 80, the workload runs as the image's
    USER (not root) and reaches the sidecar through that port; a plain ``bottle exec`` runs
    as the image's USER too (smolvm's default, untouched)."""
    with page_server() as port:
        d = image_user_daemon(port).start()
        try:
            r = d.create("b1", SPEC.format(image=d.image, fetch=FETCH))
            assert r.returncode == 0, (r.stderr, d.log())
            record = json.loads(r.stdout)
            assert record["probe"] == "PASS"
            assert b"running (80)" in d.ctl("bottle", "status", "b1").stdout
            logs = wait_for(
                lambda: b"page for /hello" in (out := d.ctl("bottle", "logs", "b1").stdout) and out,
                60,
                "the workload's fetch",
            )
            assert logs.splitlines()[:3] == [b"4242", b"4243", b"page for /hello"], logs
            r = d.ctl("bottle", "exec", "b1", "--", "id", "-u")
            assert (r.returncode, r.stdout) == (0, b"4242\n"), r
        finally:
            assert not d.cleanup()
