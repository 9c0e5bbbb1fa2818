"""A pool of bottles placed by Ray, used, and destroyed (docs/fleet.md, "Try it on one machine").

    python examples/fleet_pool.py [--count 4] [--address auto]

Each bottle here is forward-only (no VM: the pool works the same with a VM spec on a KVM
host, ``BottleRequest(spec=BottleSpec(...).to_json())``); the script prints where each one
went and its status as its node's daemon reports it, and destroys them all on the way out.
"""

from __future__ import annotations

import argparse

import ray

from bottlenet.fleet import BottlePool, BottleRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    args = parser.parse_args()
    ray.init(address=args.address, log_to_driver=False)
    with BottlePool(args.count, BottleRequest(lease_seconds=30)) as pool:
        for bottle in pool:
            record = bottle.status()
            print(f"{bottle.name} on {bottle.placement.hostname}: {record.state}, "
                  f"lease {record.lease_seconds:g}s")  # fmt: skip
    print(f"{args.count} bottles destroyed")


if __name__ == "__main__":
    main()
