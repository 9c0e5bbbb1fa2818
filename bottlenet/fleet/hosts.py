"""The placing process's host on each node, started by the process itself.

A host (:mod:`bottlenet.fleet.host`) is a detached Ray actor on its node that holds every
bottle its owner has there. The placing process starts it with the owner's handle, which
exists before the owner's own process does, so a trainer's first pool waits for its hosts'
starts (one worker process per node, all at once), not for the owner's start and then the
hosts'. Threads of the process share the hosts without a lock: a host is published with
``dict.setdefault`` (atomic), and a thread that lost that race kills the host it started
before any call reaches it. A host that ended (its ``keep`` call returned: its owner gone, or
it died) is replaced by the next placement on its node.
"""

from __future__ import annotations

from collections.abc import Iterable
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
    """A started host and its ``keep`` call, which resolves when the host ends."""

    handle: Any
    keeper: Any


class JobHosts:
    """One owner's hosts, one per node."""

    def __init__(self, owner: Any, owner_label: str) -> None:
        self.owner = owner
        self.owner_label = owner_label
        self._hosts: dict[str, _Host] = {}

    def on(self, node_ids: Iterable[str]) -> dict[str, Any]:
        """The host on each node, started (not waited for) where there is none or its host
        ended."""
        wanted = sorted(set(node_ids))
        self._drop_ended()
        hosts = {}
        for node in wanted:
            host = self._hosts.get(node)
            if host is None:
                host = self._start(node)
            hosts[node] = host.handle
        return hosts

    def _start(self, node_id: str) -> _Host:
        handle: Any = _RemoteHost.options(**host_options(node_id)).remote(
            self.owner, self.owner_label
        )
        started = _Host(handle, handle.keep.remote())
        host = self._hosts.setdefault(node_id, started)
        if host is not started:
            ray.kill(handle)  # another thread's host is there first; this one holds nothing
        return host

    def forget(self, node_id: str, handle: Any) -> None:
        """A call on ``handle`` failed with its actor gone: the next :meth:`on` starts
        another there (a race with another thread at worst drops a live host, which keeps
        its bottles; the next :meth:`on` starts another)."""
        host = self._hosts.get(node_id)
        if host is not None and host.handle == handle:
            self._hosts.pop(node_id, None)

    def _drop_ended(self) -> None:
        hosts = dict(self._hosts)
        if not hosts:
            return
        ended, _ = ray.wait([h.keeper for h in hosts.values()], num_returns=len(hosts), timeout=0)
        gone = {ref.hex() for ref in ended}
        for node, host in hosts.items():
            if host.keeper.hex() in gone:
                self.forget(node, host.handle)


_by_owner: dict[Any, JobHosts] = {}


def hosts_of(owner: Any) -> JobHosts:
    """The hosts of ``owner`` (this process's :func:`~bottlenet.fleet.owner.job_owner`),
    made on first use; their bottles carry the owner label ``ray-job-<job id>``."""
    hosts = _by_owner.get(owner)
    if hosts is None:
        label = f"ray-job-{ray.get_runtime_context().get_job_id()}"
        hosts = _by_owner.setdefault(owner, JobHosts(owner, label))
    return hosts
