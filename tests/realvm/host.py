"""One real-VM gate run: ``unshare -n -m python -m tests.realvm.host VARIANT OUT.json``.

Runs inside a network namespace with only ``lo`` (made by the caller), so no guest packet
can leave the machine. In it: stand-ins for the host's services on loopback (a raw sidecar
port, the daemon's control and metrics ports, another bottle's endpoint), an "outside"
address and a DNS stand-in on ``lo`` that answers the gate's name (so a guest
that has a path to them shows the leak, instead of failing for lack of a real internet). The
bottle's endpoint is the daemon's real forward (``ForwardTable``) on a UNIX socket, diverted
to the gate's witness, exactly as the daemon's gate step does; QEMU's virtio-serial chardev
connects to it, and the guest's relay maps ``/run/bottle/egress.sock`` onto that port. The
plan, markers, script and verdict are the daemon's own code (``bottlenet.bottles.probe``,
``bottlenet.probe``); only ``machine exec`` is replaced by booting the guest.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from twisted.internet import defer, protocol
from twisted.internet.error import ProcessDone

from bottlenet.bottles.model import TCPEndpoint
from bottlenet.bottles.probe import GateSettings, Markers, collect_rw, plan_gate
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import DEFAULT_POOL, AliasPool, ForwardSpec, TCPTarget, UNIXListen
from bottlenet.forward.table import ForwardTable
from bottlenet.probe.judge import judge
from bottlenet.probe.plan import ProbePlan
from bottlenet.probe.script import render
from bottlenet.probe.witness import Witness, WitnessFactory
from tests.realvm.build import find_kit, write_newc
from vmctl.spec import Volume

OUTSIDE = "198.51.100.7"  # TEST-NET-2, put on this namespace's lo only
#: The namespace's resolver stand-in (slirp forwards the guest's DNS to it; not to loopback).
RESOLVER = "198.51.100.53"
DNS_NAME = "gate-leak.test"
RAW_PORT, CONTROL_PORT, METRICS_PORT = 18080, 18081, 18082
#: A UDP service on host loopback (an echo): the gate must find it through slirp's gateway.
UDP_PORT = 18085
OTHER_BOTTLE = ("127.77.0.3", 18083)
GUEST_SOCKET = "/run/bottle/egress.sock"
BOOT_TIMEOUT = 240.0
#: QEMU's minimal firmware (Debian's qemu-system-data, which qemu-system-x86 depends on): it
#: hands over to the kernel about a second sooner than SeaBIOS under software emulation.
QBOOT = "/usr/share/qemu/qboot.rom"

#: variant -> how the guest is built. "net": QEMU NIC + guest config; "share": 9p-mount the
#: state dir (where the marker is) at its host path; "blind": python3 cannot connect.
VARIANTS: dict[str, dict[str, Any]] = {
    "isolated": {"net": "none", "volumes": True},
    "leaky": {"net": "leaky"},
    "nsonly": {"net": "nsonly"},
    "nic-and-mount": {"net": "restricted", "share": True},
    "blind": {"net": "leaky", "blind": True},
    # bottlenet's bridge with real clients and a real proxy (tests/realvm/bridgehost.py)
    "bridge": {"net": "none", "bridge": True},
    # transparent egress in libkrunfw's kernel; the layer on a kernel without nf_tables
    # (tests/realvm/egresshost.py)
    "egress": {"net": "none", "egress": True},
    "egress-nonft": {"net": "none", "nonft": True},
    # bottlenet's guest kit on libkrunfw's kernel, in images with no python3 and no libc
    # (tests/realvm/kitvm.py): a static busybox only, and no shell at all
    "kit-busybox": {"net": "none", "kit": "busybox"},
    "kit-noshell": {"net": "none", "kit": "noshell"},
}


def stand_ins() -> Accepts:
    """The host's services a guest must find closed: a raw sidecar port, the daemon's control
    and metrics ports, another bottle's endpoint and the outside address."""
    services = Accepts()
    for port in (RAW_PORT, CONTROL_PORT, METRICS_PORT):
        services.listen("127.0.0.1", port)
    services.listen(*OTHER_BOTTLE)
    services.listen(OUTSIDE, 443)
    return services


async def own_forward(
    reactor: Any, state_dir: str, target_port: int
) -> tuple[ForwardTable, str, TCPEndpoint]:
    """The bottle's endpoint: the daemon's real forward on a UNIX socket (QEMU's chardev
    connects to it) relaying to ``127.0.0.1:target_port``; its socket path and endpoint."""
    table = ForwardTable(reactor, AliasRegistry(AliasPool.parse(DEFAULT_POOL)), state_dir=state_dir)
    table.startService()
    listen = UNIXListen(os.path.join(state_dir, "bottles", "rvm", "egress.sock"))
    target = TCPTarget(ipaddress.IPv4Address("127.0.0.1"), target_port)
    await table.add(ForwardSpec("rvm", "egress", listen, target))
    return table, listen.path, TCPEndpoint("egress", 3128, listen.path, GUEST_SOCKET, RAW_PORT)


def stand_in_gate(
    endpoint: TCPEndpoint,
    nonce: str,
    absent: Sequence[str],
    udp_ports: tuple[int, ...] = (),
    volumes: Sequence[Volume] = (),
    kit: str | None = None,
) -> ProbePlan:
    """The gate's plan for the bottle's one endpoint against this namespace's stand-ins: the
    outside address, the DNS name, the host's control and metrics ports, another bottle."""
    settings = GateSettings(
        outside=f"{OUTSIDE}:443",
        dns_name=DNS_NAME,
        host_ports=(CONTROL_PORT, METRICS_PORT),
        udp_ports=udp_ports,
    )
    return plan_gate(
        [endpoint],
        mode="socket",
        nonce=nonce,
        other_bottle=f"{OTHER_BOTTLE[0]}:{OTHER_BOTTLE[1]}",
        settings=settings,
        absent=absent,
        volumes=volumes,
        kit=kit,
    )


def divert_to_witness(reactor: Any, table: ForwardTable, nonce: str, own: str) -> Witness:
    """The endpoint's next connection goes to the gate's witness, then back to its relay.
    Under software emulation QEMU connects at boot and the probe writes much later."""
    witness = Witness(nonce)

    def used() -> None:
        table.divert("rvm", "egress", None)

    table.divert("rvm", "egress", WitnessFactory(reactor, witness, own, used, timeout=BOOT_TIMEOUT))
    return witness


class Accepts:
    """TCP stand-ins for host services: each records the connections it accepted."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.socks: list[socket.socket] = []

    def listen(self, host: str, port: int) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(16)
        self.socks.append(s)
        key = f"{host}:{port}"
        self.seen[key] = 0

        def loop() -> None:
            while True:
                try:
                    c, _ = s.accept()
                except OSError:
                    return
                self.seen[key] += 1
                try:
                    c.sendall(b"HOST-SERVICE\n")
                finally:
                    c.close()

        threading.Thread(target=loop, daemon=True).start()


DNS_QUERIES = [0]
UDP_ECHOES = [0]


def udp_echo(host: str, port: int) -> None:
    """A UDP service stand-in that answers every datagram with its own bytes."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((host, port))

    def loop() -> None:
        while True:
            data, peer = s.recvfrom(512)
            UDP_ECHOES[0] += 1
            s.sendto(data, peer)

    threading.Thread(target=loop, daemon=True).start()


def dns_stand_in(name: str, answer: str) -> None:
    """A UDP resolver on RESOLVER:53 that answers A queries for ``name`` (and nothing else)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((RESOLVER, 53))
    want = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"

    def loop() -> None:
        while True:
            data, peer = s.recvfrom(512)
            DNS_QUERIES[0] += 1
            if len(data) < 12 or want not in data[12:].lower():
                continue
            q_end = 12 + data[12:].index(b"\0") + 5
            header = data[:2] + b"\x81\x80" + data[4:6] + b"\x00\x01\x00\x00\x00\x00"
            rr = b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x3c\x00\x04" + socket.inet_aton(answer)
            s.sendto(header + data[12:q_end] + rr, peer)

    threading.Thread(target=loop, daemon=True).start()


def namespace_setup() -> None:
    """lo up, the outside stand-in on lo, and a resolv.conf (this mount namespace only)."""
    if len(os.listdir("/sys/class/net")) and os.path.exists("/proc/net/dev"):
        with open("/proc/net/dev") as fh:
            names = [ln.split(":")[0].strip() for ln in fh.readlines()[2:]]
        if names != ["lo"]:
            raise SystemExit(f"not in a namespace with only lo: {names}")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    for addr in (OUTSIDE, RESOLVER):
        subprocess.run(["ip", "addr", "add", f"{addr}/32", "dev", "lo"], check=True)
    resolv = tempfile.NamedTemporaryFile("w", delete=False, prefix="rvm-resolv-")
    resolv.write(f"nameserver {RESOLVER}\n")
    resolv.close()
    subprocess.run(["mount", "--bind", resolv.name, "/etc/resolv.conf"], check=True)


class QemuProtocol(protocol.ProcessProtocol):
    def __init__(self) -> None:
        self.ended: defer.Deferred[int] = defer.Deferred()
        self.output = b""

    def outReceived(self, data: bytes) -> None:
        self.output = (self.output + data)[-8192:]

    errReceived = outReceived

    def processEnded(self, reason: Any) -> None:
        code = 0 if reason.check(ProcessDone) else getattr(reason.value, "exitCode", -1)
        self.ended.callback(code)


def qemu_argv(
    variant: dict[str, Any],
    kit: Any,
    initrd: str,
    work: str,
    sock: str,
    shares: list[tuple[str, str, bool]],
    ports: int = 1,
) -> list[str]:
    """QEMU's command line; ``ports`` virtio ports onto ``sock`` (the relay's pool)."""
    argv = [
        "qemu-system-x86_64",
        "-accel",
        "tcg",
        "-cpu",
        "max",  # RDRAND among its features: with random.trust_cpu the guest has entropy at once
        "-m",
        "384",
        "-smp",
        str(variant.get("smp", 1)),
        "-kernel",
        kit.vmlinux,
        "-initrd",
        initrd,
        "-append",
        # random.trust_cpu: the guest's first python3 would otherwise wait seconds for the
        # kernel to gather entropy (its hash seed reads /dev/urandom before the pool is ready);
        # cryptomgr.notests: the crypto self-tests were a tenth of the kernel's boot
        "console=ttyS0 quiet panic=-1 rdinit=/init random.trust_cpu=on cryptomgr.notests",
        "-display",
        "none",
        "-monitor",
        "none",
        "-no-reboot",
        "-nodefaults",
        "-serial",
        f"file:{work}/console.log",
        "-serial",
        f"file:{work}/transcript.txt",
        "-device",
        "virtio-serial-pci",
        "-chardev",
        f"socket,id=egress0,path={sock},reconnect=1",
        "-device",
        "virtserialport,chardev=egress0,name=egress",
    ]
    if os.path.exists(QBOOT):
        argv += ["-bios", QBOOT]
    for i in range(1, ports):
        argv += [
            "-chardev",
            f"socket,id=egress{i},path={sock},reconnect=1",
            "-device",
            f"virtserialport,chardev=egress{i},name=egress-{i}",
        ]
    net = variant["net"]
    if net == "none":
        argv += ["-nic", "none"]
    elif net == "restricted":
        argv += ["-nic", "user,model=virtio-net-pci,restrict=on"]
    else:
        argv += ["-nic", "user,model=virtio-net-pci"]
    for i, (host, _guest, ro) in enumerate(shares):
        argv += [
            "-fsdev",
            f"local,id=fs{i},path={host},security_model=none" + (",readonly=on" if ro else ""),
            "-device",
            f"virtio-9p-pci,fsdev=fs{i},mount_tag=share{i}",
        ]
    return argv


def place(root: str, files: Mapping[str, bytes | str]) -> None:
    """Write ``files`` under ``root``: guest path -> bytes, or a host file to copy."""
    for guest, data in files.items():
        target = os.path.join(root, guest.lstrip("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if isinstance(data, bytes):
            with open(target, "wb") as fh:
                fh.write(data)
        else:
            shutil.copy2(os.path.realpath(data), target)


def run_cpio(files: Mapping[str, bytes | str], base: str, out: str) -> None:
    """``base`` plus a second newc archive holding ``files`` (as :func:`place` takes them;
    the kernel unpacks both)."""
    stage = tempfile.mkdtemp(prefix="rvm-run-")
    try:
        place(stage, files)
        with open(base, "rb") as fh, open(out, "wb") as dst:
            while chunk := fh.read(1 << 20):
                dst.write(chunk)
            dst.flush()
            write_newc(stage, dst, with_root=False)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


async def boot(reactor: Any, argv: list[str]) -> tuple[QemuProtocol, int, float]:
    """Run QEMU until the guest powers off (killed after BOOT_TIMEOUT): exit code, wall."""
    qemu = QemuProtocol()
    started = time.monotonic()
    proc = reactor.spawnProcess(
        qemu, argv[0], argv, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    )
    timer = reactor.callLater(BOOT_TIMEOUT, proc.signalProcess, "KILL")
    code = await qemu.ended
    if timer.active():
        timer.cancel()
    return qemu, code, time.monotonic() - started


async def run(reactor: Any, name: str) -> dict[str, Any]:
    variant = VARIANTS[name]
    if variant.get("kit"):
        from tests.realvm import kitvm

        return await kitvm.run(reactor, name, busybox=variant["kit"] == "busybox")
    if variant.get("bridge"):
        from tests.realvm import bridgehost

        return await bridgehost.run(reactor, name)
    if variant.get("egress") or variant.get("nonft"):
        from tests.realvm import egresshost

        run_egress = egresshost.run if variant.get("egress") else egresshost.run_nonft
        return await run_egress(reactor, name)
    kit = find_kit()
    if kit is None:
        raise SystemExit("no real-VM kit: run python -m tests.realvm.build first")
    namespace_setup()
    services = stand_ins()
    dns_stand_in(DNS_NAME, OUTSIDE)
    udp_echo("127.0.0.1", UDP_PORT)

    work = tempfile.mkdtemp(prefix=f"rvm-{name}-")
    state_dir = os.path.join(work, "state")
    home = os.path.join(work, "home")
    os.makedirs(state_dir, mode=0o700)
    os.makedirs(home, mode=0o700)
    table, sock, endpoint = await own_forward(reactor, state_dir, RAW_PORT)

    shares: list[tuple[str, str, bool]] = []
    volumes: list[Volume] = []
    if variant.get("volumes"):
        for mode in ("ro", "rw"):
            d = os.path.join(work, f"vol-{mode}")
            os.makedirs(d)
            shares.append((d, f"/work/{mode}", mode == "ro"))
            volumes.append(Volume(d, f"/work/{mode}", mode == "ro"))
    if variant.get("share"):
        shares.append((state_dir, state_dir, True))  # the host's state dir, seen in the guest

    nonce = secrets.token_hex(16)
    markers = Markers(nonce, [state_dir, home])
    plan = stand_in_gate(endpoint, nonce, markers.paths, udp_ports=(UDP_PORT,), volumes=volumes)
    witness = divert_to_witness(reactor, table, nonce, str(plan.own[0]))
    conf = f"NET={variant['net']}\nBLIND={1 if variant.get('blind') else 0}\n"
    conf += (
        "SHARES='"
        + " ".join(f"share{i}:{g}" + (":ro" if ro else "") for i, (_h, g, ro) in enumerate(shares))
        + "'\n"
    )
    initrd = os.path.join(work, "initrd.cpio")
    run_cpio({"rvm.conf": conf.encode(), "probe.sh": render(plan)}, kit.initrd, initrd)

    argv = qemu_argv(variant, kit, initrd, work, sock, shares)
    qemu, code, wall = await boot(reactor, argv)
    witness.close()
    with contextlib.suppress(Exception):
        table.divert("rvm", "egress", None)
    markers.remove()
    rw_seen = collect_rw(nonce, volumes)
    await table.stopService()

    with open(os.path.join(work, "console.log"), "rb") as fh:
        console = fh.read().decode("utf-8", "replace")
    with open(os.path.join(work, "transcript.txt"), "rb") as fh:
        transcript = fh.read()
    exit_code = None
    for line in console.splitlines():
        if line.startswith("RVM-EXIT "):
            exit_code = int(line.split()[1])
    verdict = judge(plan, transcript, exit_code=exit_code, witnessed=witness.seen, rw_seen=rw_seen)
    shutil.rmtree(work, ignore_errors=True)
    rvm_lines = [ln.strip() for ln in console.splitlines() if ln.startswith("RVM-")]
    return {
        "variant": name,
        "passed": verdict.passed,
        "lines": verdict.lines(),
        "problems": list(verdict.problems),
        "witnessed": sorted(witness.seen),
        "host_accepts": services.seen,
        "dns_queries": DNS_QUERIES[0],
        "udp_echoes": UDP_ECHOES[0],
        "qemu_exit": code,
        "probe_exit": exit_code,
        "wall": round(wall, 1),
        "console": rvm_lines,
        "transcript_lines": len([ln for ln in transcript.splitlines() if ln.strip()]),
        "qemu_output": qemu.output.decode("utf-8", "replace")[-2000:] if code else "",
        "kernel": kit.kernel_version,
    }


def main() -> None:
    from twisted.internet import task

    name, out = sys.argv[1], sys.argv[2]

    async def go(r: Any) -> None:
        result = await run(r, name)
        with open(out, "w") as fh:
            json.dump(result, fh, indent=1)

    task.react(lambda r: defer.Deferred.fromCoroutine(go(r)))


if __name__ == "__main__":
    main()
