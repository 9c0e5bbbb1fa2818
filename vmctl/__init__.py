"""vmctl: the smolvm driver. It runs the smolvm CLI safely and knows nothing of bottles.

Modules: ``runner`` (spawn with timeouts, TERM→KILL, explicit env), ``spec`` (MachineSpec,
validation, device budget, argv), ``smolvm`` (the typed API), ``ports`` (raw-port allocation,
retry and ownership checks), ``service`` (the Service and the daemon wiring), ``errors``.
"""

from __future__ import annotations

from vmctl.errors import VmctlError
from vmctl.ports import RawPortsResult, check_port_owner, start_with_raw_ports
from vmctl.runner import ProcessRunner, ProcResult, build_env, resolve_smolvm
from vmctl.service import VmctlService, make_smolvm
from vmctl.smolvm import MIN_VERSION, ExecResult, Machine, Smolvm, SmolvmVersion, Timeouts
from vmctl.spec import MachineSpec, MountSocket, PortMapping, Volume

__all__ = [
    "MIN_VERSION",
    "ExecResult",
    "Machine",
    "MachineSpec",
    "MountSocket",
    "PortMapping",
    "ProcResult",
    "ProcessRunner",
    "RawPortsResult",
    "Smolvm",
    "SmolvmVersion",
    "Timeouts",
    "VmctlError",
    "VmctlService",
    "Volume",
    "build_env",
    "check_port_owner",
    "make_smolvm",
    "resolve_smolvm",
    "start_with_raw_ports",
]
