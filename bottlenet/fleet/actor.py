"""The bottle actor (one per bottle, on the node Ray chose) and the trainer's owner anchor.

The actor is detached, so Ray never kills it for a handle going out of scope; it lives as long
as its bottle. It reaches only its own node's daemon, over the local control socket (as the
Ray workers' uid, which the daemon admits scoped: it sees only the bottles it made). Logging
is the standard library's: Ray workers write it to their log files; no Twisted log observer
runs in a Ray worker.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import secrets
import socket
import threading
from collections.abc import Sequence
from typing import IO, Any, cast

import ray
from ray.exceptions import ActorDiedError, RayError

from bottlenet.control.blocking import BlockingControlClient
from bottlenet.control.clienterrors import ControlConnectionError, DaemonUnreachable
from bottlenet.control.records import BottleRecord
from bottlenet.errors import BottlenetError, NotFound
from bottlenet.fleet.errors import BottleLost
from bottlenet.fleet.lease import KeeperEnd, LeaseKeeper, OwnerCheck
from bottlenet.fleet.request import (
    REFUSAL_CODES,
    BottleRequest,
    BoundedSink,
    ExecResult,
    Placement,
)
from bottlenet.fleet.states import ActorState, new_machine
from bottlenet.paths import default_control_path, default_state_dir


class OwnerAnchor:
    """Lives exactly as long as the trainer (a non-detached actor on the trainer's node):
    bottle actors ask it whether their owner is still there."""

    async def ping(self) -> str:
        return "alive"


def node_control(request: BottleRequest) -> str:
    """The node's control socket: the request's, else ``$BOTTLENET_CONTROL`` on this node,
    else the daemon's default path for this uid."""
    if request.control:
        return request.control
    env = dict(os.environ)
    return env.get("BOTTLENET_CONTROL") or default_control_path(env, default_state_dir(env))


class BottleActor:
    """One bottle on this node: made in the constructor, kept by a lease, destroyed once."""

    log = logging.getLogger("bottlenet.fleet.actor")

    def __init__(
        self, request: BottleRequest, name: str, owner: Any | None, owner_label: str
    ) -> None:
        self.request = request
        self.name = name
        self.owner = owner
        self.owner_label = owner_label
        self.control = node_control(request)
        #: The bottle's capability (docs/protocol.md, "Scoped peers"): the daemon admits the
        #: Ray uid scoped, so every call about the bottle presents it; held by this actor only.
        self.capability = secrets.token_urlsafe(24)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.hostname = socket.gethostname()
        self._lock = threading.Lock()
        self._machine = new_machine()
        self._refusal: tuple[str, str] | None = None
        self._error: BottlenetError | None = None
        self._keeper = LeaseKeeper(request.lease_seconds, self._check_owner, self._renew)
        self._create()
        if self.state() is ActorState.SERVING:
            atexit.register(self._destroy_quietly)
            threading.Thread(target=self._keep, name=f"lease-{name}", daemon=True).start()

    # -- the bottle ----------------------------------------------------------------------------

    def _client(self, timeout: float = 30.0) -> BlockingControlClient:
        return BlockingControlClient(self.control, timeout=timeout, capability=self.capability)

    def _create(self) -> None:
        r = self.request
        try:
            with self._client() as c:
                if r.lease_seconds is None:
                    c.create_bottle(self.name, r.alias, r.spec, timeout=r.create_timeout)
                else:
                    c.create_bottle(
                        self.name,
                        r.alias,
                        r.spec,
                        owner=self.owner_label,
                        lease_seconds=r.lease_seconds,
                        timeout=r.create_timeout,
                    )
        except DaemonUnreachable as e:
            self._refuse("UNREACHABLE", str(e))
        except BottlenetError as e:
            if e.code in REFUSAL_CODES:
                self._refuse(e.code, e.message)
            else:
                self._error = e
                self._refuse(e.code, e.message)
        except ControlConnectionError as e:
            # the answer never came: the bottle may exist; remove it before saying no
            self._refuse("UNREACHABLE", str(e))
            self._remove_quietly()
        else:
            with self._lock:
                self._machine.created()

    def _refuse(self, code: str, message: str) -> None:
        self._refusal = (code, message)
        with self._lock:
            self._machine.refused()

    def _remove_quietly(self) -> None:
        try:
            with self._client() as c:
                c.destroy_bottle(self.name)
        except (BottlenetError, ControlConnectionError, DaemonUnreachable):
            pass  # its lease (if any) reaps it

    # -- the lease -------------------------------------------------------------------------------

    def _check_owner(self, timeout: float) -> OwnerCheck:
        if self.owner is None:
            return OwnerCheck.ALIVE
        try:
            ray.get(self.owner.ping.remote(), timeout=timeout)
        except ActorDiedError:
            return OwnerCheck.GONE
        except (RayError, TimeoutError):
            return OwnerCheck.UNKNOWN
        return OwnerCheck.ALIVE

    def _renew(self, seconds: float) -> None:
        with self._client() as c:
            c.renew_lease(self.name, seconds)

    def _keep(self) -> None:
        end = self._keeper.run()
        if end is KeeperEnd.OWNER_GONE:
            self.log.warning("owner of bottle %s is gone: destroying it", self.name)
            self._destroy_quietly()
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        elif end is KeeperEnd.BOTTLE_GONE:
            self.log.warning("bottle %s is gone from its node (lease expired?)", self.name)
            with self._lock:
                self._machine.bottle_lost()

    # -- what the trainer calls ------------------------------------------------------------------

    def ready(self) -> Placement:
        """Where the bottle went, or why this node said no (a caller's error is raised)."""
        if self._error is not None:
            raise self._error
        code, message = self._refusal or (None, None)
        return Placement(self.node_id, self.name, self.hostname, code, message)

    def state(self) -> ActorState:
        with self._lock:
            return self._machine.state()

    def _require_serving(self) -> None:
        state = self.state()
        if state is not ActorState.SERVING:
            raise BottleLost(f"bottle {self.name} is {state} on node {self.node_id[:8]}")

    def status(self) -> BottleRecord:
        self._require_serving()
        with self._client() as c:
            return c.bottle_status(self.name)

    def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        env: Sequence[str] = (),
        user: str | None = None,
        workdir: str | None = None,
        time_limit: int | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        """Run ``argv`` in the bottle's agent VM; its exit code and (bounded) output."""
        self._require_serving()
        out, err = BoundedSink(), BoundedSink()
        with self._client() as c:
            code = c.exec(
                self.name,
                list(argv),
                stdin=io.BytesIO(stdin) if stdin is not None else None,
                stdout=cast(IO[bytes], out),
                stderr=cast(IO[bytes], err),
                env=env,
                user=user,
                workdir=workdir,
                time_limit=time_limit,
                timeout=timeout,
            )
        return ExecResult(code, out.getvalue(), err.getvalue(), out.dropped + err.dropped)

    def logs(self, tail: int | None = None) -> bytes:
        """The workload's last ``tail`` lines (bounded like exec output)."""
        self._require_serving()
        out = BoundedSink()
        with self._client() as c:
            c.logs(self.name, stdout=cast(IO[bytes], out), tail=tail)
        return out.getvalue()

    def destroy(self) -> bool:
        """Destroy the bottle (once; later calls return False) and stop keeping its lease."""
        with self._lock:
            mine = self._machine.begin_destroy()
        if not mine:
            return False
        self._keeper.stop.set()
        try:
            with self._client() as c:
                c.destroy_bottle(self.name, timeout=self.request.create_timeout)
        except NotFound:
            pass
        with self._lock:
            self._machine.destroyed()
        return True

    def _destroy_quietly(self) -> None:
        try:
            self.destroy()
        except (BottlenetError, ControlConnectionError, DaemonUnreachable) as e:
            self.log.warning("destroying bottle %s failed: %s", self.name, type(e).__name__)
