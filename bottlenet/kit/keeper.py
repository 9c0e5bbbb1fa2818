"""The daemon's kit: built (or found in the cache) off the reactor thread at start, checked
against its digest before each mount, built again when its files changed.

Creates that come while the kit is being built wait for it. Where no kit can be built (or
``--guest-kit off``), :meth:`KitKeeper.checked` gives None and guest commands fall back to
the image's python3 and ``/bin/sh``; ``status`` and the self-test say so (:meth:`describe`).
At start, in the same job off the reactor, the kits of older inputs are removed from the
cache, but those the daemon's live bottles mount (``mounted``) and those another daemon
sharing the cache uses (:meth:`KitCache.prune`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from twisted.application.service import Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure

from bottlenet.kit.build import Kit, KitCache, KitUnavailable
from bottlenet.waiters import OneShot

T = TypeVar("T")
#: Runs a blocking call off the reactor thread (tests pass one that runs it at once).
Runner = Callable[[Callable[[], Any]], Deferred[Any]]


def _off_the_reactor(reactor: Any) -> Runner:
    """The reactor's thread pool; a reactor with none (a test's double) runs the call at
    once."""
    if not hasattr(reactor, "getThreadPool"):
        return maybeDeferred
    return lambda f: deferToThreadPool(reactor, reactor.getThreadPool(), f)


class KitState(enum.StrEnum):
    OFF = "off"
    BUILDING = "building"
    READY = "ready"
    UNAVAILABLE = "unavailable"


FALLBACK = "guest commands use the image's python3 and /bin/sh"


class KitKeeper(Service):
    """One kit for the daemon (``cache`` None: turned off)."""

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        cache: KitCache | None,
        run: Runner | None = None,
        mounted: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self.cache = cache
        #: The digests of the kits the daemon's live bottles mount (kept by the prune).
        self.mounted = mounted
        self._run: Runner = run or _off_the_reactor(reactor)
        self.state = KitState.OFF if cache is None else KitState.BUILDING
        self.kit: Kit | None = None
        self.reason = "turned off (--guest-kit off)" if cache is None else "not built yet"
        self._building: OneShot[Kit | None] | None = None

    def startService(self) -> None:
        super().startService()
        if self.cache is not None and self._building is None and self.kit is None:
            self._build(self._first)

    def stopService(self) -> Any:
        if self.cache is not None and self._building is None:
            self.cache.release()
        return super().stopService()

    def _first(self) -> Kit:
        """The start's job: the kit, then the cache pruned (whether or not a kit came)."""
        assert self.cache is not None
        try:
            return self.cache.ensure()
        finally:
            self._prune()

    def _prune(self) -> None:
        assert self.cache is not None
        try:
            removed = self.cache.prune(self.mounted())
        except (OSError, KitUnavailable) as e:
            self.log.warn("old guest kits not removed: {why}", why=str(e))
            return
        if removed:
            self.log.info(
                "removed {n} guest kit(s) of older inputs: {keys}",
                n=len(removed),
                keys=", ".join(removed),
            )

    def _build(self, job: Callable[[], Kit] | None = None) -> OneShot[Kit | None]:
        assert self.cache is not None
        shot: OneShot[Kit | None] = OneShot()
        self._building = shot
        self.state = KitState.BUILDING
        self._run(job or self.cache.ensure).addBoth(self._built, shot)
        return shot

    def _built(self, result: Kit | Failure, shot: OneShot[Kit | None]) -> None:
        self._building = None
        if isinstance(result, Kit):
            self.kit, self.state, self.reason = result, KitState.READY, ""
            self.log.info("guest kit ready: {kit}", kit=result.describe())
        else:
            why = (
                result.value.message
                if isinstance(result.value, KitUnavailable)
                else f"{type(result.value).__name__}: {result.value}"
            )
            self.kit, self.state, self.reason = None, KitState.UNAVAILABLE, why
            self.log.warn("no guest kit ({why}): {fallback}", why=why, fallback=FALLBACK)
        shot.fire(self.kit)

    def current(self) -> Deferred[Kit | None]:
        """The kit once any build in flight ended (None: none)."""
        if self._building is not None:
            return self._building.when_fired()
        d: Deferred[Kit | None] = Deferred()
        d.callback(self.kit)
        return d

    async def checked(self) -> Kit | None:
        """The kit to mount now: its files still give its digest, else it is built again
        (None: no kit, the image's python3 serves)."""
        kit = await self.current()
        if kit is None or self.cache is None:
            return None
        if await self._run(lambda: self.cache.verify(kit) if self.cache else False):
            return kit
        self.log.error(
            "guest kit {kit} changed on disk since it was built: building it again",
            kit=kit.describe(),
        )
        if self._building is None:
            self.kit = None
            self._build()
        return await self.current()

    def guest_argv(self) -> list[str] | None:
        """The ready kit's program at its fixed guest path (None: no kit ready)."""
        if self.state is KitState.READY and self.kit is not None:
            return self.kit.program.argv()
        return None

    def describe(self) -> str:
        """One line for ``status`` and the self-test."""
        if self.state is KitState.READY and self.kit is not None:
            return f"ready: {self.kit.describe()}"
        if self.state is KitState.BUILDING:
            return "building"
        return f"{self.state.value}: {self.reason}; {FALLBACK}"
