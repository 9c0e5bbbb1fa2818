"""Past one machine: bottlenetctl and the blocking client drive a daemon on another address
of this host (127.0.0.2) over TLS with client certificates, exec included."""

from __future__ import annotations

import io
import os
import socket

import pytest

from bottlenet.control import commands as C
from bottlenet.control.address import TLSCredentials
from bottlenet.control.blocking import BlockingControlClient, ControlConnectionError

from . import certs
from .vmdaemon import VMDaemon

REMOTE = "127.0.0.2"


def free_port(host: str) -> int:
    s = socket.socket()
    s.bind((host, 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.skipif(os.geteuid() != 0, reason="exec-netns (unshare) needs root")
def test_bottlenetctl_over_tls_to_another_address() -> None:
    d = VMDaemon()
    ca = certs.make_ca("bottlenet test CA")
    server = certs.issue(ca, "daemon-host", server=True, ips=(REMOTE,))
    skey, scert = certs.write(d.dir, "server", server)
    ca_path = certs.write(d.dir, "ca", ca)[1]
    ckey, ccert = certs.write(d.dir, "launcher", certs.issue(ca, "launcher-1", server=False))
    other = certs.make_ca("other CA")
    bkey, bcert = certs.write(d.dir, "intruder", certs.issue(other, "intruder", server=False))
    port = free_port(REMOTE)
    d.extra = (
        "--control-tls-port",
        str(port),
        "--control-tls-interface",
        REMOTE,
        "--control-tls-key",
        skey,
        "--control-tls-cert",
        scert,
        "--control-tls-ca",
        ca_path,
    )
    d.start()
    try:
        d.create_vm_bottle("b1")
        control = f"tls:{REMOTE}:{port}"
        tls = ["--control", control, "--cert", ccert, "--key", ckey, "--ca", ca_path]
        r = d.ctl(*tls, "--json", "bottle", "ls")
        assert r.returncode == 0, r.stderr
        assert b'"name": "b1"' in r.stdout
        r = d.ctl(
            *tls[2:],
            "--control",
            control,
            "bottle",
            "exec",
            "b1",
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 7",
        )
        assert (r.returncode, r.stdout, r.stderr) == (7, b"out\n", b"err\n")
        # the same through the environment
        env = {
            "BOTTLENET_CONTROL_CERT": ccert,
            "BOTTLENET_CONTROL_KEY": ckey,
            "BOTTLENET_CONTROL_CA": ca_path,
        }
        os.environ.update(env)
        try:
            with BlockingControlClient(control, timeout=10) as c:
                assert [b.name for b in c.all_bottles()] == ["b1"]
                out = io.BytesIO()
                big = b"x" * 300_000
                assert c.exec("b1", ["cat"], stdin=io.BytesIO(big), stdout=out) == 0
                assert out.getvalue() == big
            # a TLS client that asks for file descriptors gets frames: fds cannot travel
            with BlockingControlClient(control, timeout=10) as c:
                answer = c.call(C.Exec, bottle="b1", argv=["true"], fds=True)
                assert answer["fds"] is False
            assert "fds=True)" not in d.log() and "fds=False)" in d.log()
        finally:
            for k in env:
                os.environ.pop(k, None)
        assert "tls subject='launcher-1'" in d.log()
        # no certificate: a usage error before anything is sent; a foreign CA: refused
        r = d.ctl("--control", control, "status")
        assert r.returncode == 2 and b"--cert" in r.stderr
        r = d.ctl("--control", control, "--cert", bcert, "--key", bkey, "--ca", ca_path, "status")
        assert r.returncode == 3, r.stderr
        with pytest.raises(ControlConnectionError):
            with BlockingControlClient(
                control, timeout=5, tls=TLSCredentials(bcert, bkey, ca_path)
            ) as c:
                c.ping()
    finally:
        assert not d.cleanup()
