"""Scoped control peers: a uid that sees and acts only on the bottles it created.

Why: a fleet's host actors (Ray workers, docs/fleet.md) need to create, use and destroy
their own bottles through the node's socket, and nothing more: a worker that is compromised
must not reach another owner's bottle nor drain the node. ``--allow-uid UID:scoped`` admits
such a uid; its connections get a :class:`ScopedBackend` instead of the registry. Every bottle
it creates records it as its creator (``uid:N``, in the bottle's state record, so it survives a
restart); any other bottle's name answers ``NOT_FOUND`` exactly as a missing one does;
listings, stats and events show its own bottles only; ``Drain``, ``Undrain`` and
``Leftovers`` (``bottlenetctl selftest``'s last step) answer ``PERMISSION_DENIED``. A plain
``--allow-uid UID`` keeps full control, as before.

The view is derived, not written out: each ``ControlBackend`` method declares its
:class:`~bottlenet.control.backend.Scope` where it is declared (``control/backend.py``), and
:class:`ScopedBackend` checks a call by it (a method that declares none is refused).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from attrs import evolve

from bottlenet.bottles.events import BottleEvent
from bottlenet.bottles.tenancy import Tenancy
from bottlenet.control.backend import ControlBackend, Scope, Scoping, scoping
from bottlenet.errors import NotFound, PermissionDenied

if TYPE_CHECKING:
    from bottlenet.bottles.model import Bottle


class ScopedBackend:
    """The registry as one scoped peer sees it (a ``ControlBackend``): each method checked by
    its declared scope."""

    def __init__(self, backend: ControlBackend, creator: str) -> None:
        self._backend = backend
        self.creator = creator

    def owns(self, bottle: Bottle) -> bool:
        return bottle.tenancy is not None and bottle.tenancy.creator == self.creator

    def sees(self, event: BottleEvent) -> bool:
        """Its own bottles' events, and the node's (their bottle is empty)."""
        return event.bottle == "" or event.creator == self.creator

    def _mine(self, name: str) -> Bottle:
        bottle = self._backend.get_bottle(name)
        if not self.owns(bottle):
            raise NotFound(f"bottle {name} does not exist")  # the registry's own words
        return bottle

    def __getattr__(self, name: str) -> Callable[..., Any]:
        try:
            how = scoping(name)
        except KeyError:
            raise AttributeError(f"{name}: not a method of the control backend") from None
        if inspect.iscoroutinefunction(getattr(ControlBackend, name)):

            async def checked_later(*args: Any, **kwargs: Any) -> Any:
                self._admit(name, how, args, kwargs)
                return await getattr(self._backend, name)(*args, **kwargs)

            return checked_later

        def checked(*args: Any, **kwargs: Any) -> Any:
            named = self._admit(name, how, args, kwargs)
            rows = getattr(self._backend, name)(*args, **kwargs)
            return rows if named or how.scope is not Scope.LISTING else self._own(how, rows)

        return checked

    def _admit(self, name: str, how: Scoping, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Check a call before it runs (raise), stamping a create's creator; whether it
        names a bottle (its own: checked)."""
        if how.scope is Scope.HOST:
            raise PermissionDenied(f"{how.command}: a scoped peer may not ask for it")
        if how.scope is Scope.CREATE:
            kwargs["tenancy"] = evolve(kwargs.get("tenancy") or Tenancy(), creator=self.creator)
            return True
        bottle = args[0] if args else kwargs.get("bottle", kwargs.get("name"))
        if bottle is not None:
            self._mine(bottle)  # the bottle it names (a listing's too)
        elif how.scope is Scope.BOTTLE:
            raise TypeError(f"{name}: the bottle is its first argument")
        return bottle is not None

    def _own(self, how: Scoping, rows: Sequence[Any]) -> list[Any]:
        """A listing of every bottle: its own bottles' rows only."""
        bottles = self._backend.list_bottles()
        if how.row is None:
            return [b for b in bottles if self.owns(b)]
        mine = {b.name for b in bottles if self.owns(b)}
        return [r for r in rows if how.row(r) in mine]
