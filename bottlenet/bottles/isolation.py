"""Which isolation mode a bottle gets, which mechanism enforces it, and the agent VM flags.

The decision fails closed: when nothing can enforce isolation the create is refused with
ISOLATION_UNAVAILABLE before any VM exists. Only socket mode can be enforced by smolvm
(>= 1.8.0, the version floor): the agent VM gets no network device at all, and its endpoints
are host UNIX sockets mounted with ``--mount-socket``.

Alias mode (the agent reaches its endpoints on one host loopback alias, 127.77.x.y) cannot
be enforced by any smolvm the floor admits, so it is refused. Read in the real 1.32.2 CLI
(``machine create --help``) and the smolvm source:

* TSI (``--net`` alone) refuses host loopback since 1.3.3 (PR #510), and guest iptables do
  not see TSI flows (the guest kernel hands the connect to the host), so no guest rule can
  narrow it;
* virtio-net (any ``--allow-cidr``/``--deny-cidr``/``--block-private``, ports, ``--network``)
  gives the guest its own loopback: 127.77.x.y in the guest is the guest itself. The only way
  to the host is the gateway address, which smolvm redirects to host ``127.0.0.1`` itself,
  never to an alias (``crates/smolvm-network/src/tcp_relay.rs`` ``host_connect_addr``);
* ``--outbound-localhost-only`` is ``--allow-cidr 127.0.0.0/8`` plus ``::1`` on virtio-net
  (``src/cli/machine.rs`` ``resolve_egress_flags``): the guest's loopback, not one host
  alias.

Forward-only bottles (the launcher runs its own VMs) keep their aliases.
"""

from __future__ import annotations

from attrs import frozen

from bottlenet.errors import IsolationUnavailable
from bottlenet.probe.plan import IsolationMode
from vmctl.smolvm import SmolvmVersion

#: Where the agent endpoints of a socket-mode bottle appear inside the agent VM (a tmpfs).
GUEST_SOCKET_DIR = "/run/bottle"
#: The agent VM's workload at create: a command of bottlenet's that only waits. A create
#: command replaces the image's ENTRYPOINT+CMD, so the agent's own code never starts on
#: ``machine start``; bottlenet starts it with ``exec -d`` after the launch gate passed.
AGENT_WAIT_COMMAND = ("sleep", "infinity")

MECH_SOCKET = "socket"
SOCKET_PLATFORMS = ("linux", "darwin")

ALIAS_UNAVAILABLE = (
    "alias mode cannot be enforced by smolvm: a TSI guest cannot reach host loopback "
    "(refused since smolvm 1.3.3) and guest firewall rules do not see TSI traffic, while a "
    "virtio-net guest's 127.77.x.y is its own loopback and its only way to the host lands on "
    '127.0.0.1, never on one alias; use mode = "socket" with a local agent image'
)


@frozen
class IsolationPlan:
    """The chosen mode and the mechanism that enforces it."""

    mode: IsolationMode
    mechanism: str
    smolvm: str

    def describe(self) -> str:
        """One line for BottleStatus: which mechanism enforces isolation."""
        return (
            f"socket: agent VM has no network device; its endpoints are host UNIX sockets "
            f"mounted with --mount-socket (smolvm {self.smolvm})"
        )


def guest_socket_path(service: str) -> str:
    return f"{GUEST_SOCKET_DIR}/{service}.sock"


def choose_isolation(
    requested: str,
    version: SmolvmVersion,
    platform: str,
    *,
    local_agent_image: bool,
) -> IsolationPlan:
    """Pick the mode for the request, or raise IsolationUnavailable (fail closed)."""
    v = str(version)
    if requested == IsolationMode.ALIAS:
        raise IsolationUnavailable(ALIAS_UNAVAILABLE)
    if not platform.startswith(SOCKET_PLATFORMS):
        raise IsolationUnavailable(
            f"socket mode needs smolvm's --mount-socket on Linux or macOS, this is {platform}"
        )
    if requested != IsolationMode.SOCKET and not local_agent_image:
        # auto with a registry image: the network-less agent VM could not pull it.
        raise IsolationUnavailable(
            "no isolation mode can be enforced: socket mode needs a local agent image (the "
            "agent VM has no network to pull one), and " + ALIAS_UNAVAILABLE
        )
    return IsolationPlan(IsolationMode.SOCKET, MECH_SOCKET, v)
