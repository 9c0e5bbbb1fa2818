"""``ray start`` arguments from this node's daemon: its ``bottle`` resource and its labels.

    ray start --address=HEAD --num-cpus=0 $(python -m bottlenet.fleet.raystart)

prints ``--resources={"bottle":N} --labels=k=v,...,bottlenet-vm=true|false``: N is the
daemon's capacity (``NodeInfo.max_bottles``, or ``--bottles`` if smaller), the labels are the
daemon's ``--label``s plus whether VM bottles are possible here, so a trainer can select
VM-capable nodes. Run it with the venv the node's Ray runs from (the `ray` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bottlenet.control.blocking import BlockingControlClient
from bottlenet.control.clienterrors import ControlConnectionError, DaemonUnreachable
from bottlenet.control.results import NodeInfoRecord
from bottlenet.errors import BottlenetError
from bottlenet.paths import default_control_path, default_state_dir

VM_LABEL = "bottlenet-vm"


def ray_start_args(info: NodeInfoRecord, bottles: int | None = None) -> list[str]:
    """The arguments for ``ray start`` that describe this node to Ray's scheduler."""
    count = info.max_bottles if bottles is None else min(bottles, info.max_bottles)
    labels = {**info.labels, VM_LABEL: "true" if info.vm_possible else "false"}
    resources = json.dumps({"bottle": count}, separators=(",", ":"))
    return [
        f"--resources={resources}",
        "--labels=" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bottlenet.fleet.raystart")
    parser.add_argument("--control", help="the daemon's control socket (default as bottlenetctl)")
    parser.add_argument("--bottles", type=int, help="offer at most this many bottles to Ray")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    control = (
        args.control
        or env.get("BOTTLENET_CONTROL")
        or default_control_path(env, default_state_dir(env))
    )
    try:
        with BlockingControlClient(control) as client:
            info = client.node_info()
    except (BottlenetError, ControlConnectionError, DaemonUnreachable) as e:
        print(f"raystart: {e}", file=sys.stderr)
        return 1
    print(" ".join(ray_start_args(info, args.bottles)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
