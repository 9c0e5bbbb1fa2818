"""The values that cross between the trainer and a node's host actor (pickled by Ray)."""

from __future__ import annotations

import enum
import re
import secrets
from collections.abc import Iterable, Mapping

import attrs

from bottlenet.errors import InvalidArgument, safe_repr

#: The daemon's codes that mean "not this node, try another" (the node is fine, just not for
#: one more bottle now); anything else a create raises is the caller's or the spec's fault.
REFUSAL_CODES = frozenset({"DRAINING", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "UNREACHABLE"})
#: Ray's own label of every node; the placer excludes refusing nodes through it.
NODE_ID_LABEL = "ray.io/node-id"
#: The custom resource each node offers (``ray start --resources '{"bottle": N}'``).
BOTTLE_RESOURCE = "bottle"
_PREFIX_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,30}")
#: Most output bytes an exec keeps per stream (the rest is counted, not kept).
EXEC_OUTPUT_LIMIT = 1 << 20


class Strategy(enum.StrEnum):
    """How a pool's bottles share nodes: spread over as many as Ray can (the default: a
    node's loss costs fewest bottles), or packed onto as few as fit."""

    SPREAD = "spread"
    PACK = "pack"

    @property
    def ray(self) -> str:
        """Ray's placement group strategy of the same name."""
        return self.value.upper()


def _check_prefix(_: object, __: object, value: str) -> None:
    if _PREFIX_RE.fullmatch(value) is None:
        raise InvalidArgument(f"name prefix {safe_repr(value)} is not [a-z0-9][a-z0-9-]{{0,30}}")


def _check_lease(_: object, __: object, value: float | None) -> None:
    if value is not None and not (1.0 <= value <= 86400.0):
        raise InvalidArgument(f"lease_seconds {safe_repr(value)} is not within 1..86400")


def _check_pool(_: object, __: object, value: str) -> None:
    if value not in ("auto", "off", "only"):
        raise InvalidArgument(f"pool {safe_repr(value)} is not auto, off or only")


def _check_selector(_: object, __: object, value: Mapping[str, str]) -> None:
    if NODE_ID_LABEL in value:
        raise InvalidArgument(f"label_selector may not name {NODE_ID_LABEL} (the placer uses it)")


@attrs.frozen
class BottleRequest:
    """What one bottle should be, and where it may go.

    ``spec`` is the bottle spec as JSON text (``BottleSpec(...).to_json()``), None for a
    forward-only bottle. ``lease_seconds`` is the lease the actor keeps renewing (the node
    reaps the bottle once it runs out, plus the daemon's grace); None asks for no lease, so
    a lost actor leaves its bottle until someone destroys it. ``control`` is the node's
    control socket as the actor sees it (None: ``$BOTTLENET_CONTROL`` on that node, else the
    daemon's default path). ``label_selector`` restricts nodes by their Ray labels;
    ``strategy`` says whether a pool's bottles spread over the nodes or pack onto few.

    ``pool`` says whether the node may hand over a warm pool's bottle of the spec
    (``bottlenetctl pool ensure`` on the node; ``docs/bottles.md``, "Warm pools"): ``auto``
    (a ready one when it has one, else booted), ``off``, or ``only`` (a node without a ready
    one refuses, RESOURCE_EXHAUSTED, and the placer tries another).

    Every field has a default, so a field added later is additive: ``docs/fleet.md``, "The
    request".
    """

    spec: str | None = None
    alias: str | None = None
    lease_seconds: float | None = attrs.field(default=60.0, validator=_check_lease)
    control: str | None = None
    label_selector: Mapping[str, str] = attrs.field(
        factory=dict, converter=dict, validator=_check_selector
    )
    name_prefix: str = attrs.field(default="ray", validator=_check_prefix)
    create_timeout: float = 300.0
    strategy: Strategy = attrs.field(default=Strategy.SPREAD, converter=Strategy)
    pool: str = attrs.field(default="auto", validator=_check_pool)

    def node_selector(self, excluded: Iterable[str] = ()) -> dict[str, str]:
        """The Ray label selector of one bottle: the request's labels, and none of the
        ``excluded`` nodes (those that refused it)."""
        selector = dict(self.label_selector)
        names = sorted(set(excluded))
        if names:
            selector[NODE_ID_LABEL] = f"!in({','.join(names)})"
        return selector

    def new_name(self) -> str:
        """A fresh bottle name (each attempt gets its own: a refused name was never made)."""
        return f"{self.name_prefix}-{secrets.token_hex(6)}"


@attrs.frozen
class Placement:
    """What a node's host did with one create: the bottle made there, or the node's
    refusal (its code and message)."""

    node_id: str
    name: str
    hostname: str
    refusal_code: str | None = None
    refusal_message: str | None = None

    @property
    def refused(self) -> bool:
        return self.refusal_code is not None


@attrs.frozen
class ExecResult:
    """A finished command: exit code and its output (each stream cut at
    :data:`EXEC_OUTPUT_LIMIT` bytes; ``dropped`` counts what was not kept)."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    dropped: int = 0


class BoundedSink:
    """A binary writer that keeps the first ``limit`` bytes and counts the rest."""

    def __init__(self, limit: int = EXEC_OUTPUT_LIMIT) -> None:
        self._chunks: list[bytes] = []
        self._kept = 0
        self.limit = limit
        self.dropped = 0

    def write(self, data: bytes) -> int:
        room = self.limit - self._kept
        if room > 0:
            self._chunks.append(bytes(data[:room]))
            self._kept += min(room, len(data))
        self.dropped += max(0, len(data) - max(room, 0))
        return len(data)

    def flush(self) -> None:
        """Nothing is buffered below this writer."""

    def getvalue(self) -> bytes:
        return b"".join(self._chunks)
