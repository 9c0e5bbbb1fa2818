"""``bottlenetctl down --all``: destroy every bottle (before stopping the daemon for good).

The daemon keeps VMs running across its own restarts (``KillMode=process``), so stopping the
service does not tear bottles down; this does. It lists every bottle first (all pages), then
sends one ``DestroyBottle`` per name, so the listing's offsets never shift under it, and lists
again until nothing is left or a pass makes no progress (a bottle that keeps failing).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from bottlenet.cli.invocation import every
from bottlenet.cli.output import clean as _clean
from bottlenet.control import calls
from bottlenet.errors import BottlenetError, NotFound

if TYPE_CHECKING:
    from bottlenet.cli.invocation import Invocation
    from bottlenet.control.blocking import BlockingControlClient

#: Passes over ListBottles before giving up on bottles created while we tear down.
MAX_PASSES = 5


def bottle_names(client: BlockingControlClient, page_size: int | None = None) -> list[str]:
    """Every bottle's name, following ``next_offset`` until the last page."""
    return [b.name for b in every(client, lambda o: calls.list_bottles(o, page_size))]


def destroy_all(
    client: BlockingControlClient,
    *,
    page_size: int | None = None,
    on_result: Callable[[str, BottlenetError | None], None] | None = None,
) -> tuple[list[str], dict[str, BottlenetError]]:
    """Destroy every bottle; returns (destroyed names, failures by name).

    A bottle that is already gone (``NOT_FOUND``) is neither: someone else removed it.
    """
    destroyed: list[str] = []
    failed: dict[str, BottlenetError] = {}
    for _ in range(MAX_PASSES):
        todo = [n for n in bottle_names(client, page_size) if n not in failed]
        if not todo:
            break
        for name in todo:
            try:
                client.call(calls.destroy_bottle(name))
            except NotFound:
                continue
            except BottlenetError as e:
                failed[name] = e
                if on_result is not None:
                    on_result(name, e)
                continue
            destroyed.append(name)
            if on_result is not None:
                on_result(name, None)
    return destroyed, failed


def cmd_down(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    def report(name: str, error: BottlenetError | None) -> None:
        if inv.json:
            return
        if error is None:
            out.write(f"destroyed {name}\n")
        else:
            out.write(f"failed {name}: {_clean(error.code)}: {_clean(error.message)}\n")
        out.flush()

    destroyed, failed = destroy_all(c, on_result=report)
    if inv.json:
        failures = [
            {"name": n, "code": e.code, "message": e.message} for n, e in sorted(failed.items())
        ]
        out.write(json.dumps({"destroyed": destroyed, "failed": failures}, sort_keys=True) + "\n")
    elif not destroyed and not failed:
        out.write("no bottles\n")
    else:
        out.write(f"{len(destroyed)} destroyed, {len(failed)} failed\n")
    if failed:
        # main() prints "error: CODE: message" and exits 1.
        raise next(iter(failed.values()))


def register(sub: Any, add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``down`` to bottlenetctl's subcommands; ``add`` is cli.build_parser's helper."""
    sp = add(sub, "down", cmd_down, "destroy every bottle (needs --all)")
    sp.add_argument(
        "--all",
        action="store_true",
        required=True,
        help="required: destroy every bottle the daemon has, with its forwards (and VMs)",
    )
