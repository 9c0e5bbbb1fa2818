"""A ``vmctl.uids.UidPool`` whose ledger, shared places and host ids are the test's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vmctl.uidranges import HostIds
from vmctl.uids import UidPool

#: A host that gives out no id in any block (the tests that need some say so).
NO_HOST = HostIds((), ())


def make_pool(tmp: Path, name: str = "data", **kw: Any) -> UidPool:
    """The pool of the data dir ``tmp/name``: ledger ``tmp/ledger``, shared place
    ``tmp/shared``, no other smolvm registry, ``NO_HOST`` unless ``ids`` is given."""
    kw.setdefault("ledger", str(tmp / "ledger"))
    kw.setdefault("shared", (str(tmp / "shared"),))
    kw.setdefault("registries", ())
    kw.setdefault("ids", lambda: NO_HOST)
    return UidPool(str(tmp / name), **kw)
