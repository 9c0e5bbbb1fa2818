"""A trainer's host on one node: one long-lived Ray actor per owner and node that makes, keeps
and destroys every bottle the owner has there, so a bottle costs a row in a table, not a Ray
worker process.

It is an async actor: its calls and its keeper run on one event loop, so a bottle's phase
changes on one thread and needs no lock. The blocking control calls run in two executors: the
calls' own, and one thread for the renewals, so a long exec never delays a lease. The host
reaches only its own node's daemon, over the local control socket, as the Ray workers' uid
(scoped: the daemon shows it only the bottles of the capability this host presents, one per
owner and node). Logging is the standard
library's: Ray writes it to the worker's log file; no Twisted log observer runs in a Ray worker.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import io
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, TypeVar, cast

import attrs
import ray
from ray.exceptions import ActorDiedError, RayError

from bottlenet.control.blocking import BlockingControlClient
from bottlenet.control.clienterrors import ControlConnectionError, DaemonUnreachable
from bottlenet.control.records import BottleRecord
from bottlenet.errors import BottlenetError, InvalidArgument, NotFound
from bottlenet.fleet.errors import BottleLost
from bottlenet.fleet.renewal import (
    LeaseRenewer,
    OwnerCheck,
    Renewal,
    renew_all,
    round_interval,
)
from bottlenet.fleet.request import (
    REFUSAL_CODES,
    BottleRequest,
    BoundedSink,
    ExecResult,
    Placement,
)
from bottlenet.paths import default_control_path, default_state_dir

T = TypeVar("T")
#: Blocking control calls one host runs at once (execs, logs, status, creates, destroys);
#: more wait their turn. Renewals have a thread of their own besides.
CALL_THREADS = 32


def node_control(request: BottleRequest) -> str:
    """The node's control socket: the request's, else ``$BOTTLENET_CONTROL`` on this node,
    else the daemon's default path for this uid."""
    if request.control:
        return request.control
    env = dict(os.environ)
    return env.get("BOTTLENET_CONTROL") or default_control_path(env, default_state_dir(env))


class Phase(enum.StrEnum):
    """Where one bottle of a host is. A refused create never enters the table; a destroyed
    bottle leaves it."""

    CREATING = "creating"
    SERVING = "serving"
    DESTROYING = "destroying"
    #: the node reaped it (its lease ran out): kept until the trainer lets it go
    LOST = "lost"


@attrs.define(eq=False)
class Hosted:
    """One bottle as its host holds it: what every later call on it needs (its control
    socket, its lease; the capability every call presents is its host's)."""

    name: str
    request: BottleRequest
    control: str
    #: done once the create has its answer (a destroy that came first waits for it)
    settled: asyncio.Future[None]
    phase: Phase = Phase.CREATING
    lease: LeaseRenewer | None = None


class NodeHost:
    """The owner's bottles on this node.

    ``owner`` is the trainer's :class:`~bottlenet.fleet.owner.JobOwner` (its ``ping`` says the
    trainer lives), ``owner_label`` the daemon's owner label of every bottle made here.
    ``connect`` and ``clock`` are for tests.
    """

    log = logging.getLogger("bottlenet.fleet.host")

    def __init__(
        self,
        owner: Any,
        owner_label: str,
        *,
        connect: Callable[[str], BlockingControlClient] | None = None,
        clock: Callable[[], float] = time.monotonic,
        node_id: str | None = None,
    ) -> None:
        self.owner = owner
        self.owner_label = owner_label
        self.node_id = node_id or ray.get_runtime_context().get_node_id()
        self.hostname = socket.gethostname()
        #: The job's capability on this node (docs/protocol.md, "Scoped peers"): the daemon
        #: admits the Ray uid scoped, and every job's uid is that one, so the bottles made here
        #: answer only calls that present it (another job's host holds another).
        self.capability = secrets.token_urlsafe(24)
        self._connect = connect or self._own_client
        self._clock = clock
        self._bottles: dict[str, Hosted] = {}
        self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="bottlenet-call")
        self._renewals = ThreadPoolExecutor(1, thread_name_prefix="bottlenet-renew")
        self._changed = asyncio.Event()
        self._last_round = clock()
        #: rounds whose owner check got no answer (so nothing was renewed)
        self.skipped = 0

    def _own_client(self, control: str) -> BlockingControlClient:
        return BlockingControlClient(control, capability=self.capability)

    async def _blocking(
        self, call: Callable[..., T], *args: Any, executor: ThreadPoolExecutor | None = None
    ) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor or self._calls, functools.partial(call, *args))

    # -- making a bottle ---------------------------------------------------------------------

    async def create(self, name: str, request: BottleRequest) -> Placement:
        """Create ``name`` on this node: where it went, or the node's refusal. A caller's
        error (a bad spec, a name taken) is raised."""
        if name in self._bottles:
            raise InvalidArgument(f"bottle {name} is already on this host")
        hosted = Hosted(
            name, request, node_control(request), asyncio.get_running_loop().create_future()
        )
        self._bottles[name] = hosted
        try:
            refusal = await self._blocking(self._create, hosted)
        except BaseException:
            del self._bottles[name]
            raise
        finally:
            hosted.settled.set_result(None)
        if refusal is not None:
            del self._bottles[name]
            return Placement(self.node_id, name, self.hostname, *refusal)
        hosted.phase = Phase.SERVING
        if request.lease_seconds is not None:
            hosted.lease = LeaseRenewer(request.lease_seconds)
            self._changed.set()  # its lease may need shorter rounds
        return Placement(self.node_id, name, self.hostname)

    def _create(self, hosted: Hosted) -> tuple[str, str] | None:
        """The daemon's create (in the calls' executor): None, or the refusal's code and
        message."""
        r = hosted.request
        try:
            with self._connect(hosted.control) as c:
                c.create_bottle(
                    hosted.name,
                    r.alias,
                    r.spec,
                    owner=self.owner_label,
                    lease_seconds=r.lease_seconds,
                    pool=None if r.pool == "auto" else r.pool,
                    timeout=r.create_timeout,
                )
        except DaemonUnreachable as e:
            return ("UNREACHABLE", str(e))
        except BottlenetError as e:
            if e.code in REFUSAL_CODES:
                return (e.code, e.message)
            raise
        except ControlConnectionError as e:
            # the answer never came: the bottle may exist; remove it before saying no
            self._remove_quietly(hosted)
            return ("UNREACHABLE", str(e))
        return None

    def _remove_quietly(self, hosted: Hosted) -> None:
        try:
            with self._connect(hosted.control) as c:
                c.destroy_bottle(hosted.name)
        except (BottlenetError, ControlConnectionError, DaemonUnreachable):
            pass  # its lease (if any) reaps it

    # -- what the trainer calls ---------------------------------------------------------------

    def _serving(self, name: str) -> Hosted:
        hosted = self._bottles.get(name)
        if hosted is None or hosted.phase is not Phase.SERVING:
            phase = "gone" if hosted is None else hosted.phase
            raise BottleLost(f"bottle {name} is {phase} on node {self.node_id[:8]}")
        return hosted

    async def status(self, name: str) -> BottleRecord:
        """The daemon's record of the bottle."""
        hosted = self._serving(name)
        return await self._blocking(self._status, hosted.control, name)

    def _status(self, control: str, name: str) -> BottleRecord:
        with self._connect(control) as c:
            return c.bottle_status(name)

    async def exec(
        self,
        name: str,
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
        hosted = self._serving(name)
        run = functools.partial(
            self._exec, hosted.control, name, list(argv), stdin=stdin, env=env, user=user,
            workdir=workdir, time_limit=time_limit, timeout=timeout,
        )  # fmt: skip
        return await self._blocking(run)

    def _exec(
        self, control: str, name: str, argv: list[str], *, stdin: bytes | None, **options: Any
    ) -> ExecResult:
        out, err = BoundedSink(), BoundedSink()
        with self._connect(control) as c:
            code = c.exec(
                name,
                argv,
                stdin=io.BytesIO(stdin) if stdin is not None else None,
                stdout=cast(IO[bytes], out),
                stderr=cast(IO[bytes], err),
                **options,
            )
        return ExecResult(code, out.getvalue(), err.getvalue(), out.dropped + err.dropped)

    async def logs(self, name: str, tail: int | None = None) -> bytes:
        """The workload's last ``tail`` lines (bounded like exec output)."""
        hosted = self._serving(name)
        return await self._blocking(self._logs, hosted.control, name, tail)

    def _logs(self, control: str, name: str, tail: int | None) -> bytes:
        out = BoundedSink()
        with self._connect(control) as c:
            c.logs(name, stdout=cast(IO[bytes], out), tail=tail)
        return out.getvalue()

    async def destroy(self, name: str) -> bool:
        """Destroy the bottle and stop keeping its lease: True for the call that did it (a
        create still in flight is waited for, then destroyed); False when it was gone."""
        hosted = self._bottles.get(name)
        if hosted is not None and hosted.phase is Phase.CREATING:
            await asyncio.shield(hosted.settled)
            hosted = self._bottles.get(name)
        if hosted is None or hosted.phase is Phase.DESTROYING:
            return False
        if hosted.phase is Phase.LOST:
            del self._bottles[name]
            return False
        hosted.phase = Phase.DESTROYING
        try:
            await self._blocking(self._destroy, hosted)
        finally:
            # destroyed, or left to its lease: out of this host's hands either way
            del self._bottles[name]
        return True

    def _destroy(self, hosted: Hosted) -> None:
        try:
            with self._connect(hosted.control) as c:
                c.destroy_bottle(hosted.name, timeout=hosted.request.create_timeout)
        except NotFound:
            pass

    async def destroy_many(self, names: Sequence[str]) -> int:
        """Destroy each of ``names`` at once; how many this call destroyed (a failure is
        logged: the bottle's lease, if any, reaps it)."""
        done = await asyncio.gather(*(self.destroy(n) for n in names), return_exceptions=True)
        for name, result in zip(names, done, strict=True):
            if isinstance(result, BaseException):
                self.log.warning("destroying bottle %s failed: %s", name, type(result).__name__)
        return sum(result is True for result in done)

    async def phases(self) -> dict[str, str]:
        """Each bottle of this host and its phase."""
        return {name: str(h.phase) for name, h in self._bottles.items()}

    # -- the keeper ---------------------------------------------------------------------------

    def interval(self) -> float:
        """Seconds between rounds: a third of the shortest lease held here."""
        return round_interval(
            h.lease.lease_seconds for h in self._bottles.values() if h.lease is not None
        )

    async def keep(self) -> None:
        """The host's life: a round every :meth:`interval` until the owner is known gone;
        then every bottle is destroyed and the actor ends (Ray's ``exit_actor``)."""
        while True:
            delay = self._last_round + self.interval() - self._clock()
            if delay > 0:
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), delay)
                except TimeoutError:
                    pass
                continue  # a new lease may have shortened the interval
            self._last_round = self._clock()
            try:
                if not await self.round():
                    break
            except Exception as e:  # a bug must not end the keeper and leave the host up
                self.log.exception("a round failed: %s", type(e).__name__)
        await self.end()
        ray.actor.exit_actor()

    async def end(self) -> None:
        """The owner is gone: destroy every bottle held here, stop the executors."""
        names = list(self._bottles)
        self.log.warning("owner %s is gone: destroying %d bottles", self.owner_label, len(names))
        await self.destroy_many(names)
        self._calls.shutdown(wait=False)
        self._renewals.shutdown(wait=False)

    async def round(self) -> bool:
        """Ask the owner; if it answered, renew every lease held here. False once the owner is
        known gone."""
        owner = await self._check_owner(self.interval())
        if owner is OwnerCheck.GONE:
            return False
        if owner is OwnerCheck.UNKNOWN:
            self.skipped += 1
            return True
        due = [h for h in self._bottles.values() if h.phase is Phase.SERVING and h.lease]
        if due:
            work = [(h.name, h.control, h.lease.lease_seconds) for h in due if h.lease]
            outcomes = await self._blocking(renew_all, self._connect, work, executor=self._renewals)
            self._settle(due, outcomes)
        return True

    def _settle(self, due: list[Hosted], outcomes: list[Renewal]) -> None:
        now = self._clock()
        for hosted, outcome in zip(due, outcomes, strict=True):
            if hosted.phase is not Phase.SERVING or hosted.lease is None:
                continue  # destroyed while the renewals ran
            if hosted.lease.settle(outcome, now):
                self.log.warning("bottle %s is gone from its node (lease expired?)", hosted.name)
                hosted.phase = Phase.LOST

    async def _check_owner(self, timeout: float) -> OwnerCheck:
        try:
            await asyncio.wait_for(_awaitable(self.owner.ping.remote()), timeout)
        except ActorDiedError:
            return OwnerCheck.GONE
        except (RayError, TimeoutError):
            return OwnerCheck.UNKNOWN
        return OwnerCheck.ALIVE


async def _awaitable(ref: Awaitable[T]) -> T:
    """An ObjectRef (or a test's awaitable) as a coroutine ``asyncio.wait_for`` can cancel."""
    return await ref
