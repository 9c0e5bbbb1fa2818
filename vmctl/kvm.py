"""Can this host boot smolvm's VMs? What the host shows about ``/dev/kvm`` before any boot.

smolvm itself finds out only when a VM starts (``KVM_UNAVAILABLE``); a node reporting whether
VM bottles are possible here (``NodeInfo``) wants the answer before anyone tries. This reads
what the device shows without booting anything: it exists, is a character device, opens
read-write (for the daemon's uid), and answers ``KVM_GET_API_VERSION`` with the stable API
(12). A device that passes may still refuse a guest (a host that runs only PVM guests does,
and as root smolvm's VM processes run under uids of their own): the daemon also learns from a
create that failed with ``KVM_UNAVAILABLE``.
"""

from __future__ import annotations

import fcntl
import os
import stat

from attrs import frozen

KVM_PATH = "/dev/kvm"
#: ``_IO(KVMIO, 0x00)``: the ioctl every KVM user asks first.
KVM_GET_API_VERSION = 0xAE00
KVM_API_VERSION = 12


@frozen
class KvmStatus:
    """Whether VMs can boot here as far as the host shows; ``why`` says why not."""

    usable: bool
    why: str | None = None

    def describe(self) -> str:
        return "usable" if self.usable else f"not usable: {self.why}"


def probe_kvm(path: str = KVM_PATH) -> KvmStatus:
    """Look at ``path`` (no VM is booted; nothing is changed)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return KvmStatus(False, f"{path} is missing (no KVM module or no hardware virtualization)")
    except OSError as e:
        return KvmStatus(False, f"{path}: {e.strerror}")
    if not stat.S_ISCHR(st.st_mode):
        return KvmStatus(False, f"{path} is not a character device")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return KvmStatus(False, f"cannot open {path}: {e.strerror}")
    try:
        version = fcntl.ioctl(fd, KVM_GET_API_VERSION)
    except OSError as e:
        return KvmStatus(False, f"{path} does not answer KVM_GET_API_VERSION: {e.strerror}")
    finally:
        os.close(fd)
    if version != KVM_API_VERSION:
        return KvmStatus(False, f"{path} speaks KVM API {version}, not {KVM_API_VERSION}")
    return KvmStatus(True)
