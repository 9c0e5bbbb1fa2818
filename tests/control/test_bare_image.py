"""An agent image with nothing of bottlenet's (issue 36): no python3 and no shell anywhere a
guest looks, end to end. A real daemon, its guest kit, the fake smolvm with ``exec-netns``
(a TEST DOUBLE: one network namespace per network-less "VM"; needs root) and a bare image
(``fake-images.json`` ``"bare"``: the guest's /usr/bin holds only the named programs, and
/usr/sbin, /usr/local/bin and /root are empty, so the host's interpreters are out of reach).
Every guest command of bottlenet's runs on the kit: the gate, the bridge and its proof, the
session wrapper, the workload's steps and ``bottle logs``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import pytest

from tests import netguard
from tests.netio import ConnectProxy

from .daemon_helpers import ENV, REPO
from .test_bridge import page_server
from .vmdaemon import VMDaemon, pids_running, wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not netguard.active(), reason="exec-netns needs root and the netguard"
)

#: What the bare image has: no sh, no python3; curl is the guest's HTTP client.
BARE = ["echo", "sleep", "id", "cat", "curl"]
SPEC = """\
mode = "socket"
[sidecar]
image = "registry.example/sidecar:1"
[[sidecar.service]]
name = "web"
guest_port = 8080
env = ["WEB_URL=http://{{host}}:{{port}}/"]
[agent]
image = "{image}"
workload = ["echo", "hello-from-a-bare-image"]
"""
#: The attached command whose client goes away (its argv is its mark in /proc).
SLEEP = b"sleep\x003023\x00"


@pytest.mark.parametrize("user", [None, "4242:4243"], ids=["root", "image-user"])
def test_a_bare_image_gets_the_gate_bridge_exec_session_end_and_workload(
    user: str | None,
) -> None:
    """Created (gate PASS), the bridge carries a real client's bytes, ``bottle exec`` runs,
    an attached command whose client is killed is ended in the guest, and the workload's
    line is in ``bottle logs``; as root and as a non-root image USER."""
    with page_server() as port:
        d = VMDaemon()
        relay = {"/run/bottlenet/web.sock": f"127.0.0.1:{port}"}
        d.fake.set_faults("exec-netns", version="1.32.2", expose_relay=relay)
        d.fake.set_images({d.image: {"bare": BARE, **({} if user is None else {"user": user})}})
        d.start()
        try:
            r = d.create("b1", SPEC.format(image=d.image))
            assert r.returncode == 0, (r.stderr, d.log())
            assert json.loads(r.stdout)["probe"] == "PASS"
            # nothing of an interpreter or a shell in this guest
            for argv in (["/bin/sh", "-c", "true"], ["sh", "-c", "true"], ["python3", "-c", "1"]):
                r = d.ctl("bottle", "exec", "b1", "--", *argv)
                assert r.returncode != 0, (argv, r)
            r = d.ctl("bottle", "exec", "b1", "--", "id", "-u")
            assert (r.returncode, r.stdout) == (0, f"{(user or '0:0').split(':')[0]}\n".encode())
            r = d.ctl("bottle", "exec", "b1", "--", "curl", "-sS", "http://127.0.0.1:8080/hello")
            assert (r.returncode, r.stdout) == (0, b"page for /hello"), r
            logs = wait_for(
                lambda: (
                    b"hello-from-a-bare-image" in (out := d.ctl("bottle", "logs", "b1").stdout)
                    and out
                ),
                60,
                "the workload's line",
            )
            assert logs == b"hello-from-a-bare-image\n"
            ctl = subprocess.Popen(
                d.ctl_argv("bottle", "exec", "b1", "--", "sleep", "3023"),
                env=ENV,
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            wait_for(lambda: pids_running(SLEEP), 30, "the attached command in the guest")
            ctl.send_signal(signal.SIGKILL)  # the client goes away
            ctl.wait(30)
            wait_for(
                lambda: not pids_running(SLEEP), 30, "the guest command to end with its session"
            )
        finally:
            assert not d.cleanup()


def test_a_kit_whose_bytes_differ_is_refused_by_the_gate() -> None:
    """The guest finds a kit at the kit's path whose bytes differ from the one the host built
    (one byte of its ``kit.json``): the kit itself refuses to run the checks, the gate fails
    naming it, and nothing of the bottle is left."""
    d = VMDaemon()
    d.start()
    try:
        status = wait_for(
            lambda: b"ready: kit " in (out := d.ctl("status").stdout) and out, 60, "the kit"
        )
        root = status.decode().split(" at ", 1)[1].split()[0]
        copy = os.path.join(d.dir, "kit-copy")
        shutil.copytree(root, copy)
        os.chmod(copy, 0o755)
        os.chmod(os.path.join(copy, "kit.json"), 0o644)
        with open(os.path.join(copy, "kit.json"), "a") as f:
            f.write(" ")
        d.fake.set_images({d.image: {"bare": BARE}})
        d.fake.set_faults("exec-netns", version="1.32.2", volume_swap={"/run/bottlenet-kit": copy})
        r = d.create("b1", SPEC.format(image=d.image))
        assert r.returncode != 0
        error = json.loads(r.stderr)
        assert error["code"] == "ISOLATION_FAILED", error
        assert "the guest's kit is not the one the host built" in error["message"], error
        assert b"b1" not in d.ctl("bottle", "ls").stdout
    finally:
        assert not d.cleanup()


#: Transparent egress for a bare image: the layer runs on the kit (issue 37 on issue 36).
EGRESS_SPEC = """\
mode = "socket"
[sidecar]
image = "registry.example/sidecar:1"
[[sidecar.service]]
name = "egress"
guest_port = 3128
[agent]
image = "{image}"
bridge = "none"
transparent_egress = "egress"
"""


def test_a_bare_image_gets_transparent_egress_from_the_kit() -> None:
    """No python3 and no shell in the guest, ``transparent_egress`` set: created (the gate
    and the layer's canaries PASS), the layer is the kit's ``egress run`` (no shell), and a
    client with no proxy variables dialling 203.0.113.7:443 reaches the named service as
    CONNECT (which refuses it)."""
    recorder = ConnectProxy(0, lambda target: None)
    d = VMDaemon()
    try:
        relay = {"/run/bottlenet/egress.sock": f"127.0.0.1:{recorder.port}"}
        d.fake.set_faults("exec-netns", version="1.32.2", expose_relay=relay)
        d.fake.set_images({d.image: {"bare": BARE}})
        d.start()
        r = d.create("e1", EGRESS_SPEC.format(image=d.image))
        assert r.returncode == 0, (r.stderr, d.log())
        b = json.loads(r.stdout)
        assert b["probe"] == "PASS" and "transparent egress running" in b["bridge"], b
        assert recorder.lines == []  # the canaries went to the daemon's witness
        layer = [
            argv
            for argv in d.agent_argvs("e1").values()
            if b"egress" in argv and b"session" not in argv
        ]
        assert layer and all(a[0].startswith(b"/run/bottlenet-kit/") for a in layer), layer
        r = d.ctl("bottle", "exec", "e1", "--", "curl", "--noproxy", "*", "-sS", "-m", "20",
                  "http://203.0.113.7:443/")  # fmt: skip
        assert r.returncode != 0, r  # connected, then reset: the proxy refused it
        line = "CONNECT 203.0.113.7:443 HTTP/1.1"
        assert wait_for(lambda: line in recorder.lines, 30, line), recorder.lines
    finally:
        recorder.close()
        assert not d.cleanup()
