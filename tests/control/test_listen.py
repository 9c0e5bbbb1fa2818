"""The control listener: default path, socket/dir modes, stale/symlink/second-daemon rules."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator

import pytest
from twisted.internet.address import UNIXAddress
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IListeningPort
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactor
from twisted.logger import LogEvent
from twisted.python.failure import Failure
from twisted.python.systemd import ListenFDs

from bottlenet.control.endpoints import (
    ControlListenError,
    ControlPort,
    SystemdDescription,
    UNIXDescription,
    bind_private,
    control_endpoint,
    listen_private_unix,
    parse_control_description,
)
from bottlenet.control.peercred import get_peer_credentials
from bottlenet.paths import default_control_path
from bottlenet.tap import control_service


@pytest.fixture
def tmp() -> Iterator[str]:
    # Short paths: sun_path is 108 bytes and pytest's tmp_path can be long.
    d = tempfile.mkdtemp(prefix="bnc-")
    os.chmod(d, 0o700)
    yield d
    for root, dirs, files in os.walk(d, topdown=False):
        for f in files:
            os.unlink(os.path.join(root, f))
        for sub in dirs:
            p = os.path.join(root, sub)
            if os.path.islink(p):
                os.unlink(p)
            else:
                os.rmdir(p)
    os.rmdir(d)


def test_default_path() -> None:
    assert default_control_path({"XDG_RUNTIME_DIR": "/run/user/7"}, "/var/lib/bn") == (
        "/run/user/7/bottlenet/control.sock"
    )
    assert default_control_path({}, "/var/lib/bn") == "/var/lib/bn/control.sock"
    assert default_control_path({"XDG_RUNTIME_DIR": ""}, "/s") == "/s/control.sock"
    assert default_control_path({"XDG_RUNTIME_DIR": "rel"}, "/s") == "/s/control.sock"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("unix:/run/b/control.sock", UNIXDescription("/run/b/control.sock")),
        ("unix:path=/run/b/c.sock:backlog=5", UNIXDescription("/run/b/c.sock", 5)),
        ("unix:/a/b.sock:mode=600:lockfile=1", UNIXDescription("/a/b.sock")),
        ("unix:/a/with\\:colon.sock", UNIXDescription("/a/with:colon.sock")),
        ("/run/b/control.sock", UNIXDescription("/run/b/control.sock")),
        ("/a/with:colon.sock", UNIXDescription("/a/with:colon.sock")),
        ("systemd:domain=UNIX:name=control", SystemdDescription(name="control")),
        ("systemd:domain=UNIX:index=0", SystemdDescription(index=0)),
    ],
)
def test_parse_ok(text: str, expected: object) -> None:
    assert parse_control_description(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "tcp:8080",
        "ssl:443",
        "unix:relative.sock",
        "relative.sock",
        "/a\0b.sock",
        "unix:/a.sock:mode=666",
        "unix:/a.sock:bogus=1",
        "unix:",
        "systemd:domain=INET:index=0",
        "systemd:domain=UNIX",
        "systemd:domain=UNIX:name=a:index=0",
    ],
)
def test_parse_refused(text: str) -> None:
    with pytest.raises(ControlListenError):
        parse_control_description(text)


@pytest.mark.parametrize("text", ["/run/b/control.sock", "unix:/run/b/control.sock"])
def test_daemon_and_cli_read_control_alike(text: str) -> None:
    """``--control`` names the same socket for the daemon and for bottlenetctl, bare or unix:."""
    from bottlenet.control.address import parse_control_address

    described = parse_control_description(text)
    assert isinstance(described, UNIXDescription)
    assert described.path == parse_control_address(text).path == "/run/b/control.sock"


def test_bind_private_is_0600_right_after_bind(tmp: str) -> None:
    old = os.umask(0o022)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = os.path.join(tmp, "x.sock")
        bind_private(s, path)
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        assert os.umask(0o022) == 0o022  # restored
        s.close()
    finally:
        os.umask(old)


def test_listen_creates_private_dir_and_socket(tmp: str) -> None:
    path = os.path.join(tmp, "run", "bottlenet", "control.sock")
    sock, cleanup = listen_private_unix(path)
    try:
        assert stat.S_IMODE(os.lstat(os.path.dirname(path)).st_mode) == 0o700
        st = os.lstat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert sorted(os.listdir(os.path.dirname(path))) == ["control.sock", "control.sock.lock"]
        c = socket.socket(socket.AF_UNIX)
        c.connect(path)
        c.close()
    finally:
        sock.close()
        cleanup()
    assert not os.path.lexists(path)


class _SelectFree:
    """Just enough reactor for a port and its connections that nobody runs."""

    def addReader(self, reader: object) -> None:
        pass

    def removeReader(self, reader: object) -> None:
        pass

    def removeWriter(self, writer: object) -> None:
        pass


def test_connections_name_the_final_path_not_the_temporary_one(tmp: str) -> None:
    path = os.path.join(tmp, "run", "control.sock")
    sock, cleanup = listen_private_unix(path)
    accepted: list[Protocol] = []

    class Remember(Factory):
        def buildProtocol(self, addr: object) -> Protocol:
            accepted.append(Protocol())
            return accepted[-1]

    port = ControlPort(sock, path, Remember(), _SelectFree(), cleanup)
    port.startListening()
    client = socket.socket(socket.AF_UNIX)
    try:
        client.connect(path)
        assert ".tmp" in os.fsdecode(sock.getsockname())  # what the kernel remembers
        port.doRead()
        (proto,) = accepted
        assert proto.transport is not None
        assert proto.transport.getHost() == UNIXAddress(path)
        assert port.getHost() == UNIXAddress(path)
        proto.transport.connectionLost(Failure(ConnectionDone()))  # closes its socket
    finally:
        client.close()
        port.connectionLost(Failure(ConnectionDone()))
    assert not os.path.lexists(path)


def test_stale_socket_is_replaced(tmp: str) -> None:
    path = os.path.join(tmp, "control.sock")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)
    dead.close()  # bound, never listening: connect() is refused
    sock, cleanup = listen_private_unix(path)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    sock.close()
    cleanup()


@pytest.mark.parametrize("kind", ["symlink", "file", "dir"])
def test_non_socket_refused_and_kept(tmp: str, kind: str) -> None:
    path = os.path.join(tmp, "control.sock")
    target = os.path.join(tmp, "elsewhere")
    with open(target, "w") as f:
        f.write("keep me")
    if kind == "symlink":
        os.symlink(target, path)
    elif kind == "file":
        with open(path, "w") as f:
            f.write("keep me")
    else:
        os.mkdir(path)
    with pytest.raises(ControlListenError, match="refusing"):
        listen_private_unix(path)
    assert os.path.lexists(path)
    with open(target) as f:
        assert f.read() == "keep me"


def test_live_socket_not_stolen(tmp: str) -> None:
    path = os.path.join(tmp, "control.sock")
    other = socket.socket(socket.AF_UNIX)
    other.bind(path)
    other.listen(1)
    try:
        with pytest.raises(ControlListenError, match="another daemon"):
            listen_private_unix(path)
        c = socket.socket(socket.AF_UNIX)
        c.connect(path)  # still the other daemon's
        c.close()
    finally:
        other.close()


def test_second_daemon_fails_on_lock(tmp: str) -> None:
    path = os.path.join(tmp, "control.sock")
    sock, cleanup = listen_private_unix(path)
    try:
        ino = os.lstat(path).st_ino
        with pytest.raises(ControlListenError, match="another bottlenet daemon"):
            listen_private_unix(path)
        assert os.lstat(path).st_ino == ino
    finally:
        sock.close()
        cleanup()


def test_wide_or_foreign_dir_refused(tmp: str) -> None:
    d = os.path.join(tmp, "wide")
    os.mkdir(d, 0o755)
    os.chmod(d, 0o755)
    with pytest.raises(ControlListenError, match="0700"):
        listen_private_unix(os.path.join(d, "control.sock"))
    os.symlink(tmp, os.path.join(tmp, "link"))
    with pytest.raises(ControlListenError, match="symlink"):
        listen_private_unix(os.path.join(tmp, "link", "control.sock"))
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o755  # never "fixed" behind the user's back


def test_peer_credentials_of_a_real_socketpair() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        cred = get_peer_credentials(a)
        assert (cred.uid, cred.pid, cred.gid) == (os.geteuid(), os.getpid(), os.getegid())
    finally:
        a.close()
        b.close()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(OSError):
        get_peer_credentials(s)


@pytest.mark.skipif(os.geteuid() != 0, reason="another uid with chosen groups needs root")
def test_peer_groups_are_the_peers_own_at_connect(tmp: str) -> None:
    """A peer of uid 4244 with 100 supplementary groups (more than the first read asks for):
    ``groups`` holds exactly those, as the kernel recorded them at connect (what a volume is
    checked with)."""
    path = os.path.join(tmp, "p.sock")
    os.chmod(tmp, 0o755)
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o666)
    server.listen(1)
    groups = list(range(5000, 5100))
    peer = subprocess.Popen(
        ["setpriv", "--reuid=4244", "--regid=4244", f"--groups={','.join(map(str, groups))}",
         "/usr/bin/python3", "-c",
         "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.recv(1)",
         path],
    )  # fmt: skip
    try:
        server.settimeout(30)
        conn, _ = server.accept()
        with conn:
            cred = get_peer_credentials(conn)
            conn.sendall(b"x")
    finally:
        peer.wait(30)
        server.close()
    assert (cred.uid, cred.gid) == (4244, 4244)
    assert sorted(cred.groups) == groups


def test_service_failure_is_fatal_with_one_clear_line(tmp: str, logs: list[LogEvent]) -> None:
    path = os.path.join(tmp, "control.sock")
    with open(path, "w") as f:
        f.write("not a socket")
    fatal: list[str] = []
    svc = control_service(
        MemoryReactor(), f"unix:{path}", Factory.forProtocol(Protocol), fatal.append
    )
    svc.startService()
    assert len(fatal) == 1 and "not a socket" in fatal[0] and "cannot listen on" in fatal[0]
    # the one line is on_fatal's: the listener logs none of its own (issue 30: it was said
    # three times on a terminal)
    assert [e for e in logs if e["log_level"].name in ("error", "critical")] == []
    assert not any(e.get("log_failure") for e in logs)
    assert svc.port is None


def test_service_bad_description_is_fatal(logs: list[LogEvent]) -> None:
    fatal: list[str] = []
    svc = control_service(MemoryReactor(), "tcp:1234", Factory.forProtocol(Protocol), fatal.append)
    svc.startService()
    assert len(fatal) == 1 and "unix:PATH" in fatal[0]


def test_systemd_missing_fd_is_fatal() -> None:
    fatal: list[str] = []
    svc = control_service(
        MemoryReactor(),
        "systemd:domain=UNIX:name=control",
        Factory.forProtocol(Protocol),
        fatal.append,
        listen_fds=ListenFDs([], ()),
    )
    svc.startService()
    assert fatal == [
        "control: cannot listen on systemd:domain=UNIX:name=control:"
        " systemd passed no systemd socket 'control'"
    ]


def test_systemd_rejects_non_unix_fd() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    fd = os.dup(s.fileno())
    s.close()
    ep = control_endpoint(
        MemoryReactor(), "systemd:domain=UNIX:index=0", listen_fds=ListenFDs([fd], ("x",))
    )
    d: Deferred[IListeningPort] = ep.listen(Factory.forProtocol(Protocol))
    failures: list[Failure] = []
    d.addErrback(failures.append)
    assert failures and failures[0].check(ControlListenError)
