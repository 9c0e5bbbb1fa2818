"""bottlenet's in-guest bridge end to end: a real daemon, the fake smolvm's ``exec-netns``
stand-in (a TEST DOUBLE: one network namespace per network-less "VM", the mounted sockets at
their guest paths; needs root), an agent image with no bridge of its own, a real HTTP client
(python's urllib with the stamped proxy variable) and a real HTTP server behind the sidecar's
exposed socket.

One daemon serves the tests that need no option of their own (module fixture: the restart
runs first, while its bottle is the daemon's only one to recover); each test's bottle has its
own name, and the bridge processes are told apart by the agent VM they run in."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from bottlenet.kit.program import GUEST_DIR, MAIN
from tests import netguard

from .vmdaemon import VMDaemon, wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not netguard.active(), reason="exec-netns needs root and the netguard"
)

SPEC = """\
mode = "socket"
[sidecar]
image = "registry.example/sidecar:1"
[[sidecar.service]]
name = "egress"
guest_port = 3128
env = ["HTTPS_PROXY=http://{{host}}:{{port}}"]
[agent]
image = "{image}"
env = [{env}]
{extra}
"""

#: In the guest: fetch a page through the stamped proxy (urllib's own proxy handling).
FETCH = (
    "import os, urllib.request as u; p = os.environ['HTTPS_PROXY']; "
    "o = u.build_opener(u.ProxyHandler({'http': p, 'https': p})); "
    "print(o.open('http://pages.test/hello', timeout=20).read().decode())"
)


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"page for {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def page_server() -> Iterator[int]:
    """A real HTTP server on 127.0.0.1 (what the sidecar's egress service answers with)."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield int(srv.server_address[1])
    finally:
        srv.shutdown()
        srv.server_close()


def daemon(port: int, *extra: str) -> VMDaemon:
    d = VMDaemon(*extra)
    relay = {"/run/bottlenet/egress.sock": f"127.0.0.1:{port}"}
    d.fake.set_faults("exec-netns", expose_relay=relay)
    return d


@pytest.fixture(scope="module")
def shared() -> Iterator[VMDaemon]:
    """A daemon (and the page server behind its sidecar's egress) for the module's tests."""
    with ExitStack() as stack:
        d = daemon(stack.enter_context(page_server())).start()
        try:
            yield d
        finally:
            assert not d.cleanup()


def create(d: VMDaemon, name: str, *, env: str = '"LANG=C.UTF-8"', extra: str = "") -> Any:
    return d.create(name, SPEC.format(image=d.image, env=env, extra=extra))


def bridge_pids(d: VMDaemon, bottle: str) -> list[int]:
    """The processes running bottlenet's bridge program in ``bottle``'s agent "VM" (the
    fake's execs there, and their descendants)."""
    out = []
    for pid, words in d.agent_argvs(bottle).items():
        # the guest kit's bridge (not its session wrapper, whose first word after the kit's
        # program is "session"), or the image's python3 running the script's program
        kit = KIT_MAIN in words and words[words.index(KIT_MAIN) + 1 :][:1] == [b"bridge"]
        if kit or any(b"BRIDGES = [[3128, '/run/bottle/egress.sock']]" in w for w in words):
            out.append(pid)
    return out


KIT_MAIN = f"{GUEST_DIR}/{MAIN}".encode()


def fetch(d: VMDaemon, bottle: str) -> Any:
    return d.ctl("bottle", "exec", bottle, "--", "python3", "-I", "-c", FETCH)


PAGE = b"page for http://pages.test/hello\n"


def test_daemon_restart_starts_the_bridge_again(shared: VMDaemon) -> None:
    """The daemon stops (its sessions end, and the bridges with them) and starts again:
    recovery starts a new bridge and the agent fetches through it."""
    d = shared
    assert create(d, "restarted").returncode == 0
    (old,) = bridge_pids(d, "restarted")
    d.stop()
    wait_for(lambda: old not in bridge_pids(d, "restarted"), 30, "the old bridge to end")
    d.start()
    wait_for(lambda: bridge_pids(d, "restarted"), 30, "a new bridge")
    with d.client() as c:  # polled on one connection, not a bottlenetctl process a try
        wait_for(
            lambda: "running (3128)" in (c.bottle_status("restarted").bridge or ""),
            30,
            "the bridge to run",
        )
    r = fetch(d, "restarted")
    assert r.returncode == 0 and r.stdout == PAGE, r


def test_stock_image_fetches_through_the_bridge_and_survives_its_death(shared: VMDaemon) -> None:
    """No bridge in the image: urllib with the stamped proxy gets a page; a killed bridge is
    restarted (``bridge_restarted``) and the next fetch works."""
    d = shared
    r = create(d, "b1")
    assert r.returncode == 0, (r.stderr, d.log())
    status = d.ctl("bottle", "status", "b1")
    assert b"running (3128)" in status.stdout, status.stdout
    r = fetch(d, "b1")
    assert r.returncode == 0 and r.stdout == PAGE, r
    with d.client(timeout=60) as c:
        c.watch("b1")
        (pid,) = bridge_pids(d, "b1")
        os.kill(pid, signal.SIGKILL)
        kinds = []
        for event in c.events("b1", idle=60):
            kinds.append(event.kind)
            if event.kind == "bridge_restarted":
                break
    assert "degraded" not in kinds
    r = fetch(d, "b1")
    assert r.returncode == 0 and r.stdout == PAGE, r
    assert b"restarted 1x" in d.ctl("bottle", "status", "b1").stdout


def test_bridge_none_starts_no_bridge(shared: VMDaemon) -> None:
    """``agent.bridge = "none"``: no bridge process, nothing on the guest port."""
    d = shared
    r = create(d, "nobridge", extra='bridge = "none"')
    assert r.returncode == 0, (r.stderr, d.log())
    assert json.loads(r.stdout)["bridge"].startswith("off (agent.bridge")
    assert bridge_pids(d, "nobridge") == []
    r = fetch(d, "nobridge")
    assert r.returncode != 0 and b"Connection refused" in r.stderr, r


def no_python_path() -> str:
    """A PATH with every tool of the host but python3 (the "image" lacks it); not under
    /tmp, which the stand-in replaces with the guest's own."""
    d = tempfile.mkdtemp(prefix="bn-no-python-", dir="/var/tmp")
    for src in ("/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        for name in os.listdir(src) if os.path.isdir(src) else ():
            if not name.startswith("python") and not os.path.lexists(os.path.join(d, name)):
                os.symlink(os.path.join(src, name), os.path.join(d, name))
    return d


def test_no_python3_fails_the_create_and_rolls_back() -> None:
    """An image without python3: BRIDGE_FAILED naming the reason, and nothing is left."""
    with page_server() as port:
        # The gate would fail first without python3 (it needs one too); skip it to reach
        # the bridge step. No guest kit: the image's python3 is the bridge's only tool.
        d = daemon(port, "--unsafe-skip-isolation-probe", "--guest-kit", "off").start()
        try:
            path = no_python_path()
            try:
                r = create(d, "b1", env=f'"PATH={path}"')
            finally:
                shutil.rmtree(path)
            assert r.returncode != 0
            assert b"BRIDGE_FAILED" in r.stderr and b"no python3 in the agent image" in r.stderr
            wait_for(lambda: d.fake.state()["machines"] == {}, 30, "the machines to go")
            assert d.ctl("bottle", "ls").stdout.count(b"b1") == 0
        finally:
            assert not d.cleanup()
