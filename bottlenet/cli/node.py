"""``bottlenetctl node info|drain|undrain``: this host as one node of a fleet (NodeInfo, Drain).

``node drain`` refuses new bottles from now on (creates get ``DRAINING``); ``--wait`` waits
until the node holds no bottle (``--wait-timeout`` bounds it: exit 1 with ``error: TIMEOUT``
when bottles are still held then).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from bottlenet.cli.output import clean as _clean
from bottlenet.cli.output import write_table
from bottlenet.control import calls
from bottlenet.control.results import PoolRow
from bottlenet.errors import BottlenetError

if TYPE_CHECKING:
    from bottlenet.cli.invocation import Invocation
    from bottlenet.control.blocking import BlockingControlClient
    from bottlenet.control.lightclient import LightControlClient
    from bottlenet.control.results import NodeInfoRecord

    Client = BlockingControlClient | LightControlClient


class DrainTimedOut(BottlenetError):
    """``node drain --wait``: bottles were still held when the wait ended."""

    code = "TIMEOUT"


def node_rows(n: NodeInfoRecord) -> list[list[object]]:
    """``node info``'s table (``status`` shows its first rows too)."""
    rows: list[list[object]] = [
        ["host", n.host],
        ["draining", "yes" if n.draining else "no"],
        ["health", n.health],
    ]
    rows += [["health reason", r] for r in n.health_reasons]
    rows += [
        ["bottles", f"{n.bottles} of {n.max_bottles} ({n.vm_bottles} with VMs)"],
        ["connections", f"{n.connections_used} of {n.connections_total}"],
        ["VM bottles", "possible" if n.vm_possible else f"not possible: {n.vm_why_not}"],
        ["smolvm", (n.smolvm or "-") + (" (untested)" if n.smolvm_tested is False else "")],
        ["kvm", n.kvm],
        ["privilege", n.privilege],
        ["VM uids", n.vm_uids or "-"],
        ["daemon", n.server_version],
        ["protocol", n.protocol],
    ]
    rows += [[f"label {k}", v] for k, v in sorted(n.labels.items())]
    rows += [
        [
            f"pool {p.spec_hash}",
            f"{p.ready} ready of {p.size} ({p.filling} filling, {p.failed} failed)",
        ]
        for p in n.pools
    ]
    return rows


def cmd_node_info(c: Client, inv: Invocation, out: TextIO) -> None:
    n = c.call(calls.node_info())
    if inv.json:
        fields = n._asdict()
        fields["pools"] = [{k: getattr(p, k) for k in PoolRow._fields} for p in n.pools]
        out.write(json.dumps(fields, sort_keys=True) + "\n")
        return
    write_table(["FIELD", "VALUE"], [[k, _clean(str(v))] for k, v in node_rows(n)], out)


def cmd_node_drain(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    wait = inv.options.wait
    r = c.call(calls.drain(wait, inv.options.wait_timeout))
    if inv.json:
        out.write(json.dumps(r._asdict(), sort_keys=True) + "\n")
    elif r.empty:
        out.write("draining: the node holds no bottle\n")
    else:
        out.write(f"draining: new bottles are refused; {r.held} still held\n")
    if wait and not r.empty:
        raise DrainTimedOut(f"{r.held} bottle(s) still held when the wait ended")


def cmd_node_undrain(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    c.call(calls.undrain())
    if inv.json:
        out.write(json.dumps({"draining": False}) + "\n")
    else:
        out.write("undrained: new bottles are taken\n")


def seconds(text: str) -> float:
    """A positive, finite number of seconds (an argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


def register(sub: Any, add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``node info|drain|undrain``; ``add`` is cli.build_parser's helper."""
    node = sub.add_parser("node", help="this node: info, drain, undrain").add_subparsers(
        dest="node_command", required=True, metavar="ACTION"
    )
    add(node, "info", cmd_node_info, "identity, labels, capacity, health, draining", light=True)
    sp = add(node, "drain", cmd_node_drain, "refuse new bottles (existing ones keep running)")
    sp.add_argument("--wait", action="store_true", help="wait until the node holds no bottle")
    sp.add_argument(
        "--wait-timeout",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="with --wait: give up after this long (exit 1, error TIMEOUT)",
    )
    add(node, "undrain", cmd_node_undrain, "take new bottles again")
