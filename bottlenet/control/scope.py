"""A scoped control peer's view of the registry: its bottles only, under its own names.

Who such a peer is (uid, capability, name space) is ``control/identity.py``. The view is
derived: each ``ControlBackend`` method declares its ``Scope`` and what its answer ``Names``
(``control/backend.py``), and :class:`ScopedBackend` checks and renames each call by that; a
method that declares none is not there for a scoped peer."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from attrs import evolve

from bottlenet.bottles.events import BottleEvent
from bottlenet.bottles.tenancy import Tenancy
from bottlenet.control.backend import ControlBackend, Names, Scope, Scoping, scoping
from bottlenet.control.identity import Identity
from bottlenet.errors import NotFound, PermissionDenied

#: Per kind of answer: the node's name of the bottle it names, and it under another name.
_NAMES: dict[Names, tuple[Callable[[Any], str], Callable[[Any, str], Any]]] = {
    Names.BOTTLE: (lambda b: b.name, lambda b, n: evolve(b, name=n)),
    Names.VERIFIED: (lambda v: v[0].name, lambda v, n: (evolve(v[0], name=n), v[1])),
    Names.FORWARD: (lambda f: f.spec.bottle, lambda f, n: evolve(f, spec=evolve(f.spec, bottle=n))),
    Names.ROW: (lambda r: r.bottle, lambda r, n: evolve(r, bottle=n)),
}


class ScopedBackend:
    """The registry as one scoped identity sees it (a ``ControlBackend``): its names in,
    its names out, each method checked by its declared scope."""

    def __init__(self, backend: ControlBackend, identity: Identity) -> None:
        self._backend = backend
        self.identity = identity

    def inner(self, name: str) -> str:
        """The node's name of its bottle ``name`` (for what the control plane keeps by it)."""
        return self.identity.node_name(name)

    def sees(self, event: BottleEvent) -> BottleEvent | None:
        return self.identity.sees(event)

    def _mine(self, name: str) -> str:
        """The node's name of its bottle ``name``; NOT_FOUND as for a missing one else."""
        node_name = self.identity.node_name(name)
        try:
            made = self.identity.made(self._backend.get_bottle(node_name))
        except NotFound:
            made = False
        if not made:
            raise NotFound(f"bottle {name} does not exist")
        return node_name

    def _own(self, node_name: str) -> str:
        own = self.identity.own_name(node_name)
        assert own is not None, "an answer of another's bottle"
        return own

    def __getattr__(self, name: str) -> Callable[..., Any]:
        try:
            how = scoping(name)
        except KeyError:
            raise AttributeError(f"{name}: not a method of the control backend") from None
        if inspect.iscoroutinefunction(getattr(ControlBackend, name)):

            async def checked_later(*args: Any, **kwargs: Any) -> Any:
                args, named = self._in(how, list(args), kwargs)
                return self._out(how, await getattr(self._backend, name)(*args, **kwargs), named)

            return checked_later

        def checked(*args: Any, **kwargs: Any) -> Any:
            args, named = self._in(how, list(args), kwargs)
            return self._out(how, getattr(self._backend, name)(*args, **kwargs), named)

        return checked

    def _in(self, how: Scoping, args: list[Any], kwargs: dict[str, Any]) -> tuple[Any, bool]:
        """A call's arguments under the node's names (raise: refused); whether it names one
        of its bottles (a create names its new one)."""
        if how.scope is Scope.HOST:
            raise PermissionDenied(f"{how.command}: a scoped peer may not ask for it")
        if how.scope is Scope.CREATE:
            if (args[1:2] or [kwargs.pop("alias", None)])[0] is not None:
                raise PermissionDenied(
                    "CreateBottle: a scoped peer may not choose an alias (its bottle gets the "
                    "next free one)"
                )
            args[0:2] = [self.identity.node_name(args[0]), None]
            if kwargs.get("spec") is not None:
                kwargs["spec"] = evolve(kwargs["spec"], name=args[0])
            tenancy = kwargs.get("tenancy") or Tenancy()
            kwargs["tenancy"] = evolve(tenancy, creator=self.identity.creator)
            return args, True
        if args and args[0] is not None:
            args[0] = self._mine(args[0])
            return args, True
        if how.scope is Scope.BOTTLE:
            raise TypeError("the bottle is a scoped call's first argument")
        return args, False

    def _out(self, how: Scoping, answer: Any, named: bool) -> Any:
        """An answer under its names; a listing of every bottle, its own bottles' rows only."""
        if how.answer is Names.NONE:
            return answer
        bottle_of, renamed = _NAMES[how.answer]
        own = self._own
        if how.scope is not Scope.LISTING:
            return renamed(answer, own(bottle_of(answer)))
        if not named:
            made = self.identity.made
            mine = {b.name for b in self._backend.list_bottles() if made(b)}
            answer = [r for r in answer if bottle_of(r) in mine]
        return [renamed(r, own(bottle_of(r))) for r in answer]
