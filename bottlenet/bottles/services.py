"""The bottles wing's start-up service for ``--config``: the file's bottles, bound up front.

(:class:`~bottlenet.bottles.recovery.RecoveryService`, the other start-up service of this
wing, lives with the recovery it runs.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from bottlenet.bottles.config import ConfigError, DaemonConfig
from bottlenet.bottles.model import Source
from bottlenet.bottles.registry import BottleRegistry
from bottlenet.errors import BottlenetError


class ConfigBottles(Service):
    """Creates the config file's bottles and binds their forwards when the daemon starts.

    If any bind fails, everything bound so far is removed again and the daemon exits
    non-zero through ``on_fatal``: it never runs with half of its configuration.
    """

    log = Logger()

    def __init__(
        self,
        registry: BottleRegistry,
        config: DaemonConfig,
        path: str,
        on_fatal: Callable[[str], None],
    ):
        self._registry = registry
        self._config = config
        self._path = path
        self._on_fatal = on_fatal
        self.ready: Deferred[None] = Deferred()

    def startService(self) -> None:
        super().startService()
        d = Deferred.fromCoroutine(self._bind_all())
        d.addCallbacks(self.ready.callback, self._failed)

    async def _bind_all(self) -> None:
        for i, bottle in enumerate(self._config.bottles):
            await self._registry.create_bottle(bottle.name, bottle.alias, source=Source.CONFIG)
            for j, fwd in enumerate(bottle.forwards):
                key = f"bottle[{i}].forward[{j}]"
                try:
                    # The forward table logs "forward B/L listening on ..." itself.
                    await self._registry.add_forward(
                        bottle.name,
                        fwd.label,
                        fwd.target,
                        fwd.port,
                        max_connections=fwd.max_connections,
                    )
                except BottlenetError as e:
                    raise ConfigError(f"{self._path}: {key}: {e.message}") from None

    async def _rollback(self) -> None:
        for bottle in self._config.bottles:
            try:
                await self._registry.destroy_bottle(bottle.name)
            except BottlenetError:
                pass

    def _failed(self, failure: Any) -> None:
        if failure.check(ConfigError, BottlenetError):
            message = str(failure.value)
        else:
            self.log.failure("unexpected error while binding the configured forwards", failure)
            message = "unexpected error while binding the configured forwards"
        d = Deferred.fromCoroutine(self._rollback())
        d.addBoth(lambda _: self._on_fatal(message))
        self.ready.errback(failure)
        self.ready.addErrback(lambda _: None)
