"""What a warm pool's member is to the table: its pool's spec hash, its home name, and how a
create may take one.

A warm pool (``node/pools.py``) keeps bottles of one spec booted, gated and bridged with no
workload. Its members are VM bottles like any other (their machine's *pooled* state), made
under a home name of their own (``p-<hash>-<random>``: their machines, directory and sockets
are derived from it); a create whose spec has the same hash takes one, which keeps its home
(``BottleVMs.home``) under the name the create asked for.
"""

from __future__ import annotations

import enum
import hashlib
import json
import secrets
from collections.abc import Callable

from attrs import evolve

from bottlenet.bottles.spec import BottleSpec

#: Hex digits of a spec hash (what ``pool ls`` shows and ``pool rm`` takes).
HASH_DIGITS = 12
HOME_PREFIX = "p-"


class PoolUse(enum.StrEnum):
    """Whether a create may take a warm pool's member of its spec."""

    #: A ready member when one of its spec waits, else booted as asked (the default).
    AUTO = "auto"
    #: Booted as asked, never from a pool.
    OFF = "off"
    #: A ready member, or RESOURCE_EXHAUSTED at once (a placer tries another node).
    ONLY = "only"


def spec_hash(doc: object) -> str:
    """The hash of a spec document (its canonical JSON), which names its pool: the same
    document, whatever the bottle's name, has the same hash."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_DIGITS]


def new_home(pool: str, taken: Callable[[str], bool]) -> str:
    """A fresh home name for a member of ``pool`` that no bottle or home holds."""
    while True:
        home = f"{HOME_PREFIX}{pool[:8]}-{secrets.token_hex(4)}"
        if not taken(home):
            return home


def member_spec(spec: BottleSpec, home: str) -> BottleSpec:
    """The spec a member is made from: named for its home, without the workload (nothing of
    the agent's runs until a create takes it and starts it)."""
    agent = spec.agent
    return evolve(spec, name=home, agent=None if agent is None else evolve(agent, workload=()))
