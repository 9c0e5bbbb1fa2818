"""A bottle's tenancy (``bottles/tenancy.py``) at its bounds: the lease's length, the owner
label's, and the state record's creator and expiry as a restarted daemon reads them."""

from __future__ import annotations

import math

import pytest

from bottlenet.bottles.store import StateError
from bottlenet.bottles.tenancy import MAX_LEASE, MIN_LEASE, Tenancy
from bottlenet.errors import InvalidArgument


def test_a_lease_may_be_exactly_its_bounds_and_no_more() -> None:
    """1 s and a week are leases; a hair outside either is INVALID_ARGUMENT."""
    for seconds in (MIN_LEASE, MAX_LEASE):
        t = Tenancy.requested(None, seconds, None)
        assert t is not None and t.lease is not None and t.lease.seconds == seconds
    for seconds in (math.nextafter(MIN_LEASE, 0), math.nextafter(MAX_LEASE, math.inf)):
        with pytest.raises(InvalidArgument):
            Tenancy.requested(None, seconds, None)


def test_an_owner_label_is_at_most_128_characters() -> None:
    """128 characters are an owner; 129 are not."""
    assert Tenancy.requested("o" * 128, None, None) == Tenancy(owner="o" * 128)
    with pytest.raises(InvalidArgument):
        Tenancy.requested("o" * 129, None, None)


@pytest.mark.parametrize(
    "record",
    [
        {"creator": "alice"},
        {"creator": "uid:007"},
        {"creator": "uid:7/" + "f" * 63},
        {"lease": {"seconds": 60.0, "expires_at": math.inf}},
        {"lease": {"seconds": 60.0, "expires_at": math.nan}},
    ],
    ids=["not-uid", "leading-zero", "short-digest", "infinite-expiry", "nan-expiry"],
)
def test_a_state_record_that_is_not_a_tenancy_is_refused(record: dict[str, object]) -> None:
    """A creator that names no uid (or one no scoped peer can be), or a lease that never
    runs out, is a malformed record, not a tenancy."""
    with pytest.raises(StateError):
        Tenancy.from_state(record, StateError)


def test_a_state_record_round_trips() -> None:
    """What a tenancy writes, it reads back (a capability's creator too)."""
    t = Tenancy("trainer-1", "uid:4243/" + "a" * 64, None).started(0.0)
    assert Tenancy.from_state(t.to_state(), StateError) == t
    leased = Tenancy.requested("o", 60, "uid:0")
    assert leased is not None
    assert Tenancy.from_state(leased.started(100.0).to_state(), StateError) == leased.started(100.0)
