"""``BottlePool``: N bottles of one request, placed across the nodes, destroyed together."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from types import TracebackType

from ray.util.placement_group import PlacementGroup, remove_placement_group
from tqdm import tqdm

from bottlenet.fleet.errors import Refusal
from bottlenet.fleet.placed import PlacedBottle
from bottlenet.fleet.placement import Placer, destroy_all
from bottlenet.fleet.request import BottleRequest


class BottlePool:
    """``with BottlePool(30, request) as pool:`` places 30 bottles (a progress bar on an
    interactive stderr, or as ``progress`` says) and destroys them all on the way out.

    Placement is all or nothing: if one bottle cannot be placed within ``max_attempts``
    refusals or ``timeout`` seconds, the bottles already placed are destroyed and the typed
    error (:class:`~bottlenet.fleet.errors.PlacementFailed`) is raised. The pool's
    ``bottle`` reservation (one Ray placement group) is held until the pool closes, also
    for a bottle destroyed on its own before. ``on_ready(done)`` is called as each bottle
    is ready.
    """

    def __init__(
        self,
        count: int,
        request: BottleRequest | None = None,
        *,
        max_attempts: int = 3,
        timeout: float = 300.0,
        progress: bool | None = None,
        on_ready: Callable[[int], None] | None = None,
    ) -> None:
        self.count = count
        self.request = request or BottleRequest()
        self.max_attempts = max_attempts
        self.timeout = timeout
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.on_ready = on_ready
        self.bottles: list[PlacedBottle] = []
        self.reservation: PlacementGroup | None = None
        #: the nodes' refusals while placing (each retried elsewhere, or the error's)
        self.refusals: list[Refusal] = []

    def open(self) -> BottlePool:
        bar = tqdm(total=self.count, unit="bottle", disable=not self.progress, file=sys.stderr)

        def advance(done: int) -> None:
            bar.update(done - bar.n)
            if self.on_ready is not None:
                self.on_ready(done)

        with bar:
            placer = Placer(
                self.request, self.count, self.max_attempts, self.timeout, progress=advance
            )
            try:
                self.bottles = placer.run()
                self.reservation = placer.shared
            finally:
                self.refusals = list(placer.refusals)
        return self

    def close(self) -> None:
        """Destroy every bottle of the pool (each once; a lost one is reaped by its node) and
        free the pool's reservation."""
        bottles, self.bottles = self.bottles, []
        reservation, self.reservation = self.reservation, None
        destroy_all(bottles)
        if reservation is not None:
            remove_placement_group(reservation)

    def __enter__(self) -> BottlePool:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __iter__(self) -> Iterator[PlacedBottle]:
        return iter(self.bottles)

    def __len__(self) -> int:
        return len(self.bottles)

    def __getitem__(self, index: int) -> PlacedBottle:
        return self.bottles[index]
