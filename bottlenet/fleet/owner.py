"""The trainer's owner actor: it lives exactly as long as the process that places bottles.

The owner is a named, non-detached actor on the trainer's node, made once per trainer process
and held by it, so Ray ends it with that process. It is the anchor and nothing else: each host
(:mod:`bottlenet.fleet.hosts`) asks it every round whether the trainer still lives, renews its
leases only when it answered, and destroys its bottles once Ray says it is gone. It starts no
host and hands out none, so a trainer's first pool does not wait for its process to start, and
another job that finds it by name learns nothing but that it lives.
"""

from __future__ import annotations

import functools
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


class JobOwner:
    """The placing process, as its hosts see it."""

    def __init__(self, owner_label: str) -> None:
        self.owner_label = owner_label

    async def ping(self) -> str:
        return "alive"


_RemoteOwner = ray.remote(JobOwner)


def job_owner() -> Any:
    """This process's owner actor (made on first use, on this node): it dies with this
    process, and the hosts take that as the trainer gone."""
    context = ray.get_runtime_context()
    return _owner(context.get_job_id(), context.get_worker_id(), context.get_node_id())


@functools.cache
def _owner(job_id: str, worker_id: str, node_id: str) -> Any:
    """The process holds its owner's handle for its life (Ray ends a non-detached actor once
    every handle is gone, named or not); keyed by the job, as a new ``ray.init`` is a new
    one. ``get_if_exists`` makes two threads' first calls one actor."""
    return _RemoteOwner.options(
        name=f"bottlenet-owner-{worker_id}",
        get_if_exists=True,
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(f"ray-job-{job_id}")
