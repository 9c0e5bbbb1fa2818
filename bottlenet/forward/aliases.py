"""Who owns which alias: one bottle per alias, one alias per bottle.

The forward table consults this registry before every bind, so a listener can never land on
another bottle's alias even if a caller builds a ForwardSpec by hand.
"""

from __future__ import annotations

import ipaddress

from bottlenet.errors import AlreadyExists, InvalidArgument, ResourceExhausted
from bottlenet.forward.spec import AliasPool, check_bottle_name


class AliasRegistry:
    """Allocates aliases from an :class:`AliasPool` and remembers their owners."""

    def __init__(self, pool: AliasPool) -> None:
        self.pool = pool
        self._by_alias: dict[ipaddress.IPv4Address, str] = {}
        self._by_bottle: dict[str, ipaddress.IPv4Address] = {}
        # Every pool host below this one is taken: the free search starts here (so claiming
        # the lowest free alias does not walk past every bottle's alias each time).
        self._free_from = 0

    def claim(self, bottle: str, alias: str | None = None) -> ipaddress.IPv4Address:
        """Give ``bottle`` the requested alias, or the lowest free one."""
        check_bottle_name(bottle)
        if bottle in self._by_bottle:
            raise AlreadyExists(f"bottle {bottle} already holds alias {self._by_bottle[bottle]}")
        if alias is not None:
            addr = self.pool.parse_alias(alias)
            owner = self._by_alias.get(addr)
            if owner is not None:
                raise AlreadyExists(f"alias {addr} belongs to another bottle")
        else:
            addr = self._first_free()
        self._by_alias[addr] = bottle
        self._by_bottle[bottle] = addr
        return addr

    def _first_free(self) -> ipaddress.IPv4Address:
        net = self.pool.network
        if net.prefixlen >= 31:  # no network/broadcast addresses to skip: tiny, just walk
            for addr in net.hosts():
                if addr not in self._by_alias:
                    return addr
            raise ResourceExhausted(f"alias pool {net} is exhausted")
        first, end = int(net.network_address) + 1, int(net.broadcast_address)
        i = max(first, self._free_from)
        while i < end:
            addr = ipaddress.IPv4Address(i)
            if addr not in self._by_alias:
                self._free_from = i + 1
                return addr
            i += 1
        self._free_from = end
        raise ResourceExhausted(f"alias pool {net} is exhausted")

    def release(self, bottle: str) -> None:
        """Forget ``bottle``'s alias (idempotent)."""
        addr = self._by_bottle.pop(bottle, None)
        if addr is not None:
            del self._by_alias[addr]
            self._free_from = min(self._free_from, int(addr))

    def alias_of(self, bottle: str) -> ipaddress.IPv4Address | None:
        return self._by_bottle.get(bottle)

    def owner(self, alias: ipaddress.IPv4Address) -> str | None:
        return self._by_alias.get(alias)

    def check_owned(self, bottle: str, alias: ipaddress.IPv4Address) -> None:
        """Raise unless ``alias`` is in the pool and owned by ``bottle``."""
        if alias not in self.pool:
            raise InvalidArgument(f"alias {alias} is not in the alias pool {self.pool.network}")
        owner = self._by_alias.get(alias)
        if owner != bottle:
            raise InvalidArgument(f"alias {alias} is not owned by bottle {bottle}")
