"""vmctl: the smolvm driver. It runs the smolvm CLI safely and knows nothing of bottles.

Modules: ``install`` (which smolvm, its assets, where it came from), ``runner`` (spawn with
timeouts, TERM→KILL, explicit env), ``spec`` (MachineSpec, validation, device budget, argv),
``smolvm`` (the typed API, version floor, feature detection), ``ports`` (exposed-socket and
raw-port ownership checks, stop-before-delete undo), ``service`` (the Service and the daemon
wiring), ``forksignals`` (a signal sent between a child's fork and exec is not lost),
``templates`` (smolvm's disk templates unpacked before the first start), ``kvm`` (what
``/dev/kvm`` shows before any boot), ``uids`` (per-VM uids: reserved, ended, retired, reused),
``uidranges`` (the host's ledger of uid blocks, one per data dir), ``residue`` (what a VM uid
can leave behind), ``sessionend`` (the guest-side wrapper that ends an attached command with
its session), ``errors``.
"""

from __future__ import annotations

from vmctl.errors import VmctlError
from vmctl.install import SmolvmInstall, discover
from vmctl.ports import (
    RawPortsResult,
    SocketsResult,
    check_port_owner,
    check_socket_owner,
    start_with_raw_ports,
    start_with_sockets,
)
from vmctl.runner import ProcessRunner, ProcResult, build_env, resolve_smolvm
from vmctl.service import VmctlService, make_smolvm
from vmctl.smolvm import (
    MIN_VERSION,
    ExecResult,
    Features,
    Machine,
    Smolvm,
    SmolvmVersion,
    Timeouts,
)
from vmctl.spec import ExposeSocket, MachineSpec, MountSocket, PortMapping, Volume

__all__ = [
    "MIN_VERSION",
    "ExecResult",
    "ExposeSocket",
    "Features",
    "Machine",
    "MachineSpec",
    "MountSocket",
    "PortMapping",
    "ProcResult",
    "ProcessRunner",
    "RawPortsResult",
    "Smolvm",
    "SmolvmInstall",
    "SmolvmVersion",
    "SocketsResult",
    "Timeouts",
    "VmctlError",
    "VmctlService",
    "Volume",
    "build_env",
    "check_port_owner",
    "check_socket_owner",
    "discover",
    "make_smolvm",
    "resolve_smolvm",
    "start_with_raw_ports",
    "start_with_sockets",
]
