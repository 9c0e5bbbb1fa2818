"""Build what the real-VM tier boots: Debian's stock kernel and a busybox + python3 initramfs.

Everything comes from Debian packages by name (``.ci/run`` installs ``qemu-system-x86``,
``busybox-static``, ``cpio`` and ``python3``): the kernel is ``apt-get download``-ed (the
package ``linux-image-amd64`` depends on) and unpacked here, never installed. The uncompressed
``vmlinux`` is carved out of ``vmlinuz`` (an XZ stream inside the bzImage), because QEMU boots
it through PVH, several seconds faster under software emulation than decompressing a bzImage.

The result is cached in ``$BOTTLENET_REALVM_CACHE`` (default ``/var/tmp/bottlenet-realvm``),
keyed by kernel version and a hash of the guest's files and of ``LAYOUT``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import BinaryIO, NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.environ.get("BOTTLENET_REALVM_CACHE", "/var/tmp/bottlenet-realvm")
GUEST_PYTHON = "/usr/bin/python3"
BUSYBOX = "/bin/busybox"
#: Loaded in this order by init.sh (each after what it depends on); built-ins are skipped.
MODULES = (
    "drivers/virtio/virtio_ring.ko",
    "drivers/virtio/virtio.ko",
    "drivers/virtio/virtio_pci_legacy_dev.ko",
    "drivers/virtio/virtio_pci_modern_dev.ko",
    "drivers/virtio/virtio_pci.ko",
    "drivers/char/virtio_console.ko",
    "net/core/failover.ko",
    "drivers/net/net_failover.ko",
    "drivers/net/virtio_net.ko",
    "fs/netfs/netfs.ko",
    "fs/fscache/fscache.ko",
    "net/9p/9pnet.ko",
    "net/9p/9pnet_virtio.ko",
    "fs/9p/9p.ko",
)
#: What the guest's python3 must import: the probe (bottlenet/probe/guest.py), the relay, and
#: the transparent egress layer (bottlenet/transparent, its ``egress-nonft`` run).
PY_IMPORTS = (
    "hashlib os socket struct sys tempfile threading time select"
    " __future__ argparse ipaddress re collections errno stat importlib.abc importlib.util"
)


class Kit(NamedTuple):
    vmlinux: str
    initrd: str  # an uncompressed newc cpio; a per-run cpio is appended to it
    kernel_version: str


def missing_tools() -> list[str]:
    need = ["qemu-system-x86_64", "cpio", "apt-get", "dpkg-deb", "unshare", "ip"]
    out = [t for t in need if shutil.which(t) is None]
    out += [p for p in (BUSYBOX, GUEST_PYTHON) if not os.path.exists(p)]
    return out


def _run(*argv: str, cwd: str | None = None) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, cwd=cwd).stdout


def kernel_package() -> str:
    out = _run("apt-cache", "depends", "linux-image-amd64")
    m = re.search(r"Depends: (linux-image-[0-9][^\s]*-amd64)", out)
    if m is None:
        raise RuntimeError("apt-cache knows no linux-image-amd64 (run apt-get update)")
    return m.group(1)


def carve_vmlinux(vmlinuz: str, out: str) -> None:
    """The ELF kernel inside a bzImage: decompress the XZ stream that starts at its magic."""
    with open(vmlinuz, "rb") as fh:
        data = fh.read()
    at = data.find(b"\xfd7zXZ\x00")
    if at < 0:
        raise RuntimeError(f"{vmlinuz}: no XZ stream in the bzImage")
    d = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    elf = d.decompress(data[at:])
    if elf[:4] != b"\x7fELF":
        raise RuntimeError(f"{vmlinuz}: the XZ stream is not an ELF kernel")
    with open(out, "wb") as fh:
        fh.write(elf)


def _python_files(imports: str = PY_IMPORTS) -> list[str]:
    """The files the guest python3 opens for ``imports`` (stdlib modules with their cached
    bytecode, extension modules)."""
    code = (
        f"import {', '.join(imports.split())}, sys\n"
        "for m in list(sys.modules.values()):\n"
        "    f = getattr(m, '__file__', None)\n"
        "    if f: print(f)\n"
    )
    files = set(_run(GUEST_PYTHON, "-I", "-S", "-c", code).split())
    # and their bytecode: a guest that compiles the stdlib under software emulation spends
    # seconds on it at every boot (the guest python3 is this python3, so the .pyc files fit)
    pycs = {importlib.util.cache_from_source(f) for f in files if f.endswith(".py")}
    return sorted(files | {p for p in pycs if os.path.exists(p)})


def _libs(binaries: list[str]) -> list[str]:
    libs: set[str] = set()
    for b in binaries:
        try:
            out = _run("ldd", b)
        except subprocess.CalledProcessError:
            continue  # static
        for line in out.splitlines():
            m = re.search(r"(/\S+)", line.split("=>")[-1])
            if m:
                libs.add(m.group(1))
    return sorted(libs)


def _copy(src: str, root: str, dest: str | None = None) -> None:
    target = os.path.join(root, (dest or src).lstrip("/"))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copy2(os.path.realpath(src), target)


def build_initrd(root: str, modules_dir: str, out: str) -> None:
    for d in ("bin", "sbin", "dev", "proc", "sys", "run", "tmp", "etc", "mnt", "lib/modules"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    _copy(BUSYBOX, root, "/bin/busybox")
    os.symlink("busybox", os.path.join(root, "bin", "sh"))
    _copy(GUEST_PYTHON, root, "/usr/bin/python3")
    files = _python_files()
    for f in files:
        _copy(f, root)
    # libgcc_s: a guest python3 that exits with threads still running aborts without it
    extra = [p for p in ("/lib/x86_64-linux-gnu/libgcc_s.so.1",) if os.path.exists(p)]
    for lib in _libs([GUEST_PYTHON, *[f for f in files if f.endswith(".so")]]) + extra:
        _copy(lib, root)
    order = []
    for m in MODULES:
        src = os.path.join(modules_dir, m)
        if os.path.exists(src):
            shutil.copy2(src, os.path.join(root, "lib", "modules", os.path.basename(m)))
            order.append(os.path.basename(m))
    with open(os.path.join(root, "lib", "modules", "order"), "w") as fh:
        fh.write("\n".join(order) + "\n")
    for name in ("init.sh", "relay.py", "blind-python3"):
        _copy(os.path.join(HERE, name), root, f"/{name}")
    os.rename(os.path.join(root, "init.sh"), os.path.join(root, "init"))
    os.chmod(os.path.join(root, "init"), 0o755)
    os.chmod(os.path.join(root, "blind-python3"), 0o755)
    with open(out, "wb") as fh:
        write_newc(root, fh, with_root=True)


def write_newc(root: str, dst: BinaryIO, *, with_root: bool) -> None:
    """Every file under ``root`` as one newc cpio archive, written to ``dst``. ``with_root``:
    ``.`` is an entry too (an initramfs's own root; an archive appended to one leaves it)."""
    find = ["find", "."] if with_root else ["find", ".", "-mindepth", "1"]
    names = _run(*find, cwd=root).split("\n")
    subprocess.run(
        ["cpio", "-o", "-H", "newc", "--quiet"],
        input="\n".join(n for n in names if n).encode(),
        stdout=dst,
        cwd=root,
        check=True,
    )


#: Bump when build_initrd changes what goes into the initramfs.
LAYOUT = 2


def _source_hash() -> str:
    h = hashlib.sha256(f"{LAYOUT} {MODULES} {PY_IMPORTS}".encode())
    for name in ("init.sh", "relay.py", "blind-python3"):
        with open(os.path.join(HERE, name), "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:12]


def _kit_in(dest: str, version: str) -> Kit:
    """The kit whose files are in ``dest`` (built or not)."""
    return Kit(os.path.join(dest, "vmlinux"), os.path.join(dest, "initrd.cpio"), version)


def _cached(package: str) -> tuple[str, Kit]:
    version = package.removeprefix("linux-image-")
    dest = os.path.join(CACHE, f"{version}-{_source_hash()}")
    return dest, _kit_in(dest, version)


#: Set by the tier's fixture for its runs: the kit it found, so that each run need not ask apt.
KIT_ENV = "BOTTLENET_REALVM_KIT"


def find_kit() -> Kit | None:
    """The kit if it was built already (no network needed: tests run in a namespace)."""
    named = os.environ.get(KIT_ENV)
    if named and os.path.basename(named).endswith(f"-{_source_hash()}"):
        version = os.path.basename(named).rsplit("-", 1)[0]
        kit = _kit_in(named, version)
        return kit if os.path.exists(kit.initrd) else None
    try:
        _, kit = _cached(kernel_package())
    except (RuntimeError, OSError, subprocess.CalledProcessError):
        return None
    return kit if os.path.exists(kit.initrd) else None


def ensure_kit() -> Kit:
    """The cached kernel + initramfs, built on first use (about 15 s; downloads the kernel)."""
    package = kernel_package()
    dest, kit = _cached(package)
    version = kit.kernel_version
    if os.path.exists(kit.initrd):
        return kit
    os.makedirs(CACHE, exist_ok=True)
    work = tempfile.mkdtemp(prefix="build-", dir=CACHE)
    try:
        _run("apt-get", "download", package, cwd=work)
        deb = next(os.path.join(work, n) for n in os.listdir(work) if n.endswith(".deb"))
        members = [f"./boot/vmlinuz-{version}"] + [
            f"./lib/modules/{version}/kernel/{m}" for m in MODULES
        ]
        tar = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", deb], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", work, *members], stdin=tar.stdout, check=True)
        if tar.wait() != 0:
            raise RuntimeError(f"dpkg-deb could not read {deb}")
        stage = os.path.join(work, "stage")
        os.makedirs(stage)
        carve_vmlinux(
            os.path.join(work, "boot", f"vmlinuz-{version}"), os.path.join(stage, "vmlinux")
        )
        root = os.path.join(work, "root")
        build_initrd(
            root,
            os.path.join(work, "lib", "modules", version, "kernel"),
            os.path.join(stage, "initrd.cpio"),
        )
        for old in os.listdir(CACHE):  # kits of older sources for this kernel
            if old.startswith(f"{version}-"):
                shutil.rmtree(os.path.join(CACHE, old), ignore_errors=True)
        os.rename(stage, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return kit


if __name__ == "__main__":
    k = ensure_kit()
    print(k.vmlinux, k.initrd, k.kernel_version)
    sys.exit(0)


# -- the static programs of the libkrunfw guests (tests/realvm/krunfw.py boots the kernel) ----


class KrunfwKit(NamedTuple):
    """libkrunfw's kernel wrapped for QEMU (``krunfw.write_elf``), and the static programs
    the kit's guests run (tests/realvm/kitvm.py)."""

    kernel: str
    version: str  # the kernel's own version string (libkrunfw's Linux)
    agent: str  # tests/realvm/agent.c, static: PID 1, a stand-in for smolvm's guest agent
    hello: str  # a static program: no shell and no libc of the image behind it


HELLO_C = '#include <stdio.h>\nint main(void) { puts("hello from a static program"); return 0; }\n'


def krunfw_missing() -> list[str]:
    """What the libkrunfw guests need that this host lacks."""
    from tests.realvm import krunfw

    out = [t for t in ("qemu-system-x86_64", "gcc", "mke2fs", "unshare") if not shutil.which(t)]
    if krunfw.find_libkrunfw() is None:
        out.append("smolmachines (the bottlenet[vm] extra: libkrunfw.so.5)")
    return out


def ensure_krunfw() -> KrunfwKit:
    """The wrapped kernel and the static agent and program, cached by libkrunfw's and the
    agent's bytes (about a second to build)."""
    from tests.realvm import krunfw

    lib = krunfw.find_libkrunfw()
    if lib is None:
        raise RuntimeError("no libkrunfw.so.5: install bottlenet[vm]")
    h = hashlib.sha256()
    for path in (lib, os.path.join(HERE, "agent.c")):
        with open(path, "rb") as fh:
            h.update(fh.read())
    h.update(HELLO_C.encode())
    dest = os.path.join(CACHE, f"krunfw-{h.hexdigest()[:12]}")
    names = ("vmlinux-krunfw.elf", "version", "agent", "hello")
    kernel, version, agent, hello = (os.path.join(dest, n) for n in names)
    if not os.path.exists(hello):
        os.makedirs(CACHE, exist_ok=True)
        work = tempfile.mkdtemp(prefix="krunfw-", dir=CACHE)
        try:
            with open(os.path.join(work, "version"), "w") as fh:
                fh.write(krunfw.write_elf(lib, os.path.join(work, "vmlinux-krunfw.elf")))
            _run("gcc", "-static", "-O2", "-o", os.path.join(work, "agent"),
                 os.path.join(HERE, "agent.c"))  # fmt: skip
            with open(os.path.join(work, "hello.c"), "w") as fh:
                fh.write(HELLO_C)
            _run("gcc", "-static", "-O2", "-o", os.path.join(work, "hello"),
                 os.path.join(work, "hello.c"))  # fmt: skip
            os.unlink(os.path.join(work, "hello.c"))
            shutil.rmtree(dest, ignore_errors=True)
            os.rename(work, dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    with open(version) as fh:
        return KrunfwKit(kernel, fh.read().strip(), agent, hello)
