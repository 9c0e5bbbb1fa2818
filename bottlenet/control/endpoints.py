"""Where the control socket listens, and how it gets there safely.

Twisted's own UNIX port would chmod the socket to 0666 (``mode`` default), chmods only
*after* ``bind()``, unlinks whatever path it was bound to when it stops, and an adopted
(systemd) socket gets the same chmod. So ``--control`` accepts only two kinds of endpoint,
both served by a small port of our own:

- ``unix:PATH``: a socket bound under umask 0177 at a temporary name inside a 0700
  directory, chmodded 0600, then renamed into place (never wider than 0600, not even
  briefly). A lock file keeps a second daemon out; a stale socket (connect is refused) is
  replaced; a symlink or non-socket at the path is refused and never unlinked.
- ``systemd:domain=UNIX:name=N`` (or ``index=I``): a socket systemd passed us; systemd owns
  its path and mode, we never chmod or unlink it.

The optional TLS listener for remote control is :func:`tls_control_endpoint`.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
import stat
from collections.abc import Callable
from typing import Any

from attrs import frozen
from twisted.internet import tcp, unix
from twisted.internet.address import UNIXAddress
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.endpoints import (
    TCP4ServerEndpoint,
    TCP6ServerEndpoint,
    serverFromString,
)
from twisted.internet.interfaces import (
    IAddress,
    IListeningPort,
    IProtocolFactory,
    IReactorTCP,
    IStreamServerEndpoint,
)
from twisted.logger import Logger
from twisted.protocols.tls import BufferingTLSTransport, TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.python.systemd import ListenFDs
from zope.interface import implementer

from bottlenet.errors import ListenError
from bottlenet.paths import (
    MAX_SUN_PATH,
    PrivateDirError,
    ensure_private_dir,
    split_description,
    unix_path_state,
)


class ControlListenError(ListenError):
    """The control listener cannot be set up; the message is one clear line for the log."""


@frozen
class UNIXDescription:
    path: str
    backlog: int = 50


@frozen
class SystemdDescription:
    name: str | None = None
    index: int | None = None

    def describe(self) -> str:
        return f"systemd socket {self.name!r}" if self.name else f"systemd socket #{self.index}"


def parse_control_description(text: str) -> UNIXDescription | SystemdDescription:
    """Parse ``--control``; anything but a UNIX socket is refused (TLS has its own options).

    A bare absolute path is the socket's path as it is (no escaping), the same rule as
    ``bottlenetctl --control``: ``/run/x.sock`` and ``unix:/run/x.sock`` are one socket.
    """
    if text.startswith("/"):
        if "\0" in text:
            raise ControlListenError("--control: the socket path holds a NUL byte")
        return UNIXDescription(os.path.normpath(text))
    try:
        description = split_description(text)
    except ValueError as e:
        raise ControlListenError(f"--control: {e}") from None
    kind, positional = description.kind, description.positional
    options = dict(description.options)
    if kind == "unix":
        named = options.pop("path", None)
        if len(positional) > (0 if named is not None else 1):
            raise ControlListenError("--control: unix: takes one path")
        path = named if named is not None else (positional[0] if positional else "")
        mode = options.pop("mode", "600")
        if mode.lstrip("0o") != "600":
            raise ControlListenError("--control: the control socket is always mode 0600")
        options.pop("lockfile", None)  # we always lock
        backlog = options.pop("backlog", "50")
        if options:
            raise ControlListenError(f"--control: unknown option(s) {sorted(options)}")
        if not path or not os.path.isabs(path):
            raise ControlListenError(f"--control: {path!r} is not an absolute path")
        if not backlog.isdigit():
            raise ControlListenError("--control: backlog must be a number")
        return UNIXDescription(os.path.normpath(path), int(backlog))
    if kind == "systemd":
        domain = options.pop("domain", "")
        if domain != "UNIX":
            raise ControlListenError("--control: a systemd socket must be domain=UNIX")
        name, index = options.pop("name", None), options.pop("index", None)
        if options or positional or (name is None) == (index is None):
            raise ControlListenError("--control: systemd takes domain=UNIX and name= or index=")
        if index is not None and not index.isdigit():
            raise ControlListenError("--control: systemd index must be a number")
        return SystemdDescription(name=name, index=int(index) if index is not None else None)
    raise ControlListenError(
        "--control must be unix:PATH, an absolute PATH or systemd:domain=UNIX:name=N,"
        f" not {kind!r}:"
        " use the TLS options for remote control"
    )


def _probe_existing(path: str) -> None:
    """Remove a stale socket at ``path``; refuse anything else that is there."""
    state, error = unix_path_state(path)
    if state == "absent":
        return
    if state == "stale":
        os.unlink(path)  # its daemon is gone
        return
    if state == "symlink":
        raise ControlListenError(f"{path} is a symlink; refusing to use or remove it")
    if state == "not-a-socket":
        raise ControlListenError(f"{path} exists and is not a socket; refusing to remove it")
    if error is not None:
        why = error.strerror or type(error).__name__
        raise ControlListenError(f"cannot check the existing socket {path}: {why}")
    raise ControlListenError(f"another daemon is answering on {path}; not taking it over")


def _lock(path: str) -> int:
    lock_path = path + ".lock"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise ControlListenError(f"cannot open lock {lock_path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ControlListenError(
            f"another bottlenet daemon holds {lock_path}; not taking over {path}"
        ) from None
    return fd


def bind_private(sock: socket.socket, path: str) -> None:
    """``bind()`` under umask 0177 so the new socket file is born 0600.

    The umask is process-wide; this runs at startup, before any thread creates files.
    """
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)


def listen_private_unix(path: str, backlog: int = 50) -> tuple[socket.socket, Callable[[], None]]:
    """A listening socket at ``path`` (0600 in a 0700 dir) and its cleanup function."""
    if len(os.fsencode(path)) + 16 > MAX_SUN_PATH:
        raise ControlListenError(f"{path} is too long for a UNIX socket path")
    directory = os.path.dirname(path)
    try:
        # Refused, not chmodded: the directory may be one the user chose to share. 0701 is
        # accepted (the state dir after smolvm's start as root): the socket itself is 0600.
        ensure_private_dir(directory, traversable=True)
    except PrivateDirError as e:
        raise ControlListenError(
            f"{e.message}; the control socket needs a 0700 directory of its own"
        ) from None
    lock_fd = _lock(path)
    tmp = os.path.join(directory, f".{secrets.token_hex(6)}.tmp")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _probe_existing(path)
        bind_private(sock, tmp)
        os.chmod(tmp, 0o600)
        sock.listen(backlog)
        sock.setblocking(False)
        os.rename(tmp, path)
        st = os.lstat(path)
    except BaseException as e:
        sock.close()
        os.close(lock_fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise ControlListenError(f"cannot listen on {path}: {e.strerror}") from None
        raise
    ident = (st.st_dev, st.st_ino)

    def cleanup() -> None:
        try:
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) == ident:
                os.unlink(path)
        except OSError:
            pass
        os.close(lock_fd)

    return sock, cleanup


class ControlConnection(unix.Server):
    """A control connection that names the port's path as its host address.

    The kernel keeps the name a socket was bound under, and ``listen_private_unix`` binds at
    a temporary name before renaming it into place; ``getsockname()`` (and so Twisted's
    "connection established (HOST:...)" line) would name that ``.….tmp`` file.
    """

    server: ControlPort

    def getHost(self) -> UNIXAddress:
        return self.server.getHost()


class ControlPort(unix.Port):
    """A UNIX port around a socket that is already bound and listening.

    Unlike ``unix.Port`` it never chmods the path and never unlinks a path it does not own,
    and its connections report the final path, not the temporary one (ControlConnection).
    """

    transport = ControlConnection

    def __init__(
        self,
        sock: socket.socket,
        path: str,
        factory: IProtocolFactory,
        reactor: Any,
        cleanup: Callable[[], None],
    ) -> None:
        super().__init__(os.fsencode(path), factory, reactor=reactor)
        self._sock = sock
        self._path = path
        self._cleanup = cleanup

    def startListening(self) -> None:
        tcp._reservedFD.reserve()
        assert self.factory is not None
        self.factory.doStart()
        self.connected = True
        self.socket = self._sock
        self.fileno = self._sock.fileno  # type: ignore[method-assign]
        self.numberAccepts = 100
        self.startReading()

    def getHost(self) -> UNIXAddress:
        return UNIXAddress(self._path)

    def connectionLost(self, reason: Failure) -> None:
        try:
            tcp.Port.connectionLost(self, reason)
        finally:
            self._cleanup()


@implementer(IStreamServerEndpoint)
class PrivateUNIXServerEndpoint:
    """``unix:PATH`` the safe way (see the module docstring)."""

    def __init__(self, reactor: Any, path: str, backlog: int = 50) -> None:
        self._reactor = reactor
        self.path = path
        self._backlog = backlog

    def listen(self, protocolFactory: IProtocolFactory) -> Deferred[IListeningPort]:
        try:
            sock, cleanup = listen_private_unix(self.path, self._backlog)
        except ControlListenError:
            return fail()
        port = ControlPort(sock, self.path, protocolFactory, self._reactor, cleanup)
        try:
            port.startListening()
        except BaseException:
            sock.close()
            cleanup()
            return fail()
        return succeed(port)


def inherited_fd(
    description: SystemdDescription, listen_fds: ListenFDs | None = None, reactor: Any = None
) -> int:
    """The descriptor systemd passed for ``description`` (ControlListenError: none)."""
    d = description
    try:
        if listen_fds is None:
            # twisted.internet.endpoints reads (and deletes) LISTEN_FDS when it is
            # imported, so ask its systemd parser instead of the environment.
            spec = f"name={d.name}" if d.name is not None else f"index={d.index}"
            adopted = serverFromString(reactor, f"systemd:domain=UNIX:{spec}")
            fd: int = adopted.fileno
            return fd
        if d.name is not None:
            return listen_fds.inheritedNamedDescriptors()[d.name]
        assert d.index is not None
        return listen_fds.inheritedDescriptors()[d.index]
    except (KeyError, IndexError):
        raise ControlListenError(f"systemd passed no {d.describe()}") from None


def inherited_socket_path(
    description: SystemdDescription, listen_fds: ListenFDs | None = None
) -> str | None:
    """The path of the UNIX socket systemd passed for ``description`` (``getsockname`` of the
    inherited descriptor, which stays where it is), or None: none passed, not a UNIX socket
    with a path (an abstract one), or unreadable."""
    try:
        fd = inherited_fd(description, listen_fds)
        with socket.socket(fileno=os.dup(fd)) as sock:
            if sock.family != socket.AF_UNIX:
                return None
            name = sock.getsockname()
    except (ControlListenError, OSError):
        return None
    path = name if isinstance(name, str) else os.fsdecode(name)
    return path if path.startswith("/") else None


@implementer(IStreamServerEndpoint)
class SystemdUNIXServerEndpoint:
    """Adopt a UNIX listening socket passed by systemd, without touching its path or mode."""

    log = Logger()

    def __init__(
        self, reactor: Any, description: SystemdDescription, listen_fds: ListenFDs | None
    ) -> None:
        self._reactor = reactor
        self.description = description
        self._fds = listen_fds

    def _fd(self) -> int:
        return inherited_fd(self.description, self._fds, self._reactor)

    def listen(self, protocolFactory: IProtocolFactory) -> Deferred[IListeningPort]:
        try:
            fd = self._fd()
            # Our own non-inheritable copy; close the inherited one so no child gets it.
            sock = socket.socket(fileno=os.dup(fd))
            os.close(fd)
            if (
                sock.family != socket.AF_UNIX
                or sock.type != socket.SOCK_STREAM
                or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            ):
                sock.close()
                raise ControlListenError(
                    f"{self.description.describe()} is not a listening UNIX stream socket"
                )
        except ControlListenError:
            return fail()
        except OSError as e:
            return fail(ControlListenError(f"{self.description.describe()}: {e.strerror}"))
        except Exception as e:
            return fail(ControlListenError(f"{self.description.describe()}: {e}"))
        sock.setblocking(False)
        name = sock.getsockname()
        path = name if isinstance(name, str) else os.fsdecode(name)
        self._warn_if_wide(path)
        port = ControlPort(sock, path, protocolFactory, self._reactor, lambda: None)
        port.startListening()
        return succeed(port)

    def _warn_if_wide(self, path: str) -> None:
        if not path or path.startswith("\0"):
            return
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError:
            return
        if mode & 0o007:
            self.log.warn(
                "control: systemd socket {path} is mode {mode:04o} (world-accessible);"
                " set SocketMode=0600 or 0660",
                path=path,
                mode=mode,
            )


def control_endpoint(
    reactor: Any, description: str, *, listen_fds: ListenFDs | None = None
) -> IStreamServerEndpoint:
    """The endpoint for ``--control`` (raises ControlListenError for a bad description)."""
    parsed = parse_control_description(description)
    if isinstance(parsed, UNIXDescription):
        return PrivateUNIXServerEndpoint(reactor, parsed.path, parsed.backlog)
    return SystemdUNIXServerEndpoint(reactor, parsed, listen_fds)


def tls_control_endpoint(
    reactor: IReactorTCP,
    port: int,
    interface: str,
    key: str,
    cert: str,
    ca: str,
) -> IStreamServerEndpoint:
    """A TLS listener that requires a client certificate signed by ``ca``.

    ``key``, ``cert`` and ``ca`` are PEM file paths. ``interface`` is required: the remote
    listener binds only where it is asked to. Clients without a certificate, with one from
    another CA, or with an expired one fail the handshake before any AMP byte.
    """
    from OpenSSL import SSL
    from twisted.internet import ssl

    if not interface:
        raise ControlListenError("the TLS control listener needs an explicit interface")
    try:
        with open(key, "rb") as f:
            key_pem = f.read()
        with open(cert, "rb") as f:
            cert_pem = f.read()
        with open(ca, "rb") as f:
            ca_pem = f.read()
        server = ssl.PrivateCertificate.loadPEM(cert_pem + b"\n" + key_pem)
        authority = ssl.Certificate.loadPEM(ca_pem)
    except (OSError, SSL.Error, ValueError) as e:
        raise ControlListenError(f"cannot load TLS control credentials: {e}") from None
    options = ssl.CertificateOptions(
        privateKey=server.privateKey.original.to_cryptography_key(),
        certificate=server.original.to_cryptography(),
        trustRoot=ssl.trustRootFromCertificates([authority]),
        raiseMinimumTo=ssl.TLSVersion.TLSv1_2,
    )
    inner: IStreamServerEndpoint
    if ":" in interface:
        inner = TCP6ServerEndpoint(reactor, port, interface=interface)
    else:
        inner = TCP4ServerEndpoint(reactor, port, interface=interface)
    return _RefusingTLSServerEndpoint(options, inner)


class _FirstBytesTLSProtocol(BufferingTLSTransport):
    """Tells the wrapped protocol (``first_bytes_received()``, if it has one) when the peer
    sends its first bytes: the handshake admission evicts silent connections first."""

    _spoke = False

    def dataReceived(self, data: bytes) -> None:
        if not self._spoke:
            self._spoke = True
            note = getattr(self.wrappedProtocol, "first_bytes_received", None)
            if note is not None:
                note()
        super().dataReceived(data)


class _RefusingTLSFactory(TLSMemoryBIOFactory):
    """Adds TLS, but never around a refusal: Twisted's own wrapper wraps the ``None`` a
    capped factory returns, and every byte of that connection then logs a traceback."""

    protocol = _FirstBytesTLSProtocol

    def buildProtocol(self, addr: IAddress | None) -> Any:
        inner = self.wrappedFactory.buildProtocol(addr)
        if inner is None:
            return None
        return self.protocol(self, inner)


@implementer(IStreamServerEndpoint)
class _RefusingTLSServerEndpoint:
    """``wrapServerTLS`` with :class:`_RefusingTLSFactory` as the wrapper."""

    def __init__(self, options: Any, inner: IStreamServerEndpoint) -> None:
        self._options = options
        self._inner = inner

    def listen(self, protocolFactory: IProtocolFactory) -> Deferred[IListeningPort]:
        return self._inner.listen(_RefusingTLSFactory(self._options, False, protocolFactory))
