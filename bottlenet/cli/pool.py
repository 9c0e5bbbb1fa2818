"""``bottlenetctl pool ensure|ls|rm``: the node's warm pools (``node/pools.py``).

``pool ensure --spec FILE --size N`` keeps N bottles of that spec booted, gated and bridged,
with no workload, for the creates of the same spec to take; ``pool ls`` lists each pool by its
spec hash (size, ready, filling, failed, the last failure); ``pool rm HASH`` forgets one and
destroys its waiting bottles. A create takes a pool's bottle by itself
(``bottle create --pool auto``, the default); ``--pool off`` boots a new one, ``--pool only``
refuses (RESOURCE_EXHAUSTED) when none is ready.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from bottlenet.cli.output import clean as _clean
from bottlenet.cli.output import write_table
from bottlenet.control import calls
from bottlenet.errors import InvalidArgument

if TYPE_CHECKING:
    from bottlenet.cli.invocation import Invocation
    from bottlenet.control.blocking import BlockingControlClient
    from bottlenet.control.records import PoolRecord
    from bottlenet.control.results import PoolRow

#: ``pool ls``'s columns.
COLUMNS = ["SPEC", "SIZE", "READY", "FILLING", "FAILED", "LAST ERROR"]


def pool_rows(pools: Any) -> list[list[object]]:
    """A row per pool (``pool ls``, ``node info``)."""
    return [
        [p.spec_hash, p.size, p.ready, p.filling, p.failed, _clean(p.detail or "-")] for p in pools
    ]


def _as_json(p: PoolRow | PoolRecord) -> dict[str, object]:
    return {k: getattr(p, k) for k in ("spec_hash", "size", "ready", "filling", "failed", "detail")}


def cmd_pool_ensure(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    if inv.spec_json is None:
        raise InvalidArgument("pool ensure: --spec FILE is required")
    p = c.call(calls.ensure_pool(inv.spec_json, inv.options.size))
    if inv.json:
        out.write(json.dumps(_as_json(p), sort_keys=True) + "\n")
        return
    out.write(f"pool {p.spec_hash}: {p.size} kept ({p.ready} ready, {p.filling} filling)\n")


def cmd_pool_ls(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    pools = c.call(calls.list_pools())
    if inv.json:
        out.write(json.dumps([_as_json(p) for p in pools], sort_keys=True) + "\n")
        return
    write_table(COLUMNS, pool_rows(pools), out)


def cmd_pool_rm(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    key = inv.options.spec_hash
    destroyed = c.call(calls.remove_pool(key))
    if inv.json:
        out.write(json.dumps({"spec_hash": key, "destroyed": destroyed}) + "\n")
    else:
        out.write(f"pool {_clean(key)} removed ({destroyed} waiting bottle(s) destroyed)\n")


def size(text: str) -> int:
    """A pool's size: 0 or more (an argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def register(sub: Any, add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``pool ensure|ls|rm``; ``add`` is cli.build_parser's helper."""
    pool = sub.add_parser("pool", help="warm pools: bottles kept ready").add_subparsers(
        dest="pool_command", required=True, metavar="ACTION"
    )
    sp = add(pool, "ensure", cmd_pool_ensure, "keep N bottles of a spec ready for its creates")
    sp.add_argument("--spec", metavar="FILE.toml", required=True, help="the bottles' spec")
    sp.add_argument("--size", type=size, required=True, metavar="N", help="bottles kept ready")
    add(pool, "ls", cmd_pool_ls, "the warm pools: size, ready, filling, failed")
    sp = add(pool, "rm", cmd_pool_rm, "forget a pool and destroy its waiting bottles")
    sp.add_argument("spec_hash", metavar="HASH", help="the pool's spec hash, as pool ls shows it")
