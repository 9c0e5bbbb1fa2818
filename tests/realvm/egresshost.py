"""The real-VM egress run (issue 37): bottlenet's transparent egress layer in **the kernel users
boot**, libkrunfw's (tests/realvm/krunfw.py), with no NIC and clients that ignore proxy
variables. Runs inside the caller's ``unshare -n -m`` (only ``lo``), like tests/realvm/host.py.

Host side: Debian's tinyproxy (the sidecar's egress proxy: ``allowed.test`` only) behind a
recorder that keeps each request line, behind the daemon's real forward (``ForwardTable``);
QEMU's virtio-serial chardevs connect to the forward's UNIX listener and the guest's relay maps
``/run/bottle/egress.sock`` onto them. Guest side: the layer, fed on a kept-open stdin to
``sh -s`` exactly as the daemon's session feeds it; the gate's layer check (the probe's
``LayerPlan``) with the forward diverted to the host's CONNECT witness, judged by
``judge_layer``; then urllib with an empty environment, busybox wget, ``curl --noproxy '*'``,
raw IPv4 and IPv6 dials, a name through the resolver, UDP and ICMP; then the rules removed by
the guest's root (the layer's ``remove``), after which egress is gone and the bottle's own
socket still answers.

The ``egress-nonft`` run feeds the same layer to the tier's Debian kernel, whose nf_tables is
a module nobody loads: a kernel without nf_tables, and the create error the daemon makes of
its words.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from typing import Any

from bottlenet.bottles.egresslayer import LayerCounters, LayerSession
from bottlenet.probe.judge import judge_layer
from bottlenet.probe.plan import LayerPlan, new_nonce
from bottlenet.probe.script import render as render_check
from bottlenet.probe.witness import ConnectWitness, ConnectWitnessFactory
from bottlenet.transparent.layer import LISTEN_PORT
from bottlenet.transparent.script import render as render_layer
from tests.netio import ConnectProxy
from tests.realvm import krunfw
from tests.realvm.bridgehost import (
    ALLOWED_PORT,
    CLIENT_IMPORTS,
    CURL,
    DENIED_PORT,
    PROXY_PORT,
    _Pages,
    the_web,
)
from tests.realvm.build import BUSYBOX, GUEST_PYTHON, _libs, _python_files
from tests.realvm.host import (
    GUEST_SOCKET,
    OUTSIDE,
    Accepts,
    boot,
    namespace_setup,
    own_forward,
    place,
    run_cpio,
)

HERE = os.path.dirname(os.path.abspath(__file__))
RECORD_PORT = 18129
#: One virtio port: QEMU connects each port to the forward at boot, and a port connected while
#: the forward was diverted to the witness would answer a client 403 after the check.
PORTS = 1
#: What the layer and the probe's check import, besides the clients' modules.
IMPORTS = (
    CLIENT_IMPORTS + " __future__ ipaddress re collections errno stat importlib.abc importlib.util"
    " hashlib tempfile threading select struct"
)

GUEST_SH = """\
#!/bin/sh
echo "RVE kernel $(uname -r)"
{{ cat /layer.sh; sleep 100000; }} | sh -s > /tmp/layer.out 2>&1 &
i=0
while ! grep -q '^BNE ready' /tmp/layer.out && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
cat /tmp/layer.out >&2; echo "RVE layer $(head -c 120 /tmp/layer.out | tr '\\n ' '__')"
sh -s < /check.sh > /tmp/check.out 2>/tmp/check.err
echo "RVE check-exit $?"
sed 's/^/RVE-CHECK /' /tmp/check.out
env -i /usr/bin/python3 -I -S /egress_client.py before
out=$(env -i /bin/busybox wget -q -O - http://{allowed}/wget 2>&1); rc=$?
echo "RVE wget $rc $(echo "$out" | head -c 200 | tr ' \n' '__')"
out=$(env -i /usr/bin/curl -sS --noproxy '*' -m 30 http://{allowed}/curl 2>&1); rc=$?
echo "RVE curl $rc $(echo "$out" | head -c 200 | tr ' \n' '__')"
env -i /usr/bin/curl -sS --noproxy '*' -m 30 -o /dev/null http://{outside}:443/ 2>/dev/null
echo "RVE curl-outside $?"
ping -c 1 -W 2 {outside} > /tmp/ping.out 2>&1
echo "RVE ping $? $(tail -n 1 /tmp/ping.out | tr ' ' _)"
sh -s < /remove.sh > /tmp/remove.out 2>&1; echo "RVE remove $?"
env -i /usr/bin/python3 -I -S /egress_client.py after
echo "RVE layer-lines $(grep -c '^BNE conn' /tmp/layer.out)"
grep '^BNE conn' /tmp/layer.out | sed 's/^/RVE-CONN /'
echo "RVE end"
"""

INIT = """\
#!/bin/sh
/bin/busybox mkdir -p /proc /sys /dev /run /tmp /usr/bin /usr/sbin /sbin
/bin/busybox --install -s
export PATH=/usr/bin:/bin:/usr/sbin:/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mount -t tmpfs -o mode=0755 run /run
mount -t tmpfs tmp /tmp
exec > /dev/console 2>&1
ip link set lo up
hostname rve-guest
mkdir -p /run/bottle
python3 -I -S /relay.py {socket} egress 2>&1 &
i=0
while [ ! -S {socket} ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
sh /egress.sh
sync
reboot -f
"""


def root_tree(tree: str, files: dict[str, bytes | str]) -> None:
    """Busybox, python3 with what the layer, the check and the clients import, curl, and
    ``files`` (guest path -> bytes, or a host file to copy)."""
    for d in ("bin", "sbin", "dev", "proc", "sys", "run", "tmp", "etc", "usr/bin"):
        os.makedirs(os.path.join(tree, d), exist_ok=True)
    py = _python_files(IMPORTS)
    host_files = {BUSYBOX: "/bin/busybox", GUEST_PYTHON: GUEST_PYTHON, CURL: CURL}
    host_files.update({f: f for f in py})
    host_files.update(
        {lib: lib for lib in _libs([CURL, GUEST_PYTHON, *[f for f in py if f.endswith(".so")]])}
    )
    for extra in ("/lib/x86_64-linux-gnu/libgcc_s.so.1",):
        if os.path.exists(extra):
            host_files[extra] = extra
    place(tree, {dest: src for src, dest in host_files.items()})
    place(tree, files)
    os.symlink("busybox", os.path.join(tree, "bin", "sh"))
    os.chmod(os.path.join(tree, "init"), 0o755)


def client_program() -> bytes:
    conf = {
        "allowed": f"allowed.test:{ALLOWED_PORT}",
        "denied": f"denied.test:{DENIED_PORT}",
        "socket": GUEST_SOCKET,
    }
    with open(os.path.join(HERE, "egress_client.py")) as fh:
        text = fh.read().replace("CONF = {}  # filled in by the host", f"CONF = {conf!r}  #")
    return text.encode()


def parse(console: str) -> tuple[dict[str, list[str]], bytes, list[str]]:
    """The RVE results, the layer check's transcript and the layer's connection lines."""
    results: dict[str, list[str]] = {}
    check, conns = [], []
    for line in console.splitlines():
        if line.startswith("RVE-CHECK "):
            check.append(line[len("RVE-CHECK ") :])
        elif line.startswith("RVE-CONN "):
            conns.append(line[len("RVE-CONN ") :].strip())
        elif line.startswith("RVE "):
            words = line.split()
            if len(words) >= 2:
                results.setdefault(words[1], []).append(" ".join(words[2:]))
    return results, "\n".join(check).encode(), conns


async def run(reactor: Any, name: str) -> dict[str, Any]:
    lib = krunfw.find_libkrunfw()
    if lib is None:
        raise SystemExit("the egress run needs libkrunfw.so.5 (pip install 'bottlenet[vm]')")
    namespace_setup()
    work = tempfile.mkdtemp(prefix="rvm-egress-")
    proxy = the_web(work)
    outside = Accepts()
    outside.listen(OUTSIDE, 443)
    # in front of tinyproxy: each request line kept, then the request goes on unchanged
    recorder = ConnectProxy(
        RECORD_PORT, lambda target: ("127.0.0.1", PROXY_PORT), forward_head=True
    )

    state_dir = os.path.join(work, "state")
    os.makedirs(state_dir, mode=0o700)
    table, sock, _ = await own_forward(reactor, state_dir, RECORD_PORT)

    # the gate's layer check: the forward diverted to the CONNECT witness until it has seen
    # every canary, then back to the relay (the clients' turn)
    plan = LayerPlan(nonce=new_nonce(), outside=f"{OUTSIDE}:443")
    witness = ConnectWitness(plan.connect_target(c) for c in plan.canaries())
    witness.on_all = lambda: table.divert("rvm", "egress", None)
    table.divert("rvm", "egress", ConnectWitnessFactory(reactor, witness, timeout=120))

    kernel = os.path.join(work, "vmlinux-krunfw.elf")
    version = krunfw.write_elf(lib, kernel)
    tree = os.path.join(work, "root")
    root_tree(tree, {
        "/init": INIT.format(socket=GUEST_SOCKET).encode(),
        "/egress.sh": GUEST_SH.format(allowed=f"allowed.test:{ALLOWED_PORT}",
                                      outside=OUTSIDE).encode(),
        "/layer.sh": render_layer(GUEST_SOCKET, LISTEN_PORT),
        "/remove.sh": render_layer(GUEST_SOCKET, LISTEN_PORT, command="remove"),
        "/check.sh": render_check(plan),
        "/egress_client.py": client_program(),
        "/relay.py": os.path.join(HERE, "relay.py"),
    })  # fmt: skip
    root = os.path.join(work, "root.ext4")
    krunfw.make_root(tree, root)
    console = os.path.join(work, "console.log")
    ports = [(sock, "egress")] + [(sock, f"egress-{i}") for i in range(1, PORTS)]
    qemu, code, wall = await boot(reactor, krunfw.qemu_argv(kernel, root, console, ports))
    witness.close()
    await table.stopService()
    proxy.terminate()
    proxy.wait(10)
    with open(console, "rb") as fh:
        text = fh.read().decode("utf-8", "replace")
    shutil.rmtree(work, ignore_errors=True)
    results, check, conns = parse(text)
    exit_code = int(results["check-exit"][0]) if "check-exit" in results else None
    verdict = judge_layer(plan, check, exit_code=exit_code, connects=witness.seen)
    return {
        "variant": name,
        "results": results,
        "lines": [f"{k}: {' | '.join(v)}" for k, v in sorted(results.items())] + verdict.lines(),
        "check_passed": verdict.passed,
        "check_problems": list(verdict.problems),
        "check_notes": list(verdict.notes),
        "witnessed": sorted(witness.seen),
        "proxy_lines": recorder.lines,
        "layer_conns": conns,
        "denied_hits": _Pages.hits.get("denied", 0),
        "allowed_hits": _Pages.hits.get("allowed", 0),
        "outside_accepts": outside.seen[f"{OUTSIDE}:443"],
        "qemu_exit": code,
        "probe_exit": exit_code,
        "wall": round(wall, 1),
        "console": [ln for ln in text.splitlines() if ln.startswith("RVE ")][:3],
        "qemu_output": qemu.output.decode("utf-8", "replace")[-2000:] if code else "",
        "console_tail": text[-6000:] if os.environ.get("RVE_DEBUG") else "",
        "kernel": version,
    }


async def run_nonft(reactor: Any, name: str) -> dict[str, Any]:
    """The layer on the tier's Debian kernel, nf_tables not loaded: what it says, and the
    create error the daemon's session makes of it."""
    from tests.realvm.build import find_kit
    from tests.realvm.host import qemu_argv

    kit = find_kit()
    if kit is None:
        raise SystemExit("no real-VM kit: run python -m tests.realvm.build first")
    namespace_setup()
    work = tempfile.mkdtemp(prefix="rvm-nonft-")
    conf = "NET=none\nBLIND=0\nSHARES=''\n"
    initrd = os.path.join(work, "initrd.cpio")
    # the tier's init discards the script's stderr: here it goes to the transcript too
    script = b"exec 2>&1\n" + render_layer(GUEST_SOCKET, LISTEN_PORT)
    run_cpio({"rvm.conf": conf.encode(), "probe.sh": script}, kit.initrd, initrd)
    dummy = os.path.join(work, "port.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(dummy)
    s.listen(4)
    argv = qemu_argv({"net": "none"}, kit, initrd, work, dummy, [])
    _qemu, code, wall = await boot(reactor, argv)
    s.close()
    with open(os.path.join(work, "transcript.txt"), "rb") as fh:
        transcript = fh.read()
    with open(os.path.join(work, "console.log"), "rb") as fh:
        console = fh.read().decode("utf-8", "replace")
    shutil.rmtree(work, ignore_errors=True)
    exit_code = next(
        (int(ln.split()[1]) for ln in console.splitlines() if ln.startswith("RVM-EXIT ")), None
    )
    session = LayerSession(b"", LayerCounters())
    session._out = bytearray(transcript[: session.MAX_OUTPUT])
    return {
        "variant": name,
        "transcript": transcript.decode("ascii", "replace").splitlines(),
        "probe_exit": exit_code,
        "error": session.why_not_ready(exit_code),
        "lines": [f"exit {exit_code}: {session.why_not_ready(exit_code)}"],
        "qemu_exit": code,
        "wall": round(wall, 1),
        "witnessed": [],
        "console": [ln.strip() for ln in console.splitlines() if ln.startswith("RVM-")],
        "kernel": kit.kernel_version,
    }
