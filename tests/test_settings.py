"""``settings_from(parsed options)`` in process: every check of the daemon's settings, with a
good and a bad value, and the exact ``bottlenet: error: ...`` line a bad one ends in.

The numeric flags are checked by their coerce functions while the options are parsed; the
rest by :func:`bottlenet.settings.settings_from`. Both raise :class:`StartupError` (a
``SystemExit``), which the runner prints as one line with exit status 1 (the one subprocess
test of that contract is in ``tests/test_daemon.py``).
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from pathlib import Path

import pytest
from twisted.internet.testing import MemoryReactorClock

from bottlenet.bottles.registry import DEFAULT_MAX_BOTTLES
from bottlenet.settings import (
    DaemonSettings,
    Options,
    StartupError,
    TLSSettings,
    bounded_int,
    bounded_seconds,
    settings_from,
)
from bottlenet.tap import build_service


def _settings(tmp_path, *args: str) -> DaemonSettings:  # type: ignore[no-untyped-def]
    options = Options()
    options.parseOptions(["--state-dir", str(tmp_path / "s"), *args])
    return settings_from(options, {"PATH": os.environ.get("PATH", "")})


def _error(tmp_path, *args: str) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(StartupError) as e:
        _settings(tmp_path, *args)
    assert e.value.code == f"bottlenet: error: {e.value.message}"
    return e.value.message


def _tls(tmp_path, **given: str) -> list[str]:  # type: ignore[no-untyped-def]
    pem = tmp_path / "x.pem"
    pem.write_text("")
    values = {"port": "9443", "interface": "127.0.0.1", "key": str(pem), "cert": str(pem)}
    values |= {"ca": str(pem), **given}
    return [a for n, v in values.items() for a in (f"--control-tls-{n}", v)]


def test_defaults_are_typed_values(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With no flag, every numeric setting is its default as a number, not the flag's text."""
    s = _settings(tmp_path)
    assert (s.connect_timeout, s.max_bottles, s.control_cap, s.metrics_cap) == (10.0, 256, 64, 16)
    assert (s.budgets.per_bottle_connections, s.budgets.max_connections) == (4096, None)
    assert s.budgets.idle_timeout == 900.0 and s.budgets.reserved_fds == 256
    assert s.tls is None and s.relay_engine == "auto" and not s.skip_probe
    assert s.state_dir == str(tmp_path / "s")
    assert not os.path.exists(s.state_dir)  # settings touch nothing on disk


@pytest.mark.parametrize(
    ("flag", "good", "bad", "why"),
    [
        ("control-max-connections", "4096", ["0", "4097", "many", "-1"], "an integer 1-4096"),
        ("metrics-max-connections", "1024", ["0", "1025", "1e3"], "an integer 1-1024"),
        ("max-bottles", "65536", ["0", "65537", "+5", " 5"], "an integer 1-65536"),
        ("max-bottle-connections", "1048576", ["0", "1048577", "5_0"], "an integer 1-1048576"),
        ("max-connections", "1", ["0", "1048577", "²"], "an integer 1-1048576"),
        ("control-tls-port", "65535", ["0", "65536", "https"], "a port 1-65535"),
        ("connect-timeout", "600", ["0", "600.5", "-1", "nan", "soon"], "in (0, 600]"),
        ("idle-timeout", "0", ["-1", "604801", "nan", "inf", "x"], "0-604800 (0: off)"),
    ],
)
def test_numeric_flags_are_checked_while_parsing(  # type: ignore[no-untyped-def]
    tmp_path, flag: str, good: str, bad: list[str], why: str
) -> None:
    """A numeric flag out of its range is one typed line naming the flag and its range."""
    options = Options()
    options.parseOptions([f"--{flag}", good])
    assert options[flag] == float(good)
    for value in bad:
        with pytest.raises(StartupError) as e:
            Options().parseOptions([f"--{flag}", value])
        noun = "a number of seconds" if "timeout" in flag else "must be"
        assert e.value.message.startswith(f"--{flag}: must be ") and why in e.value.message
        assert noun in e.value.message


def test_numeric_flags_reach_the_settings(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each checked number lands in its setting, and a TLS listener doubles the fd reserve."""
    s = _settings(
        tmp_path,
        *["--connect-timeout", "2.5", "--max-bottles", "7", "--control-max-connections", "100"],
        *["--metrics-max-connections", "3", "--max-bottle-connections", "9"],
        *["--max-connections", "11", "--idle-timeout", "0"],
        *_tls(tmp_path),
    )
    assert (s.connect_timeout, s.max_bottles, s.control_cap, s.metrics_cap) == (2.5, 7, 100, 3)
    budgets = s.budgets
    assert (budgets.per_bottle_connections, budgets.max_connections) == (9, 11)
    assert budgets.idle_timeout == 0.0
    assert budgets.reserved_fds == 4 * 100 * 2


def test_max_bottles_reaches_the_registry(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--max-bottles`` is the cap of the registry the daemon builds (the default otherwise)."""
    caps = []
    for args in (["--max-bottles", "7"], []):
        options = Options()
        options.parseOptions(["--state-dir", str(tmp_path / f"s{len(caps)}"), *args])
        root = build_service(options, MemoryReactorClock())
        try:
            caps.append(root.registry.max_bottles)
        finally:
            assert root.state_lock is not None
            root.state_lock.release()
    assert caps == [7, DEFAULT_MAX_BOTTLES]


def test_coerce_functions_document_their_range() -> None:
    """``--help`` shows each coerce function's range (Twisted prints ``coerceDoc``)."""
    assert bounded_int(1, 9).coerceDoc == "An integer 1-9."  # type: ignore[attr-defined]
    assert bounded_int(1, 9, "a port").coerceDoc == "A port 1-9."  # type: ignore[attr-defined]
    off = bounded_seconds(5, zero_is_off=True)
    assert off.coerceDoc == "Seconds 0-5 (0: off)."  # type: ignore[attr-defined]
    assert "Seconds in (0, 600]." in str(Options())


def test_help_says_what_the_daemon_does_now() -> None:
    """``--help``: socket mode is the default (raw ports are opt-in) and the gate's outside
    target is checked by TCP, UDP and ICMP, as the README says (issue 30, stale wording)."""
    text = " ".join(str(Options()).split())
    assert "raw ports." not in text and "exposed UNIX sockets; raw TCP ports only" in text
    assert "(by TCP, UDP and ICMP)" in text


def test_relay_engine(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--relay-engine`` names one of the engines; anything else is refused while parsing."""
    assert _settings(tmp_path, "--relay-engine", "portable").relay_engine == "portable"
    with pytest.raises(StartupError) as e:
        Options().parseOptions(["--relay-engine", "fast"])
    assert e.value.message == (
        "--relay-engine: unknown relay engine 'fast' (choose from auto, splice, portable)"
    )


def test_alias_pool(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--alias-pool`` must be a loopback network; a good one is the settings' pool."""
    assert str(_settings(tmp_path, "--alias-pool", "127.88.0.0/16").pool.network) == "127.88.0.0/16"
    assert _error(tmp_path, "--alias-pool", "0.0.0.0/0").startswith("--alias-pool: ")


def test_config_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--config`` is read and checked here: a bad key is one line naming file and key."""
    good = tmp_path / "good.toml"
    good.write_text("[[bottle]]\nname = 'demo'\nalias = '127.77.0.9'\n")
    s = _settings(tmp_path, "--config", str(good))
    assert [b.name for b in s.config.bottles] == ["demo"] and s.config_path == str(good)
    bad = tmp_path / "bad.toml"
    bad.write_text("[[bottle]]\nname = 'demo'\nalias = '127.0.0.1'\n")
    assert _error(tmp_path, "--config", str(bad)) == (
        f"{bad}: bottle[0].alias: alias 127.0.0.1 is not in the alias pool 127.77.0.0/16"
    )


def test_metrics_endpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--metrics``: a UNIX socket in the state dir by default, ``none``, a loopback TCP
    port, or one typed line; a state dir too long for a socket path serves none."""
    s = _settings(tmp_path)
    assert s.metrics is not None and s.metrics.kind == "unix"
    assert s.metrics.path == str(tmp_path / "s" / "metrics.sock")
    assert _settings(tmp_path, "--metrics", "none").metrics is None
    tcp = _settings(tmp_path, "--metrics", "tcp:9100:interface=127.0.0.1").metrics
    assert tcp is not None and (tcp.kind, tcp.port) == ("tcp", 9100)
    assert _error(tmp_path, "--metrics", "tcp:9100").startswith("--metrics: metrics endpoint")
    long_dir = tmp_path / ("d" * 120)
    assert _settings(long_dir).metrics is None


def test_tls_options_all_or_none(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """All five ``--control-tls-*`` options or none; each PEM must be a file."""
    pem = str(tmp_path / "x.pem")
    s = _settings(tmp_path, *_tls(tmp_path))
    assert s.tls == TLSSettings(9443, "127.0.0.1", pem, pem, pem)
    assert _error(tmp_path, "--control-tls-port", "9443") == (
        "--control-tls-port also needs --control-tls-interface, --control-tls-key, "
        "--control-tls-cert, --control-tls-ca"
    )
    missing = str(tmp_path / "nope.pem")
    assert _error(tmp_path, *_tls(tmp_path, ca=missing)) == (
        f"--control-tls-ca: {missing} is not a readable file"
    )


def test_gate_targets(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The gate's outside target and DNS name are checked; the daemon's own TCP ports (TLS,
    metrics) are the ports the gate must find closed."""
    s = _settings(
        tmp_path,
        *["--gate-outside", "192.0.2.7:80", "--gate-dns-name", "example.test"],
        *["--metrics", "tcp:9100:interface=127.0.0.1", *_tls(tmp_path)],
    )
    assert (s.gate.outside, s.gate.dns_name, s.gate.host_ports) == (
        "192.0.2.7:80",
        "example.test",
        (9443, 9100),
    )
    for flag, value in (("--gate-outside", "nowhere"), ("--gate-dns-name", "Not A Name")):
        assert _error(tmp_path, flag, value).startswith("--gate-outside/--gate-dns-name: ")


def test_control_endpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A ``--control`` that is neither unix:PATH, an absolute PATH nor systemd: is one line;
    a good one gives its socket path (which no forward may target)."""
    path = str(tmp_path / "run" / "c.sock")
    s = _settings(tmp_path, "--control", f"unix:{path}")
    assert (s.control, s.control_path) == (f"unix:{path}", path)
    assert os.path.dirname(path) in s.protected_paths
    assert _settings(tmp_path, "--control", "systemd:domain=UNIX:name=c").control_path is None
    assert _error(tmp_path, "--control", "relative/c.sock") == (
        "--control must be unix:PATH, an absolute PATH or systemd:domain=UNIX:name=N, not "
        "'relative/c.sock': use the TLS options for remote control"
    )


def test_smolvm_options(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--smolvm`` and ``--smolvm-data-dir`` are checked here (the binary is found once)."""
    # over 61 bytes whatever the pytest temp root, and short enough that the message names it
    # whole (a short --basetemp gives a short tmp_path, the default a long one)
    data_dir = str(tmp_path / ("smolvm-data-" + "d" * max(0, 62 - len(os.fsencode(tmp_path)))))
    size = len(os.fsencode(data_dir))
    assert _error(tmp_path, "--smolvm-data-dir", data_dir) == (
        f"--smolvm-data-dir {data_dir}: too long ({size} bytes, at most 61): smolvm binds "
        "per-machine UNIX sockets below it"
    )
    assert not os.path.exists(data_dir)
    missing = str(tmp_path / "smolvm-typo")
    assert _error(tmp_path, "--smolvm", missing) == f"--smolvm {missing}: no such file"
    s = _settings(tmp_path, "--smolvm-data-dir", "/tmp/sv")
    assert s.smolvm.data_dir == "/tmp/sv" and "/tmp/sv" in s.protected_paths
    assert _settings(tmp_path).smolvm.data_dir == str(tmp_path / "s" / "smolvm")


def test_smolvm_data_dir_limit_is_61_bytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """61 bytes is accepted and 62 refused, on paths that do not depend on the temp root
    (issue 30: on a fresh host pytest's own path was exactly 61 bytes)."""
    at_limit, over = "/" + "d" * 60, "/" + "d" * 61
    assert _settings(tmp_path, "--smolvm-data-dir", at_limit).smolvm.data_dir == at_limit
    assert _error(tmp_path, "--smolvm-data-dir", over).startswith(
        f"--smolvm-data-dir {over}: too long (62 bytes, at most 61)"
    )


def test_allowed_uids_and_skip_probe(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--allow-uid`` adds to the daemon's own uid; the unsafe flag reaches the settings."""
    s = _settings(tmp_path, "--allow-uid", "4242", "--unsafe-skip-isolation-probe")
    assert s.allowed_uids == {os.geteuid(), 4242} and s.skip_probe


def test_node_options(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--label (repeatable, checked, one line each), --allow-uid UID:scoped, --lease-grace."""
    s = _settings(tmp_path, "--label", "zone=eu-1", "--label", "kvm=", "--lease-grace", "5")
    assert (s.labels, s.lease_grace, s.scoped_uids) == ((("kvm", ""), ("zone", "eu-1")), 5.0, set())
    s = _settings(tmp_path, "--allow-uid", "4243:scoped", "--allow-uid", "4244")
    assert s.scoped_uids == {4243} and 4244 in s.allowed_uids and 4243 not in s.allowed_uids
    for bad, message in (
        (["--label", "Zone=a"], "--label: label key 'Zone': 1-63 of a-z 0-9"),
        (["--label", "zone"], "--label: label 'zone': must be KEY=VALUE"),
        (["--label", "zone=a b"], "--label: label zone: value <3 bytes sha256:"),
        (["--allow-uid", "5:owner"], "--allow-uid: '5:owner': UID or UID:scoped"),
    ):
        got = _error(tmp_path, *bad)
        assert got.startswith(message) and "\n" not in got
    assert _error(tmp_path, "--label", "a=1", "--label", "a=2") == "--label: label a: given twice"
    own = str(os.geteuid())
    assert "given both scoped and with full control" in _error(
        tmp_path, "--allow-uid", f"{own}:scoped"
    )


def test_the_shipped_units_own_paths_are_protected(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue 40 N7: the shipped system unit's own options (``contrib/systemd``: ``--state-dir``,
    ``--control systemd:...``), with TLS files and a config file, the runtime directory systemd
    names and the socket it passes: each path the daemon reads or serves (the socket's
    directory from the inherited descriptor, the TLS directory, the config file's, the state
    dir, the daemon's own code and venv) is refused as a volume; a directory beside them is
    not. Stand-ins under a temporary directory for ``/var/lib``, ``/run`` and ``/etc``."""
    from twisted.python.systemd import ListenFDs

    from bottlenet import settings as settings_module
    from bottlenet.bottles.volumes import Requester, VolumeRules, resolve
    from bottlenet.control.endpoints import inherited_socket_path
    from bottlenet.errors import InvalidArgument
    from vmctl.spec import Volume

    unit = (Path(__file__).parent.parent / "contrib/systemd/system/bottlenet.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    argv = shlex.split(exec_start.removeprefix("ExecStart="))
    assert argv[1] == "bottlenet" and "systemd:domain=UNIX:name=control" in argv
    state, run, tls, conf = (
        tmp_path / n for n in ("var-lib-bottlenet", "run-bottlenet", "tls", "etc")
    )
    for d in (state, run, tls, conf):
        d.mkdir()
    # (--log-format is the runner's: twist parses it, not a bare Options)
    options_argv = [
        a.replace("/var/lib/bottlenet", str(state))
        for a in argv[2:]
        if not a.startswith("--log-format")
    ]
    for name in ("daemon.key", "daemon.pem", "launchers-ca.pem"):
        (tls / name).write_text("")
    config = conf / "bottlenet.toml"
    config.write_text("")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(run / "control"))
    sock.listen()
    passed = ListenFDs([sock.fileno()], ["control"])
    monkeypatch.setattr(
        settings_module, "inherited_socket_path", lambda d: inherited_socket_path(d, passed)
    )
    options = Options()
    options.parseOptions(
        [
            *options_argv,
            *("--control-tls-port", "7443", "--control-tls-interface", "10.0.0.5"),
            *("--control-tls-key", str(tls / "daemon.key"), "--control-tls-cert"),
            *(str(tls / "daemon.pem"), "--control-tls-ca", str(tls / "launchers-ca.pem")),
            *("--config", str(config)),
        ]
    )
    try:
        s = settings_from(options, {"PATH": os.environ.get("PATH", "")})
    finally:
        sock.close()
    rules = VolumeRules(s.protected_paths)
    code = Path(settings_module.__file__).parent
    refused = [state, run, tls, conf, code, Path(sys.prefix)]
    for host in refused:
        with pytest.raises(InvalidArgument, match="overlaps the daemon's own path"):
            resolve([Volume(str(host), "/x")], ["v"], Requester.daemon(), rules, reachable=False)
    beside = tmp_path / "work"
    beside.mkdir()
    resolve([Volume(str(beside), "/x")], ["v"], Requester.daemon(), rules, reachable=False).close()
