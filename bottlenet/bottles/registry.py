"""The bottles the daemon knows, and the operations the control plane and the config run.

This first layer handles forward-only bottles (no VMs): a bottle is a name, an alias drawn
from the pool, and its forwards. It composes the alias registry and the forward table and
adds what neither knows: bottle names, one operation at a time per bottle, and a limit on
the number of bottles.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from attrs import evolve, frozen
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from bottlenet.errors import AlreadyExists, Busy, InvalidArgument, NotFound, ResourceExhausted
from bottlenet.forward.aliases import AliasRegistry
from bottlenet.forward.spec import (
    ForwardSpec,
    TCPListen,
    check_bottle_name,
    check_label,
    check_port,
    parse_target,
)
from bottlenet.forward.table import ForwardInfo, ForwardTable

T = TypeVar("T")

DEFAULT_MAX_BOTTLES = 256


@frozen
class BottleInfo:
    """What the control plane reports about a bottle."""

    name: str
    alias: str | None
    source: str  # "config" | "control"
    state: str  # "ready" for forward-only bottles
    created_at: float
    forwards: tuple[ForwardInfo, ...] = ()


class BottleRegistry:
    """Forward-only bottles: create, destroy, and their forwards."""

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        table: ForwardTable,
        aliases: AliasRegistry,
        *,
        state_dir: str,
        max_bottles: int = DEFAULT_MAX_BOTTLES,
        max_connections: int = 1024,
    ) -> None:
        self._clock = clock
        self._table = table
        self._aliases = aliases
        self._state_dir = state_dir
        self._max_bottles = max_bottles
        self._max_connections = max_connections
        self._bottles: dict[str, BottleInfo] = {}
        self._busy: set[str] = set()

    @contextmanager
    def _operation(self, name: str) -> Iterator[None]:
        """One operation at a time per bottle: a second one gets BUSY instead of racing."""
        if name in self._busy:
            raise Busy(f"bottle {name} has another operation in progress")
        self._busy.add(name)
        try:
            yield
        finally:
            self._busy.discard(name)

    async def _locked(self, name: str, op: Callable[[], Awaitable[T]]) -> T:
        with self._operation(name):
            return await op()

    def _require(self, name: str) -> BottleInfo:
        check_bottle_name(name)
        try:
            return self._bottles[name]
        except KeyError:
            raise NotFound(f"bottle {name} does not exist") from None

    async def create_bottle(
        self, name: str, alias: str | None = None, *, source: str = "control"
    ) -> BottleInfo:
        """Create a forward-only bottle holding ``alias`` (or the lowest free one)."""
        check_bottle_name(name)
        if alias is not None and not isinstance(alias, str):
            raise InvalidArgument("alias must be a string")

        async def create() -> BottleInfo:
            if name in self._bottles:
                raise AlreadyExists(f"bottle {name} already exists")
            if len(self._bottles) >= self._max_bottles:
                raise ResourceExhausted(
                    f"the daemon holds its maximum of {self._max_bottles} bottles"
                )
            addr = self._aliases.claim(name, alias)
            info = BottleInfo(
                name=name,
                alias=str(addr),
                source=source,
                state="ready",
                created_at=self._clock.seconds(),
            )
            self._bottles[name] = info
            self.log.info("bottle {bottle} created on {alias}", bottle=name, alias=str(addr))
            return info

        return await self._locked(name, create)

    async def destroy_bottle(self, name: str) -> None:
        """Stop the bottle's listeners, abort its relays, release its alias."""
        self._require(name)

        async def destroy() -> None:
            await self._table.remove_bottle(name)
            self._aliases.release(name)
            self._bottles.pop(name, None)
            self.log.info("bottle {bottle} destroyed", bottle=name)

        await self._locked(name, destroy)

    def list_bottles(self) -> list[BottleInfo]:
        return [self.get_bottle(name) for name in sorted(self._bottles)]

    def get_bottle(self, name: str) -> BottleInfo:
        info = self._require(name)
        return evolve(info, forwards=tuple(self._table.list(name)))

    async def add_forward(
        self,
        bottle: str,
        label: str,
        target: str,
        port: int = 0,
        *,
        max_connections: int | None = None,
    ) -> ForwardInfo:
        """Bind a new agent endpoint on the bottle's alias that relays to ``target``."""
        info = self._require(bottle)
        check_label(label)
        check_port(port, allow_zero=True)
        target_spec = parse_target(target, unix_root=self._state_dir)
        if info.alias is None:
            raise InvalidArgument(f"bottle {bottle} has no alias")
        alias = self._aliases.alias_of(bottle)
        if alias is None:
            raise InvalidArgument(f"bottle {bottle} has no alias")
        spec = ForwardSpec(
            bottle=bottle,
            label=label,
            listen=TCPListen(alias, port),
            target=target_spec,
            max_connections=max_connections or self._max_connections,
        )
        return await self._locked(bottle, lambda: self._table.add(spec))

    async def remove_forward(self, bottle: str, label: str) -> None:
        self._require(bottle)
        check_label(label)

        async def remove() -> None:
            await self._table.remove(bottle, label)

        await self._locked(bottle, remove)

    def list_forwards(self, bottle: str | None = None) -> list[ForwardInfo]:
        if bottle is not None:
            self._require(bottle)
        return self._table.list(bottle)
