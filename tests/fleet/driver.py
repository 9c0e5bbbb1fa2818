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
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from bottlenet.fleet import BottlePool, BottleRequest, PlacedBottle

pools: dict[str, BottlePool] = {}


@ray.remote
class Empty:
    """An actor that does nothing: its start is a Ray worker process's start alone."""

    def ping(self) -> None:
        return None


#: Marks the answer lines (Ray may write lines of its own to stdout).
REPLY = "@reply "


def _describe(bottles: list[PlacedBottle]) -> list[dict[str, str]]:
    return [{"name": b.name, "node_id": b.node_id} for b in bottles]


def _each_status(pool: str, timeout: float = 60) -> list[Any]:
    """Every bottle's status at once: each one's result, or the name of the error it raised
    (``ActorDiedError``, ``GetTimeoutError``, ``BottleLost`` ...)."""
    refs = [b.status_ref() for b in pools[pool].bottles]
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
        request = BottleRequest(
            spec=req.get("spec"),
            lease_seconds=req.get("lease"),
            name_prefix="bench",
            pool=req.get("pool", "auto"),
        )
        started = time.monotonic()
        ready: list[float] = []

        def on_ready(done: int) -> None:
            ready.extend([time.monotonic() - started] * (done - len(ready)))

        timed = BottlePool(
            req["count"], request, timeout=req.get("timeout", 600), progress=False,
            on_ready=on_ready,
        ).open()  # fmt: skip
        pools[req["id"]] = timed
        return {"bottles": _describe(timed.bottles), "ready": ready}
    if op == "status":
        # the daemon's record through each actor: a round trip to the bottle's own node
        bottles = pools[req["id"]].bottles
        results = _each_status(req["id"], timeout=req.get("timeout", 60))
        return [{"node_id": b.node_id, **r} for b, r in zip(bottles, results, strict=True)]
    if op == "exec":
        return [
            r if "error" in r else {"ok": r["ok"]}
            for r in _each_exec(req["id"], req["argv"], req.get("timeout", 60))
        ]
    if op == "close":
        pools.pop(req["id"]).close()
        return None
    if op == "worker_start":
        # the floor of a cold pool (the benchmark): an empty actor on each bottle node, all
        # at once, as a first pool starts its hosts; each one's seconds to its first answer
        nodes = [
            n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get("bottle")
        ]
        started = time.monotonic()
        actors = [
            Empty.options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote()
            for node in nodes
        ]
        answered = []
        for ref in [a.ping.remote() for a in actors]:
            ray.get(ref, timeout=req.get("timeout", 120))
            answered.append(time.monotonic() - started)
        for a in actors:
            ray.kill(a)
        return answered
    if op == "free":
        return ray.available_resources().get("bottle", 0)
    if op == "nodes":
        return {n["NodeID"]: n.get("Labels", {}) for n in ray.nodes() if n.get("Alive")}
    if op == "quit":
        for pool in pools.values():
            pool.close()
        return None
    raise ValueError(f"unknown op {op}")


def _each_exec(pool: str, argv: list[str], timeout: float) -> list[dict[str, Any]]:
    refs = [b.exec_ref(argv) for b in pools[pool].bottles]
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
