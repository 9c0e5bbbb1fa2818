"""``twistd bottlenet`` / ``twist bottlenet``: options and the service tree.

Everything that can be checked before the reactor runs (options, the config file, the state
directory) is checked in :func:`makeService`; a problem there ends the process with one line
on stderr and a non-zero exit, before anything is bound.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python import usage

from bottlenet import __version__
from bottlenet.bottles.registry import BottleRegistry
from bottlenet.config import ConfigError, DaemonConfig, load_config
from bottlenet.errors import BottlenetError
from bottlenet.fatal import fatal_stop
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import DEFAULT_POOL, AliasPool
from bottlenet.forward.table import ForwardTable
from bottlenet.statedir import default_state_dir, ensure_private_dir


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "Run the bottlenet host daemon: it binds each bottle's agent endpoints and relays "
        "their bytes to the sidecar's raw ports."
    )
    optParameters = [
        ["state-dir", None, None, "State directory (default: $XDG_STATE_HOME/bottlenet)."],
        ["config", None, None, "TOML file declaring forward-only bottles."],
        ["alias-pool", None, DEFAULT_POOL, "Loopback network that bottle aliases come from."],
        ["connect-timeout", None, "10", "Seconds to wait for a forward's target to accept."],
    ]

    def opt_version(self) -> None:
        """Print the version and exit."""
        print(f"bottlenet {__version__}")
        sys.exit(0)


def _fail(message: str) -> SystemExit:
    """One clear line on stderr, exit status 1, no traceback."""
    return SystemExit(f"bottlenet: error: {message}")


class ConfigBottles(Service):
    """Creates the config file's bottles and binds their forwards when the daemon starts.

    If any bind fails, everything bound so far is removed again and the daemon exits
    non-zero: it never runs with half of its configuration.
    """

    log = Logger()

    def __init__(self, reactor: Any, registry: BottleRegistry, config: DaemonConfig, path: str):
        self._reactor = reactor
        self._registry = registry
        self._config = config
        self._path = path
        self.ready: Deferred[None] = Deferred()

    def startService(self) -> None:
        super().startService()
        d = Deferred.fromCoroutine(self._bind_all())
        d.addCallbacks(self.ready.callback, self._failed)

    async def _bind_all(self) -> None:
        for i, bottle in enumerate(self._config.bottles):
            await self._registry.create_bottle(bottle.name, str(bottle.alias), source="config")
            for j, fwd in enumerate(bottle.forwards):
                key = f"bottle[{i}].forward[{j}]"
                try:
                    info = await self._registry.add_forward(
                        bottle.name,
                        fwd.label,
                        fwd.target.describe(),
                        fwd.port,
                        max_connections=fwd.max_connections,
                    )
                except BottlenetError as e:
                    raise ConfigError(f"{self._path}: {key}: {e.message}") from None
                self.log.info(
                    "forward {bottle}/{label} listening on {endpoint} -> {target}",
                    bottle=bottle.name,
                    label=fwd.label,
                    endpoint=info.bound.describe(),
                    target=fwd.target.describe(),
                )

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
        d.addBoth(lambda _: fatal_stop(self._reactor, message))
        self.ready.errback(failure)
        self.ready.addErrback(lambda _: None)


class BottlenetService(MultiService):
    """The daemon's root service; keeps handles on the parts tests and later layers need."""

    def __init__(self, table: ForwardTable, registry: BottleRegistry, state_dir: str) -> None:
        super().__init__()
        self.table = table
        self.registry = registry
        self.state_dir = state_dir
        table.setName("forwards")
        table.setServiceParent(self)


def build_service(options: Options, reactor: Any) -> BottlenetService:
    """Check everything that can be checked up front, then build the service tree."""
    try:
        pool = AliasPool.parse(options["alias-pool"])
    except BottlenetError as e:
        raise _fail(f"--alias-pool: {e.message}") from None
    try:
        connect_timeout = float(options["connect-timeout"])
        if not 0 < connect_timeout <= 600:
            raise ValueError
    except ValueError:
        raise _fail("--connect-timeout: must be a number of seconds in (0, 600]") from None
    state_dir = options["state-dir"] or default_state_dir(os.environ)
    try:
        ensure_private_dir(state_dir)
    except OSError as e:
        raise _fail(f"--state-dir {state_dir}: {e.strerror or e}") from None
    except BottlenetError as e:
        raise _fail(f"--state-dir: {e.message}") from None
    config = DaemonConfig(())
    config_path = options["config"]
    if config_path is not None:
        try:
            config = load_config(config_path, pool, state_dir)
        except ConfigError as e:
            raise _fail(str(e)) from None

    aliases = AliasRegistry(pool)
    table = ForwardTable(reactor, aliases, state_dir=state_dir, connect_timeout=connect_timeout)
    registry = BottleRegistry(reactor, table, aliases, state_dir=state_dir)
    root = BottlenetService(table, registry, state_dir)
    if config.bottles:
        ConfigBottles(reactor, registry, config, config_path or "").setServiceParent(root)
    return root


def makeService(options: Options) -> IService:
    """The twistd/twist entry point (the plugin names this module)."""
    from twisted.internet import reactor

    return build_service(options, reactor)
