"""Target checks no test pinned: a wildcard own listener owns its port on every address (C06),
and a sibling directory sharing the target root's prefix is not inside it (C09)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from bottlenet.errors import InvalidArgument
from bottlenet.forward.spec import UNIXTarget
from bottlenet.forward.targets import OwnSockets, check_target


@pytest.mark.parametrize("bound", ["0.0.0.0", "::", ""])
@pytest.mark.parametrize("dialled", ["127.0.0.1", "127.77.0.3", "::1"])
def test_a_wildcard_own_listener_owns_its_port_on_every_address(bound: str, dialled: str) -> None:
    """C06: metrics on 0.0.0.0:9100 make a forward to 127.0.0.1:9100 a loop, refused."""
    own = OwnSockets()
    own.add_tcp(bound, 9100)
    assert own.is_own_tcp(ipaddress.ip_address(dialled), 9100)
    assert not own.is_own_tcp(ipaddress.ip_address(dialled), 9101)


def test_a_specific_own_listener_owns_only_its_address() -> None:
    """The other side of C06: 127.0.0.1:9100 does not claim 127.0.0.2:9100."""
    own = OwnSockets()
    own.add_tcp("127.0.0.1", 9100)
    assert own.is_own_tcp(ipaddress.ip_address("127.0.0.1"), 9100)
    assert not own.is_own_tcp(ipaddress.ip_address("127.0.0.2"), 9100)


def test_a_sibling_directory_with_the_same_prefix_is_not_inside(tmp_path: Path) -> None:
    """C09: ``targets/evil2/x.sock`` is not inside ``targets/evil``."""
    root = str(tmp_path / "targets" / "evil")
    with pytest.raises(InvalidArgument):
        check_target(
            UNIXTarget(str(tmp_path / "targets" / "evil2" / "x.sock")), root, [], OwnSockets()
        )
