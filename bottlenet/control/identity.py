"""A scoped control peer's identity: its uid and the capability it holds, its name space.

Why: a fleet's bottle actors (Ray workers, docs/fleet.md) need to create, use and destroy
their own bottles through the node's socket, and nothing more: a worker that is compromised
must not reach another owner's bottle nor drain the node. And Ray runs every job of every
trainer as one uid, so the uid alone cannot tell one job from another.

``--allow-uid UID:scoped`` admits such a uid. Its identity is the uid **and a capability**:
a secret (22-128 of ``A-Za-z0-9_-``) its ``CreateBottle`` gives, or that the daemon mints and
answers when it gives none (``BottleRecord.capability``). Every later call of the peer about
that bottle presents it (the commands' optional ``capability`` argument); without the right
one the bottle answers ``NOT_FOUND`` exactly as a missing one. So two jobs of one uid reach
each other's bottles only by sharing the capability.

Names: each identity has a **name space** of its own. The bottle a scoped peer calls ``x`` is
``x-<tag>`` on the node (``tag``: 12 hex digits of the identity's digest), so a peer never
learns whether a name is held elsewhere (a create of any free name of its own succeeds, as
any other), and two jobs may both have an ``x``. Everything it is answered (records, forward
listings, events) names its bottles as it does. It may not choose an alias (which is the
node's, one per bottle): its bottles take the next free one. Its listings, stats and events
are its identity's bottles only (and the node's own events); its ``NodeInfo`` counts its own
bottles and their connections only; ``Drain``, ``Undrain`` and ``Leftovers`` answer
``PERMISSION_DENIED``. The digest (never the capability) is recorded as the bottle's creator
(``uid:N/<sha256 hex>`` in its state record), so a restart keeps it. A plain ``--allow-uid
UID`` keeps full control (a capability it sends is not needed and is ignored). What such a
peer may call, and how each call is checked, is ``control/scope.py``'s view.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import TYPE_CHECKING

from attrs import evolve, field, frozen

from bottlenet.bottles.events import BottleEvent
from bottlenet.errors import InvalidArgument, NotFound
from bottlenet.forward.spec import BOTTLE_NAME_MAX

if TYPE_CHECKING:
    from bottlenet.bottles.model import Bottle

_CAPABILITY = re.compile(r"[A-Za-z0-9_-]{22,128}")
#: Hex digits of an identity's digest that end its bottles' names on the node.
TAG_HEX = 12
#: The longest name a scoped peer may give a bottle (the node's name adds ``-`` and the tag).
MAX_SCOPED_NAME = BOTTLE_NAME_MAX - TAG_HEX - 1


def mint_capability() -> str:
    """A new capability: 192 random bits, 32 characters."""
    return secrets.token_urlsafe(24)


def check_capability(text: str) -> str:
    if not _CAPABILITY.fullmatch(text):
        raise InvalidArgument("capability: 22-128 of A-Z a-z 0-9 _ - (a secret; keep it so)")
    return text


@frozen
class Identity:
    """A scoped peer as one call presents itself: its uid and the capability it gave (None:
    it gave none, so it holds no bottle)."""

    uid: int
    capability: str | None = field(default=None, repr=False)
    digest: str = field(init=False, repr=False)

    @digest.default
    def _digest(self) -> str:
        if self.capability is None:
            return ""
        text = f"bottlenet capability\0{self.uid}\0{self.capability}"
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def creator(self) -> str:
        """As its bottles record their creator (the digest, never the capability)."""
        return f"uid:{self.uid}/{self.digest}" if self.digest else f"uid:{self.uid}"

    def node_name(self, name: str) -> str:
        """The node's name of its bottle ``name`` (NOT_FOUND: it holds no bottle)."""
        if not self.digest:
            raise NotFound(f"bottle {name} does not exist (no capability was given)")
        if len(name) > MAX_SCOPED_NAME:
            raise InvalidArgument(
                f"bottle name: at most {MAX_SCOPED_NAME} characters for a scoped peer"
            )
        return f"{name}-{self.digest[:TAG_HEX]}"

    def own_name(self, node_name: str) -> str | None:
        """What it calls the node's ``node_name``; None: not a name of its name space."""
        suffix = f"-{self.digest[:TAG_HEX]}"
        if not self.digest or not node_name.endswith(suffix):
            return None
        return node_name[: -len(suffix)]

    def made(self, bottle: Bottle) -> bool:
        """Whether ``bottle`` is one of this identity's (its name space and its record)."""
        creator = None if bottle.tenancy is None else bottle.tenancy.creator
        return (
            creator is not None
            and self.own_name(bottle.name) is not None
            and hmac.compare_digest(creator, self.creator)
        )

    def sees(self, event: BottleEvent) -> BottleEvent | None:
        """An event as it is shown to this identity: its own bottles' (under its names) and
        the node's (their bottle is empty); None for any other."""
        if event.bottle == "":
            return event
        own, creator = self.own_name(event.bottle), event.creator or ""
        if own is None or not hmac.compare_digest(creator, self.creator):
            return None
        return evolve(event, bottle=own)
