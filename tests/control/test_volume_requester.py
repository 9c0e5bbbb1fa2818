"""Who a create's volumes are checked for (``control/server.py`` ``requester_of``): the UNIX
peer's own uid, primary gid and groups, scoped or not; a TLS launcher, or a peer not known,
has no local uid (``bottles/volumes.py`` then asks for a ``--volume-root``)."""

from __future__ import annotations

from bottlenet.bottles.posixacl import Credentials
from bottlenet.bottles.volumes import Requester, RequesterKind
from bottlenet.control.context import PeerIdentity
from bottlenet.control.server import requester_of


def test_a_unix_peer_is_checked_with_its_own_credentials() -> None:
    """Full control and scoped peers keep their uid, gid and groups."""
    peer = PeerIdentity("unix", uid=4244, pid=7, gid=4300, groups=(4301, 4302))
    assert requester_of(peer) == Requester(
        RequesterKind.LOCAL, Credentials(4244, 4300, frozenset({4301, 4302}))
    )
    scoped = PeerIdentity("unix", uid=4243, pid=7, scoped=True, gid=4243)
    assert requester_of(scoped) == Requester(RequesterKind.SCOPED, Credentials(4243, 4243))


def test_a_tls_launcher_or_an_unknown_peer_has_no_local_uid() -> None:
    """A certificate is no uid on this host; neither is a peer not yet known."""
    assert requester_of(PeerIdentity("tls", subject="CN=launcher")) == Requester(
        RequesterKind.REMOTE
    )
    assert requester_of(None) == Requester(RequesterKind.REMOTE)
    assert requester_of(PeerIdentity("unix")) == Requester(RequesterKind.REMOTE)
