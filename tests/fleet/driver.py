"""The trainer of the multi-node tier: a Ray driver in the trainer's namespace that takes one
JSON request a line on stdin and answers one JSON line on stdout (tests/fleet/netns.py).

It uses only the public library (``bottlenet.fleet``), as a trainer would.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from bottlenet.fleet import Bottle, BottlePool, BottleRequest
from bottlenet.fleet.placement import Placer

pools: dict[str, BottlePool] = {}
#: Marks the answer lines (Ray may write lines of its own to stdout).
REPLY = "@reply "


def _describe(bottles: list[Bottle]) -> list[dict[str, str]]:
    return [{"name": b.name, "node_id": b.node_id} for b in bottles]


def _each(pool: str, method: str, *args: Any, timeout: float = 60) -> list[Any]:
    """Call ``method`` on every bottle of ``pool`` at once: each one's result, or the name of
    the error it raised (``ActorDiedError``, ``GetTimeoutError``, ``NotFound`` ...)."""
    refs = [getattr(b.actor, method).remote(*args) for b in pools[pool].bottles]
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    for ref in refs:
        try:
            value = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1))
        except (RayActorError, GetTimeoutError) as e:
            out.append({"error": type(e).__name__})
            continue
        except Exception as e:
            out.append({"error": type(e).__name__, "message": str(e)[:200]})
            continue
        out.append({"ok": value if isinstance(value, (int, str, bool)) else None})
    return out


def handle(req: dict[str, Any]) -> Any:
    op = req["op"]
    if op == "pool":
        request = BottleRequest(
            spec=req.get("spec"),
            lease_seconds=req.get("lease"),
            label_selector=req.get("selector") or {},
            name_prefix=req.get("prefix", "ray"),
        )
        started = time.monotonic()
        pool = BottlePool(
            req["count"],
            request,
            max_attempts=req.get("max_attempts", 3),
            timeout=req.get("timeout", 300),
            progress=False,
        ).open()
        pools[req["id"]] = pool
        return {
            "bottles": _describe(pool.bottles),
            "seconds": time.monotonic() - started,
            "refusals": [r.code for r in pool.refusals],
        }
    if op == "timed_pool":
        # as "pool", plus each bottle's seconds from the request to ready (the benchmark)
        request = BottleRequest(lease_seconds=req.get("lease"), name_prefix="bench")
        started = time.monotonic()
        ready: list[float] = []

        def progress(done: int) -> None:
            ready.extend([time.monotonic() - started] * (done - len(ready)))

        bottles = Placer(
            request, req["count"], timeout=req.get("timeout", 600), progress=progress
        ).run()
        pools[req["id"]] = BottlePool(len(bottles), request)
        pools[req["id"]].bottles = bottles
        return {"bottles": _describe(bottles), "ready": ready}
    if op == "status":
        # the daemon's record through each actor: a round trip to the bottle's own node
        bottles = pools[req["id"]].bottles
        results = _each(req["id"], "status", timeout=req.get("timeout", 60))
        return [{"node_id": b.node_id, **r} for b, r in zip(bottles, results, strict=True)]
    if op == "exec":
        return [
            r if "error" in r else {"ok": r["ok"]}
            for r in _each_exec(req["id"], req["argv"], req.get("timeout", 60))
        ]
    if op == "close":
        pools.pop(req["id"]).close()
        return None
    if op == "nodes":
        return {n["NodeID"]: n.get("Labels", {}) for n in ray.nodes() if n.get("Alive")}
    if op == "quit":
        for pool in pools.values():
            pool.close()
        return None
    raise ValueError(f"unknown op {op}")


def _each_exec(pool: str, argv: list[str], timeout: float) -> list[dict[str, Any]]:
    refs = [b.actor.exec.remote(argv) for b in pools[pool].bottles]
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    for ref in refs:
        try:
            r = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1))
        except Exception as e:
            out.append({"error": type(e).__name__})
            continue
        out.append({"ok": [r.exit_code, r.stdout.decode(errors="replace")]})
    return out


def main() -> None:
    ray.init(address=sys.argv[1], log_to_driver=False)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = {"result": handle(req)}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"[:2000], "type": type(e).__name__}
        sys.stdout.write(REPLY + json.dumps(reply) + "\n")
        sys.stdout.flush()
        if req["op"] == "quit":
            break
    ray.shutdown()


if __name__ == "__main__":
    main()
