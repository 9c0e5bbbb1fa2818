"""Where a client reaches the daemon: a UNIX socket path, or ``tls:HOST:PORT`` with a client
certificate (the way past one machine).

Client-side only (no reactor, no daemon module): both clients and ``bottlenetctl`` parse the
same forms. The values are ``NamedTuple``s, not attrs classes: ``bottlenetctl status`` must
not pay attrs' import for two client-side records. The TLS material comes from arguments or
the environment (``BOTTLENET_CONTROL_CERT``, ``BOTTLENET_CONTROL_KEY``, ``BOTTLENET_CONTROL_CA``).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from bottlenet.errors import InvalidArgument, safe_repr

if TYPE_CHECKING:
    import ssl

ENV_CERT = "BOTTLENET_CONTROL_CERT"
ENV_KEY = "BOTTLENET_CONTROL_KEY"
ENV_CA = "BOTTLENET_CONTROL_CA"

#: ``tcp:``, ``ssl:``, ``systemd:``...: an endpoint-style prefix, never a socket file's name
#: (a path is absolute, or relative without a scheme-like first word).
_SCHEME = re.compile(r"([a-z][a-z0-9+.-]*):")


class TLSCredentials(NamedTuple):
    """PEM files: this client's certificate and key, and the CA that signed the daemon's."""

    cert: str
    key: str
    ca: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TLSCredentials | None:
        values = [env.get(ENV_CERT), env.get(ENV_KEY), env.get(ENV_CA)]
        if not any(values):
            return None
        if not all(values):
            raise InvalidArgument(f"TLS control needs all of {ENV_CERT}, {ENV_KEY} and {ENV_CA}")
        cert, key, ca = (str(v) for v in values)
        return cls(cert, key, ca)

    def context(self) -> ssl.SSLContext:
        """A client context: TLS 1.2+, the daemon verified against ``ca`` (and its name)."""
        import ssl  # only TLS clients pay for it

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_verify_locations(cafile=self.ca)
            ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            raise InvalidArgument(f"cannot load the TLS client credentials: {e}") from None
        return ctx


class ControlAddress(NamedTuple):
    """``unix`` (``path``) or ``tls`` (``host``, ``port``)."""

    kind: str
    path: str | None = None
    host: str | None = None
    port: int | None = None

    def describe(self) -> str:
        if self.kind == "unix":
            return str(self.path)
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"tls:{host}:{self.port}"


def parse_control_address(text: str) -> ControlAddress:
    """``PATH``, ``unix:PATH`` or ``tls:HOST:PORT`` (``tls:[::1]:PORT`` for IPv6)."""
    if text.startswith("tls:"):
        rest = text[4:]
        if rest.startswith("["):
            host, sep, tail = rest[1:].partition("]")
            if not sep or not tail.startswith(":"):
                raise InvalidArgument("--control tls: use tls:HOST:PORT or tls:[V6]:PORT")
            port_text = tail[1:]
        else:
            host, sep, port_text = rest.rpartition(":")
            if not sep or ":" in host:
                raise InvalidArgument("--control tls: use tls:HOST:PORT or tls:[V6]:PORT")
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise InvalidArgument("--control tls: the port must be 1-65535")
        _check_host(host)
        return ControlAddress("tls", host=host, port=int(port_text))
    scheme = _SCHEME.match(text)
    if scheme and scheme.group(1) != "unix":
        raise InvalidArgument(
            f"--control {safe_repr(text)} is not a control address: use PATH, "
            "unix:PATH or tls:HOST:PORT (remote control is TLS only, with a client certificate)"
        )
    path = text[len("unix:") :] if text.startswith("unix:") else text
    if not path or "\0" in path:
        raise InvalidArgument("--control: an empty or invalid socket path")
    return ControlAddress("unix", path=path)


def _check_host(host: str) -> None:
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    labels = host.split(".")
    if (
        not host
        or len(host) > 253
        or not all(
            0 < len(lab) <= 63 and lab.replace("-", "").isalnum() and lab.isascii()
            for lab in labels
        )
    ):
        raise InvalidArgument(f"--control tls: host {safe_repr(host)} is not a name or address")
