"""bottlenet's guest kit in the kernel smolvm's users boot (issue 36): libkrunfw's, under QEMU.

Runs inside the caller's ``unshare -n -m`` (only ``lo``), like tests/realvm/host.py. The guest
boots libkrunfw's own kernel as ``krunfw.py`` boots it (its raw image wrapped in an ELF with a
PVH note, ``-M microvm,acpi=off``, a virtio-blk ext4 root, the console on hvc0, no initrd).
Its PID 1 is ``agent.c`` (at ``/init``), a static stand-in for smolvm's guest agent: it mounts
what smolvm's mounts (the kit read-only at ``/run/bottlenet-kit``) and runs a fixed list of
steps, each one of bottlenet's guest commands exactly as the daemon sends it. The
image has no python3 and no libc; ``busybox`` has a static busybox and nothing else,
``noshell`` has no shell at all, only a static program. The kernel's command line is
libkrun's own (``krunfw.cmdline``), so its ``dummy`` driver makes ``dummy0`` (down, no
address) as in every smolvm guest: the gate passes it, as a link that carries nothing. In
``noshell`` the agent then brings ``dummy0`` up with 203.0.113.1/24, as libkrun's init does
when its transparent socket impersonation is on, and a second gate fails naming it.

Host side: the daemon's real forward (``ForwardTable``) onto the sidecar stand-in, diverted to
the gate's witness for the gate (QEMU's chardev connects to it; ``relay.py``, run by the
kit's interpreter, stands in for smolvm's ``--mount-socket`` at ``/run/bottle/egress.sock``);
the plan and the verdict are the daemon's own code. In ``busybox``, after the gate the
bridge (the kit's ``bridge``, under the kit's session wrapper) serves guest 127.0.0.1:3128
and busybox ``wget`` reaches tinyproxy (behind the forward) through it; then the kit's
transparent egress layer (``egress run``, its routes and nf_tables rules by netlink) takes
busybox ``wget`` with no proxy variable to tinyproxy as ``CONNECT name:port`` (the name from
the layer's resolver) and ``CONNECT ip:port``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from typing import Any

from attrs import evolve

from bottlenet.bottles.egresslayer import layer_args
from bottlenet.bottles.probe import Markers
from bottlenet.bridge.script import Bridge, bridge_args
from bottlenet.kit.build import Kit, KitCache
from bottlenet.kit.program import KitRef, kit_session
from bottlenet.probe.judge import judge
from bottlenet.probe.script import kit_request
from bottlenet.transparent.layer import LISTEN_PORT
from tests.netguard import TEST_KIT_DIR
from tests.realvm import krunfw
from tests.realvm.build import KrunfwKit, ensure_krunfw
from tests.realvm.host import (
    GUEST_SOCKET,
    boot,
    divert_to_witness,
    namespace_setup,
    own_forward,
    stand_in_gate,
    stand_ins,
)

HERE = os.path.dirname(os.path.abspath(__file__))
BRIDGE_PORT = 3128
#: The suite's shared kit cache (the one its daemons use).
KIT_DIR = TEST_KIT_DIR
BUSYBOX = "/bin/busybox"
#: What libkrun's init gives dummy0 with ``tsi_hijack`` on (libkrun.so of both wheels).
TSI_DUMMY = ("dummy0", "203.0.113.1", "255.255.255.0")


def guest_kit() -> Kit:
    """The kit the daemon would mount (built here if the cache has none for these inputs)."""
    return KitCache(KIT_DIR).ensure()


def rootfs(k: KrunfwKit, kit: Kit, work: str, steps: list[list[str]], files: dict[str, bytes],
           busybox: bool) -> None:  # fmt: skip
    """The guest's root disk: the agent, the kit at /kit, the steps and their inputs, and
    either a static busybox (its applets linked in /bin) or nothing but a static program."""
    root = os.path.join(work, "root")
    for d in ("proc", "sys", "dev", "run", "tmp", "rvm", "bin", "etc"):
        os.makedirs(os.path.join(root, d))
    shutil.copy2(k.agent, os.path.join(root, "init"))
    shutil.copytree(kit.root, os.path.join(root, "kit"))
    shutil.copy2(os.path.join(HERE, "relay.py"), os.path.join(root, "relay.py"))
    shutil.copy2(k.hello, os.path.join(root, "bin", "hello"))
    if busybox:
        shutil.copy2(BUSYBOX, os.path.join(root, "bin", "busybox"))
        for applet in ("sh", "wget", "ls", "cat", "env"):
            os.symlink("busybox", os.path.join(root, "bin", applet))
    with open(os.path.join(root, "etc", "passwd"), "w") as fh:
        fh.write("root:x:0:0:root:/:/nonexistent\n")
    for name, data in files.items():
        with open(os.path.join(root, "rvm", name), "wb") as fh:
            fh.write(data)
    with open(os.path.join(root, "rvm", "steps"), "w") as fh:
        fh.write("".join("\t".join(step) + "\n" for step in steps))
    krunfw.make_root(root, os.path.join(work, "root.ext4"))
    shutil.rmtree(root, ignore_errors=True)


def steps_for(ref: KitRef, busybox: bool) -> list[list[str]]:
    """What the agent runs, in order: the relay (smolvm's mounted socket), the gate as the
    daemon runs it, then the bridge and busybox wget, or an exec of a static program."""
    relay = [*ref.argv()[:-1], "/relay.py", GUEST_SOCKET, "egress"]  # the kit's interpreter
    steps = [["bg", *relay], ["unix", GUEST_SOCKET]]
    steps.append(["run", "gate", "/rvm/probe.json", *kit_session(ref), *ref.argv("probe")])
    if busybox:
        bridge = bridge_args([Bridge(BRIDGE_PORT, GUEST_SOCKET)])
        steps += [
            ["bg", *kit_session(ref), *ref.argv("bridge", *bridge)],
            ["tcp", str(BRIDGE_PORT)],
            ["env", f"http_proxy=http://127.0.0.1:{BRIDGE_PORT}"],
            ["run", "wget-allowed", "-", BUSYBOX, "wget", "-q", "-O", "-",
             "http://allowed.test:18180/page"],
            ["run", "wget-denied", "-", BUSYBOX, "wget", "-q", "-O", "-",
             "http://denied.test:18181/page"],
            # transparent egress on the kit (its `egress` subcommand, as the daemon runs it),
            # then clients with no proxy variable: a name through its resolver, a raw IP
            ["bg", *kit_session(ref), *ref.argv("egress", *layer_args(GUEST_SOCKET))],
            ["tcp", str(LISTEN_PORT)],
            ["unenv", "http_proxy"],
            ["run", "wget-transparent", "-", BUSYBOX, "wget", "-q", "-O", "-",
             "http://allowed.test:18180/page"],
            ["run", "wget-raw-ip", "-", BUSYBOX, "wget", "-q", "-O", "-", "http://203.0.113.7:443/"],
        ]  # fmt: skip
    steps.append(["run", "exec-static", "-", *kit_session(ref), "/bin/hello"])
    steps.append(["run", "no-shell", "-", *kit_session(ref), "/bin/sh", "-c", "echo shell"])
    if not busybox:  # dummy0 brought up as libkrun's TSI init does, then the gate again
        steps.append(["up", *TSI_DUMMY])
        steps.append(["run", "gate-tsi", "/rvm/probe-tsi.json", *kit_session(ref),
                      *ref.argv("probe")])  # fmt: skip
    return steps


def gate_lines(transcript: bytes, nonce: str) -> bytes:
    """One gate run's lines (each run has its own nonce)."""
    mine = f"BNP {nonce} ".encode()
    return b"\n".join(ln for ln in transcript.splitlines() if ln.startswith(mine))


async def run(reactor: Any, name: str, busybox: bool) -> dict[str, Any]:
    from tests.realvm import bridgehost

    k = ensure_krunfw()
    kit = guest_kit()
    ref = kit.ref
    namespace_setup()
    services = stand_ins()
    work = tempfile.mkdtemp(prefix=f"rvm-{name}-")
    proxy = None
    if busybox:
        proxy = bridgehost.the_web(work)
    state_dir = os.path.join(work, "state")
    os.makedirs(state_dir, mode=0o700)
    table, sock, endpoint = await own_forward(reactor, state_dir, bridgehost.PROXY_PORT)
    nonce = secrets.token_hex(16)
    markers = Markers(nonce, [state_dir])
    plan = stand_in_gate(endpoint, nonce, markers.paths, kit=ref.digest)
    witness = divert_to_witness(reactor, table, nonce, str(plan.own[0]))
    # the second gate (noshell, after dummy0 is up): judged on its links, no witness
    tsi = evolve(plan, nonce=secrets.token_hex(16), witness=False)
    files = {"probe.json": kit_request(plan), "probe-tsi.json": kit_request(tsi)}
    rootfs(k, kit, work, steps_for(ref, busybox), files, busybox)
    argv = krunfw.qemu_argv(
        k.kernel,
        os.path.join(work, "root.ext4"),
        os.path.join(work, "console.log"),
        [(sock, "egress")],
        files=[(os.path.join(work, "transcript.txt"), "transcript")],
    )
    qemu, code, wall = await boot(reactor, argv)
    witness.close()
    markers.remove()
    await table.stopService()
    if proxy is not None:
        proxy.terminate()
        proxy.wait(10)
    with open(os.path.join(work, "console.log"), "rb") as fh:
        console = fh.read().decode("utf-8", "replace")
    with open(os.path.join(work, "transcript.txt"), "rb") as fh:
        transcript = fh.read()
    shutil.rmtree(work, ignore_errors=True)
    steps = {}
    for line in console.splitlines():
        w = line.split()
        if len(w) == 5 and w[0] == "RVM-STEP":
            steps[w[1]] = (int(w[3]), int(w[4]))
    verdict = judge(plan, gate_lines(transcript, nonce), exit_code=steps.get("gate", (None,))[0],
                    witnessed=witness.seen)  # fmt: skip
    tsi_verdict = judge(tsi, gate_lines(transcript, tsi.nonce),
                        exit_code=steps.get("gate-tsi", (None,))[0])  # fmt: skip
    other = [ln.decode("utf-8", "replace") for ln in transcript.splitlines()
             if not ln.startswith((b"BNP ", b"BNB "))]  # fmt: skip
    return {
        "variant": name,
        "passed": verdict.passed,
        "lines": verdict.lines(),
        "problems": list(verdict.problems),
        # what the gate saw of the guest's links: its iface and rtnetlink lines
        "links": [
            ln.split(" ", 2)[2]
            for ln in gate_lines(transcript, nonce).decode().splitlines()
            if ln.split(" ")[2] in ("iface", "link", "addr", "route", "links")
        ],
        "tsi_problems": list(tsi_verdict.problems) if "gate-tsi" in steps else None,
        "witnessed": sorted(witness.seen),
        "steps": steps,
        "output": other,
        "bridge": [ln.decode() for ln in transcript.splitlines() if ln.startswith(b"BNB ready")],
        "host_accepts": services.seen,
        "denied_hits": bridgehost._Pages.hits.get("denied", 0),
        "qemu_exit": code,
        "probe_exit": steps.get("gate", (None,))[0],
        "wall": round(wall, 1),
        "console": [ln.strip() for ln in console.splitlines() if ln.startswith("RVM-")],
        "qemu_output": qemu.output.decode("utf-8", "replace")[-2000:] if code else "",
        "kernel": k.version,
    }
