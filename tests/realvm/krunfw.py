"""Boot the kernel users boot: libkrunfw's, from the smolmachines wheel, under QEMU/TCG.

libkrunfw.so.5 holds the guest kernel as a flat image (``krunfw_get_kernel``: load address,
entry, size) with no ELF or bzImage header; wrapped in a small ELF64 with one ``PT_LOAD`` at
the load address and a ``PT_NOTE`` carrying the kernel's own PVH entry note
(``XEN_ELFNOTE_PHYS32_ENTRY``, found inside the image), QEMU's ``-kernel`` boots it through
PVH on ``-M microvm,acpi=off`` (shared/docs/reviews/krunfw-kernel.md). The kernel has no
initrd support and no serial console: the root is a virtio-blk ext4 image (``mke2fs -d``, no
loop mount) and the console is ``hvc0`` on virtio-serial, where more ports can sit beside it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import struct
import subprocess
from collections.abc import Sequence

LIBKRUNFW = "libkrunfw.so.5"
#: The kernel command line libkrun gives libkrunfw's kernel (the same string in libkrun.so of
#: smolmachines 1.32.2 and 1.37.3). Under QEMU (:func:`cmdline`) two words change: the root,
#: a virtiofs share in libkrun, is a virtio-blk ext4 disk; and ``reboot=k`` (libkrun's VMM
#: ends the VM on the keyboard controller's reset) is ``reboot=t``, since microvm has no
#: keyboard controller (a guest's reboot then hung QEMU) and a triple fault ends it under
#: ``-no-reboot``. Besides, the init is named: the stand-in's, not libkrun's ``/init.krun``.
LIBKRUN_CMDLINE = (
    "reboot=k panic=-1 panic_print=0 nomodule console=hvc0 rootfstype=virtiofs rw quiet"
    " no-kvmapf cpuidle_haltpoll.force=1"
)
_PVH_NOTE_TYPE = 18  # XEN_ELFNOTE_PHYS32_ENTRY


def find_libkrunfw() -> str | None:
    """The wheel's libkrunfw (the ``vm`` extra's ``smol`` package), None without it."""
    spec = importlib.util.find_spec("smol")
    for base in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(base, LIBKRUNFW)
        if os.path.exists(path):
            return path
    return None


def kernel_image(lib: str) -> tuple[bytes, int, int]:
    """(the flat image, its load address, its 64-bit entry)."""
    krunfw = ctypes.CDLL(lib)
    get = krunfw.krunfw_get_kernel
    get.restype = ctypes.c_void_p
    load, entry, size = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_size_t()
    at = get(ctypes.byref(load), ctypes.byref(entry), ctypes.byref(size))
    return ctypes.string_at(at, size.value), load.value, entry.value


def pvh_entry(image: bytes) -> int:
    """The 32-bit PVH entry from the kernel's own ``Xen`` note inside the image."""
    at = 0
    while (at := image.find(b"Xen\0", at + 1)) >= 0:
        namesz, descsz, kind = struct.unpack_from("<III", image, at - 12)
        if namesz == 4 and kind == _PVH_NOTE_TYPE and descsz in (4, 8):
            return int(struct.unpack_from("<Q" if descsz == 8 else "<I", image, at + 4)[0])
    raise RuntimeError("no PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY) in libkrunfw's kernel")


def write_elf(lib: str, out: str) -> str:
    """The kernel as an ELF QEMU boots through PVH; returns the kernel's version string."""
    image, load, entry = kernel_image(lib)
    note = (
        struct.pack("<III", 4, 8, _PVH_NOTE_TYPE) + b"Xen\0" + struct.pack("<Q", pvh_entry(image))
    )
    ehsize, phsize, data_at = 64, 56, 0x1000
    note_at = ehsize + 2 * phsize
    ident = b"\x7fELF\x02\x01\x01" + b"\0" * 9
    header = struct.pack("<16sHHIQQQIHHHHHH", ident, 2, 62, 1, entry, ehsize, 0, 0, ehsize,
                         phsize, 2, 64, 0, 0)  # fmt: skip
    header += struct.pack("<IIQQQQQQ", 1, 7, data_at, load, load, len(image), len(image), 0x1000)
    header += struct.pack("<IIQQQQQQ", 4, 4, note_at, 0, 0, len(note), len(note), 4)
    header += note
    with open(out, "wb") as fh:
        fh.write(header + b"\0" * (data_at - len(header)) + image)
    at = image.find(b"Linux version ")
    return image[at + 14 : image.index(b" ", at + 14)].decode() if at >= 0 else "unknown"


def make_root(tree: str, out: str, size_mb: int = 160) -> None:
    """An ext4 image of ``tree`` (``mke2fs -d``: no loop mount, no root needed)."""
    subprocess.run(["mke2fs", "-q", "-F", "-t", "ext4", "-d", tree, "-L", "root", out,
                    f"{size_mb}M"], check=True)  # fmt: skip


def cmdline(init: str, append: str = "") -> str:
    """libkrun's command line with a virtio-blk ext4 root in place of its virtiofs one, a
    triple fault for a reboot, and ``init``; ``append`` after it (a test's extras)."""
    words = LIBKRUN_CMDLINE.replace("rootfstype=virtiofs", "root=/dev/vda rootfstype=ext4")
    words = words.replace("reboot=k", "reboot=t")
    return f"{words} init={init} {append}".rstrip()


def qemu_argv(
    kernel: str,
    root: str,
    console: str,
    ports: list[tuple[str, str]],
    *,
    init: str = "/init",
    append: str = "",
    files: Sequence[tuple[str, str]] = (),
) -> list[str]:
    """QEMU for the libkrunfw kernel: ``ports`` are (UNIX socket a chardev connects to, the
    virtio port's name), beside the console on the same virtio-serial device; ``files`` are
    (host file a port's output goes to, the port's name); ``init`` and ``append`` go on the
    kernel's command line."""
    argv = [
        "qemu-system-x86_64", "-M", "microvm,acpi=off", "-accel", "tcg", "-cpu", "max",
        "-m", "512", "-smp", "1", "-nodefaults", "-no-user-config", "-display", "none",
        "-serial", "none", "-monitor", "none", "-nic", "none", "-no-reboot",
        "-kernel", kernel,
        "-append", cmdline(init, append),
        "-drive", f"file={root},format=raw,if=none,id=d0",
        "-device", "virtio-blk-device,drive=d0",
        "-device", "virtio-serial-device",
        "-device", "virtconsole,chardev=c0",
        "-chardev", f"file,id=c0,path={console}",
    ]  # fmt: skip
    for i, (path, name) in enumerate(files):
        argv += [
            "-chardev", f"file,id=f{i},path={path}",
            "-device", f"virtserialport,chardev=f{i},name={name}",
        ]  # fmt: skip
    for i, (sock, name) in enumerate(ports):
        argv += [
            "-chardev", f"socket,id=p{i},path={sock},reconnect=1",
            "-device", f"virtserialport,chardev=p{i},name={name}",
        ]  # fmt: skip
    return argv
