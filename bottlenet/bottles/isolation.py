"""Which isolation mode a bottle gets, which mechanism enforces it, and the agent VM flags.

The decision is made from the installed smolvm version, the host platform, the request and
the daemon configuration, and it fails closed: when nothing can enforce isolation the create
is refused with ISOLATION_UNAVAILABLE before any VM exists. The version table comes from
docs/smolvm-cli.md (read from smolvm 1.9.2):

==========================  ==========  ===================================================
feature                     smolvm      consequence
==========================  ==========  ===================================================
TSI + ``--allow-cidr``      < 1.1.3     alias mode enforced by smolvm's allow-list
egress policy -> virtio-net >= 1.1.3    TSI + allow-list refused: alias mode needs the
                                        guest iptables fallback (opt-in)
``--mount-socket``          >= 1.6.4    socket mode (no network device at all)
==========================  ==========  ===================================================
"""

from __future__ import annotations

from attrs import frozen

from bottlenet.errors import IsolationUnavailable
from vmctl.smolvm import SmolvmVersion

#: Where the agent endpoints of a socket-mode bottle appear inside the agent VM (a tmpfs).
GUEST_SOCKET_DIR = "/run/bottle"
#: The agent VM's workload at create: a command of bottlenet's that only waits. A create
#: command replaces the image's ENTRYPOINT+CMD, so the agent's own code never starts on
#: ``machine start``; bottlenet starts it with ``exec -d`` after the launch gate passed.
AGENT_WAIT_COMMAND = ("sleep", "infinity")

MODE_ALIAS = "alias"
MODE_SOCKET = "socket"
MECH_SOCKET = "socket"
MECH_TSI_ALLOW = "alias-tsi-allow-cidr"
MECH_IPTABLES = "alias-guest-iptables"
SOCKET_PLATFORMS = ("linux", "darwin")


@frozen
class IsolationPlan:
    """The chosen mode and the mechanism that enforces it."""

    mode: str
    mechanism: str
    smolvm: str

    @property
    def uses_iptables(self) -> bool:
        return self.mechanism == MECH_IPTABLES

    def describe(self, alias: str | None) -> str:
        """One line for BottleStatus: which mechanism enforces isolation."""
        if self.mechanism == MECH_SOCKET:
            return (
                f"socket: agent VM has no network device; its endpoints are host UNIX sockets "
                f"mounted with --mount-socket (smolvm {self.smolvm})"
            )
        if self.mechanism == MECH_TSI_ALLOW:
            return f"alias: TSI with --allow-cidr {alias}/32 (smolvm {self.smolvm})"
        return (
            f"alias: TSI plus guest iptables (allow {alias}/32, drop all else) installed "
            f"through exec before the workload (smolvm {self.smolvm}, --alias-iptables-fallback)"
        )


def tsi_allow_list_enforced(version: SmolvmVersion) -> bool:
    """smolvm < 1.1.3 accepts TSI with an allow-list; later ones switch to virtio-net."""
    return version.triple < (1, 1, 3)


def guest_socket_path(service: str) -> str:
    return f"{GUEST_SOCKET_DIR}/{service}.sock"


def choose_isolation(
    requested: str,
    version: SmolvmVersion,
    platform: str,
    *,
    iptables_fallback: bool,
    local_agent_image: bool,
) -> IsolationPlan:
    """Pick the strongest enforceable mode for the request, or raise IsolationUnavailable."""
    v = str(version)
    socket_ok = version.supports_mount_socket and platform.startswith(SOCKET_PLATFORMS)
    socket_why = (
        f"socket mode needs smolvm >= 1.6.4 (--mount-socket) on Linux or macOS, have {v} on "
        f"{platform}"
    )
    if tsi_allow_list_enforced(version):
        alias_plan: IsolationPlan | None = IsolationPlan(MODE_ALIAS, MECH_TSI_ALLOW, v)
    elif iptables_fallback:
        alias_plan = IsolationPlan(MODE_ALIAS, MECH_IPTABLES, v)
    else:
        alias_plan = None
    alias_why = (
        f"alias mode: smolvm {v} refuses TSI with an allow-list (>= 1.1.3 switches to "
        "virtio-net) and the guest iptables fallback is not enabled (--alias-iptables-fallback)"
    )
    if requested == MODE_SOCKET:
        if not socket_ok:
            raise IsolationUnavailable(socket_why)
        return IsolationPlan(MODE_SOCKET, MECH_SOCKET, v)
    if requested == MODE_ALIAS:
        if alias_plan is None:
            raise IsolationUnavailable(alias_why)
        return alias_plan
    # auto: socket first (nothing reachable but the mounted sockets), then alias.
    if socket_ok and local_agent_image:
        return IsolationPlan(MODE_SOCKET, MECH_SOCKET, v)
    if alias_plan is not None:
        return alias_plan
    reasons = [alias_why]
    if not socket_ok:
        reasons.insert(0, socket_why)
    else:
        reasons.insert(0, "socket mode needs a local agent image (the VM has no network)")
    raise IsolationUnavailable("no isolation mode can be enforced: " + "; ".join(reasons))


def iptables_argv(alias: str) -> list[str]:
    """Guest-side rules of the alias fallback: TCP to ``alias`` only, everything else dropped.

    Run as root through ``exec`` after the agent VM starts and before its workload (which
    must run as a non-root user so it cannot undo them).
    """
    script = (
        "set -e\n"
        "iptables -w -P OUTPUT DROP\n"
        "iptables -w -F OUTPUT\n"
        'iptables -w -A OUTPUT -p tcp -d "$1/32" -j ACCEPT\n'
        "ip6tables -w -P OUTPUT DROP\n"
        "ip6tables -w -F OUTPUT\n"
    )
    return ["/bin/sh", "-c", script, "sh", alias]
