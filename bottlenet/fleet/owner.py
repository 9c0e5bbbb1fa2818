"""The trainer's owner actor: it lives exactly as long as the process that places bottles, and
starts that process's host on each node it places on.

The owner is a named, non-detached actor on the trainer's node, made once per trainer process
and held by it, so Ray ends it with that process. Each host is detached (Ray never ends it for
a handle going out of scope) and asks the owner every round whether the trainer still lives;
once the owner is gone the host destroys its bottles and ends. The owner learns a host's end
from the host's ``keep`` call returning, and starts a new one for that node when asked again.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any

import attrs
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from bottlenet.fleet.host import NodeHost

#: Concurrent calls one host takes (its blocking ones are bounded by ``host.CALL_THREADS``).
HOST_CONCURRENCY = 1000
_RemoteHost = ray.remote(NodeHost)


def host_options(node_id: str) -> dict[str, Any]:
    """Ray options of a host: on that node (hard affinity), no CPU, no ``bottle`` (each
    bottle's reservation holds that), detached, never restarted (its bottles would not be)."""
    return {
        "num_cpus": 0,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
        "lifetime": "detached",
        "max_restarts": 0,
        "max_task_retries": 0,
        "max_concurrency": HOST_CONCURRENCY,
    }


@attrs.define(eq=False)
class _Host:
    """A started host and the task that sees its ``keep`` call end (the host's end)."""

    handle: Any
    ended: asyncio.Task[Any]


class JobOwner:
    """The placing process's bottles as Ray sees them: one host per node."""

    def __init__(self, owner_label: str) -> None:
        self.owner_label = owner_label
        self._hosts: dict[str, _Host] = {}

    async def ping(self) -> str:
        return "alive"

    async def hosts(self, node_ids: Sequence[str]) -> dict[str, Any]:
        """The host on each node (started where there is none yet, or its host ended)."""
        for node in node_ids:
            if node not in self._hosts:
                self._start(node)
        return {node: self._hosts[node].handle for node in node_ids}

    def forget(self, node_id: str, handle: Any) -> None:
        """A host's call failed with its actor gone: the next ``hosts`` starts another."""
        host = self._hosts.get(node_id)
        if host is not None and host.handle == handle:
            del self._hosts[node_id]

    def _start(self, node_id: str) -> None:
        me = ray.get_runtime_context().current_actor
        handle: Any = _RemoteHost.options(**host_options(node_id)).remote(me, self.owner_label)
        ended = asyncio.ensure_future(_wait(handle.keep.remote()))
        self._hosts[node_id] = _Host(handle, ended)
        ended.add_done_callback(lambda _: self.forget(node_id, handle))


async def _wait(ref: Any) -> None:
    """Until ``ref`` resolves, however it does (a host ends by ``exit_actor`` or by dying)."""
    try:
        await ref
    except ray.exceptions.RayError:
        pass


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
