"""The daemon as a person runs it: `twist bottlenet` / `twistd -n bottlenet` in a subprocess,
and its start-up refusals (``bottlenet: error: ...``) built in process."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from typing import Any, cast

import pytest
from attrs import evolve
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import Logger, formatEvent, globalLogPublisher

from bottlenet.cli.main import _vm_uids_row
from bottlenet.control import commands as C
from bottlenet.control.blocking import BlockingControlClient
from bottlenet.control.codec import decode_answer, encode_request
from bottlenet.control.peercred import PeerCred
from bottlenet.paths import StateDirLock
from bottlenet.settings import Options, StartupError
from bottlenet.tap import BottlenetService, build_service
from tests.control.fakes import Conn
from tests.netio import OutputReader, roundtrip
from tests.vmctl.fakereactor import FakeProcessReactor
from vmctl.smolvm import SmolvmVersion, VmmSeen, VmUids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTENING = re.compile(rb"forward (\S+)/(\S+) listening on ([0-9.]+):([0-9]+)")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT
    env.pop("XDG_RUNTIME_DIR", None)  # the control socket goes into each test's state dir
    return env


def _write_config(tmp_path, body: str) -> str:  # type: ignore[no-untyped-def]
    path = tmp_path / "bn.toml"
    path.write_text(body)
    return str(path)


def _run_fail(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "twisted", "--log-format=text", "bottlenet", *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_bad_value_is_one_line_on_stderr_and_exit_status_1(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The contract every start-up check keeps (the in-process tests below show each check's
    text): under ``twist``, a bad value is exactly one line on stderr and exit status 1, not
    Twisted's usage error (status 64 and the whole help text), and no traceback."""
    out = _run_fail(["--state-dir", str(tmp_path / "s"), "--control-max-connections", "0"])
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "bottlenet: error: --control-max-connections: must be an integer 1-4096"
    ]
    assert "Traceback" not in out.stdout + out.stderr
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("runner", "args", "line"),
    [
        (["-m", "twisted"], ["--confg", "x"], "option --confg not recognized"),
        (
            ["-c", "from twisted.scripts.twistd import run; run()", "--pidfile="],
            ["--log-format=json"],
            "--log-format writes to stdout: run twistd with -n",
        ),
    ],
)
def test_usage_errors_are_one_line(tmp_path, runner: list[str], args: list[str], line: str) -> None:  # type: ignore[no-untyped-def]
    """Issue 30: a usage error is one line and status 1 under twist and twistd, not Twisted's
    77 lines of help and status 64 (each usage error's line: the in-process test below)."""
    out = subprocess.run(
        [sys.executable, *runner, "bottlenet", *args],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (out.returncode, out.stderr.splitlines()) == (
        1,
        [f"bottlenet: error: {line} (see --help)"],
    )
    assert out.stdout == ""


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--allow-uid", "abc"], "--allow-uid: 'abc' is not a uid"),
        (["--log-format", "yaml"], "--log-format must be one of: json, text"),
        (["--confg", "x"], "option --confg not recognized"),
    ],
)
def test_usage_error_is_its_one_line(tmp_path, args: list[str], line: str) -> None:  # type: ignore[no-untyped-def]
    """Issue 30: an unknown option or a bad ``--allow-uid``/``--log-format`` stops the plugin's
    option parsing with its one line (which twist prints, exit 1: the test above)."""
    assert _build_fails("--state-dir", str(tmp_path / "s"), *args) == (
        f"bottlenet: error: {line} (see --help)"
    )


def _taken_port(host: str) -> socket.socket:
    """A listening TCP socket on ``host``: the port a daemon option then finds taken."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, 0))
    s.listen()
    return s


def _one_line_once(out: subprocess.CompletedProcess[str], want: str) -> None:
    """A start-up failure as issue 30 has it: one line on stderr (containing ``want``), once,
    exit 1: not the same text three times, not an "Unhandled error in Deferred" traceback."""
    lines = out.stderr.splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith("bottlenet: error: ") and want in lines[0]
    assert "Traceback" not in out.stdout + out.stderr
    assert out.stdout.count("fatal: ") == 1


@pytest.mark.parametrize("kind", ["control-dir", "metrics-port"])
def test_listen_failure_at_start_is_one_line_once(tmp_path, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Issue 30: a listener that cannot listen at start is one line on stderr, once, exit 1
    (a config forward's: ``test_bind_failure_exits_nonzero_and_names_the_key``)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    args = ["--state-dir", str(tmp_path / "s"), "--control", f"unix:{run}/c.sock"]
    args += ["--smolvm", os.path.join(ROOT, "tests", "fakes", "smolvm")]
    with _taken_port("127.0.0.1") as taken:
        port = taken.getsockname()[1]
        if kind == "control-dir":
            run.chmod(0o755)
            want = f"control: cannot listen on unix:{run}/c.sock: {run} is mode 0755; "
        else:
            args += ["--metrics", f"tcp:{port}:interface=127.0.0.1"]
            want = f"metrics: cannot listen on 127.0.0.1:{port}: EADDRINUSE ("
        out = _run_fail(args)
    _one_line_once(out, want)
    # Nothing starts after the fatal line, and no start-up advice follows it (newcomer-3
    # trap 15): the metrics listener after the control socket, the smolvm lines.
    after = out.stdout.split("fatal: ", 1)[1]
    for later in ("metrics: listening on", "smolvm runs VMs", "using smolvm"):
        assert later not in after, after


def test_bind_failure_exits_nonzero_and_names_the_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A config forward whose port is taken (past one that did bind) stops the daemon with
    one line naming the file and the key, once, exit 1 (issue 30, as every listener)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    args = ["--state-dir", str(tmp_path / "s"), "--control", f"unix:{run}/c.sock"]
    with _taken_port("127.77.0.9") as taken:
        port = taken.getsockname()[1]
        config = _write_config(
            tmp_path,
            "[[bottle]]\nname = 'demo'\nalias = '127.77.0.9'\n"
            "[[bottle.forward]]\nlabel = 'a'\nport = 0\ntarget = '127.0.0.1:9'\n"
            f"[[bottle.forward]]\nlabel = 'b'\nport = {port}\ntarget = '127.0.0.1:9'\n",
        )
        out = _run_fail([*args, "--config", config])
    want = f"{config}: bottle[0].forward[1]: cannot listen on 127.77.0.9:{port}: EADDRINUSE ("
    _one_line_once(out, want)


def _build_fails(*args: str) -> str:
    """The one line ``twist bottlenet ARGS`` would end with, from building the daemon in
    process (options parsed, settings checked, the disk step run; nothing is composed)."""
    with pytest.raises(StartupError) as e:
        options = Options()
        options.parseOptions(list(args))
        build_service(options, MemoryReactorClock())
    assert isinstance(e.value.code, str)
    return e.value.code


@pytest.fixture(autouse=True)
def _no_runtime_dir(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """As in ``_env``: the default control socket goes into each test's state dir."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)


def test_bad_config_is_one_line_and_nonzero(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A config file with a bad key stops the daemon with one line naming file and key."""
    config = _write_config(tmp_path, "[[bottle]]\nname = 'demo'\nalias = '127.0.0.1'\n")
    line = _build_fails("--state-dir", str(tmp_path / "s"), "--config", config)
    assert line == (
        f"bottlenet: error: {config}: bottle[0].alias: alias 127.0.0.1 is not in the alias pool "
        "127.77.0.0/16"
    )


def test_bad_option_is_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A bad ``--alias-pool`` is one line naming the flag."""
    line = _build_fails("--state-dir", str(tmp_path / "s"), "--alias-pool", "0.0.0.0/0")
    assert "\n" not in line
    assert line.startswith("bottlenet: error: --alias-pool:")


@pytest.mark.parametrize("value", ["0", "4097", "many", "-1"])
def test_bad_control_cap_is_one_line(tmp_path, value: str) -> None:  # type: ignore[no-untyped-def]
    """``--control-max-connections`` out of 1-4096 is one line with the range."""
    line = _build_fails("--state-dir", str(tmp_path / "s"), "--control-max-connections", value)
    assert line == "bottlenet: error: --control-max-connections: must be an integer 1-4096"


def _bad_smolvm(tmp_path, kind: str) -> str:  # type: ignore[no-untyped-def]
    """A ``--smolvm`` value of the given kind of wrong."""
    if kind == "missing":
        return str(tmp_path / "smolvm-typo")
    if kind == "name":
        return "no-such-smolvm-anywhere"
    path = tmp_path / kind
    if kind == "not-executable":
        path.write_text("#!/bin/sh\necho smolvm 1.32.2\n")
        os.chmod(path, 0o644)
    else:  # not a smolvm: runs, exits 0, prints no smolvm version
        path.write_text("#!/bin/sh\necho 'GNU coreutils 9.1'\n")
        os.chmod(path, 0o755)
    return str(path)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("missing", "no such file"),
        ("name", "not found as an executable on the daemon's PATH (relative entries are ignored)"),
        ("not-executable", "not executable"),
        (
            "not-smolvm",
            "not a smolvm (`--version` printed no `smolvm X.Y.Z`: 'GNU coreutils 9.1')",
        ),
    ],
)
def test_bad_smolvm_stops_the_daemon_before_anything_is_bound(  # type: ignore[no-untyped-def]
    tmp_path, kind: str, reason: str
) -> None:
    """Issue 19: a wrong ``--smolvm`` is one line naming the path given, exit 1, no socket."""
    given = _bad_smolvm(tmp_path, kind)
    control = tmp_path / "run" / "c.sock"
    metrics = tmp_path / "run" / "m.sock"
    line = _build_fails(
        "--state-dir", str(tmp_path / "s"), "--control", f"unix:{control}",
        "--metrics", f"unix:{metrics}", "--smolvm", given,
    )  # fmt: skip
    assert line == f"bottlenet: error: --smolvm {given}: {reason}"
    assert not control.exists() and not metrics.exists()


def test_long_smolvm_data_dir_stops_the_daemon(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 19: a ``--smolvm-data-dir`` over smolvm's 61 bytes fails start-up, not a create."""
    # over the limit whatever pytest's temp root is, and under the 120 bytes a message shows
    data_dir = str(tmp_path / ("d" * max(1, 62 - len(os.fsencode(str(tmp_path))))))
    size = len(os.fsencode(data_dir))
    control = tmp_path / "run" / "c.sock"
    line = _build_fails(
        "--state-dir", str(tmp_path / "s"), "--control", f"unix:{control}",
        "--smolvm-data-dir", data_dir,
    )  # fmt: skip
    assert line == (
        f"bottlenet: error: --smolvm-data-dir {data_dir}: too long ({size} bytes, at most 61): "
        "smolvm binds per-machine UNIX sockets below it"
    )
    assert not control.exists() and not os.path.exists(data_dir)


def test_bad_control_is_one_line_before_anything_binds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A --control that is neither unix:PATH, an absolute PATH nor systemd: stops the daemon
    with one line before the metrics socket is bound (none is left or logged)."""
    state = tmp_path / "s"
    events: list[dict[str, object]] = []
    globalLogPublisher.addObserver(events.append)
    try:
        line = _build_fails("--state-dir", str(state), "--control", "relative/c.sock")
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert line == (
        "bottlenet: error: --control must be unix:PATH, an absolute PATH or"
        " systemd:domain=UNIX:name=N, not 'relative/c.sock': use the TLS options for remote"
        " control"
    )
    assert not any("metrics" in (formatEvent(e) or "") for e in events)
    assert not (state / "metrics.sock").exists()


def _start(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


def _wait_listening(proc: subprocess.Popen[bytes], timeout: float = 90) -> tuple[str, int]:
    assert proc.stdout is not None
    try:
        m = OutputReader(proc.stdout.fileno()).wait_for(LISTENING, timeout)
    except AssertionError:
        proc.kill()
        raise
    return m.group(3).decode(), int(m.group(4))


REACTOR = re.compile(rb"relay engine (\S+), reactor (\w+)")


def _forward_config(tmp_path, echo_server: int) -> str:  # type: ignore[no-untyped-def]
    """A config with one bottle whose one forward (port 0) relays to ``echo_server``."""
    return _write_config(
        tmp_path,
        "[[bottle]]\nname = 'demo'\nalias = '127.77.0.2'\n"
        f"[[bottle.forward]]\nlabel = 'web'\nport = 0\ntarget = '127.0.0.1:{echo_server}'\n",
    )


def _serves_its_forward(
    proc: subprocess.Popen[bytes], reactor: str
) -> tuple[OutputReader, str, int]:
    """The daemon ``proc`` (of ``_forward_config``) says it relays with splice on ``reactor``,
    and its forward relays 300 KB both ways: its output so far, the forward's host and port."""
    assert proc.stdout is not None
    reader = OutputReader(proc.stdout.fileno())
    try:
        started = reader.wait_for(REACTOR, 90)
        m = reader.wait_for(LISTENING, 90)
    except AssertionError:
        proc.kill()
        raise
    assert started.groups() == (b"splice", reactor.encode())
    host, port = m.group(3).decode(), int(m.group(4))
    assert host == "127.77.0.2" and port != 0
    payload = os.urandom(300_000)
    assert roundtrip(host, port, payload) == payload
    return reader, host, port


def _nothing_listens(host: str, port: int) -> None:
    """After a clean stop nothing listens on the forward any more."""
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, port), timeout=5).close()


@pytest.mark.parametrize(
    ("runner", "reactor"),
    [
        # Started as the units do, the daemon runs on the fast reactor and the splice engine
        # without any flag; --reactor still chooses another reactor. Started the README's way
        # (twist): the first daemon of test_second_daemon_on_the_state_dir_exits_before_...
        ("twistd", "QuietEPollReactor"),
        ("twist --reactor epoll", "EPollReactor"),
    ],
)
def test_daemon_serves_the_configured_forward(
    tmp_path, echo_server: int, runner: str, reactor: str
) -> None:  # type: ignore[no-untyped-def]
    """The daemon under ``runner`` serves its configured forward; stopped, it frees it."""
    args = ["bottlenet", "--state-dir", str(tmp_path / "s")]
    args += ["--config", _forward_config(tmp_path, echo_server)]
    if runner == "twistd":
        twistd = os.path.join(os.path.dirname(sys.executable), "twistd")
        cmd = [twistd, "-n", "--pidfile=", "--logfile=-", *args]
    else:
        cmd = [sys.executable, "-m", "twisted", *runner.split()[1:], "--log-format=text", *args]
    proc = _start(cmd)
    try:
        _, host, port = _serves_its_forward(proc, reactor)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    _nothing_listens(host, port)


def test_second_daemon_on_the_state_dir_exits_before_touching_it(
    tmp_path, echo_server: int
) -> None:  # type: ignore[no-untyped-def]
    """Issue 13 item 2: the state-dir lock is taken before anything is read or changed.

    The second daemon has its own control socket (so the control lock cannot stop it); it
    must exit 1 naming the first one's pid, and leave ``state.json`` byte for byte as it was.
    The first one is started the README's way (``twist``, no flag): it runs on the fast
    reactor and the splice engine, serves its forward, and once stopped frees it (what
    ``test_daemon_serves_the_configured_forward`` checks of twistd and ``--reactor``).
    """
    state = tmp_path / "s"
    first = _start(
        [
            sys.executable,
            "-m",
            "twisted",
            "--log-format=text",
            "bottlenet",
            "--state-dir",
            str(state),
            "--config",
            _forward_config(tmp_path, echo_server),
        ]
    )
    try:
        reader, host, port = _serves_its_forward(first, "QuietEPollReactor")
        # Recovery's final save (a new snapshot) may land after the listener: wait for it.
        if b"recovery done" not in reader.seen:
            reader.wait_for(rb"recovery done", 90)
        journal = state / "state.journal"
        before = (state / "state.json").read_bytes()
        before_journal = journal.read_bytes() if journal.exists() else None
        out = _run_fail(
            ["--state-dir", str(state), "--control", f"unix:{tmp_path / 'c2' / 'c.sock'}"]
        )
        assert out.returncode == 1
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert lines[0].startswith("bottlenet: error: --state-dir: another bottlenet daemon")
        assert f"(pid {first.pid})" in lines[0]
        assert (state / "state.json").read_bytes() == before
        assert (journal.read_bytes() if journal.exists() else None) == before_journal
        assert not (tmp_path / "c2").exists()  # it stopped before making anything
        payload = os.urandom(1000)
        assert roundtrip(host, port, payload) == payload  # the first one is untouched
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)
    _nothing_listens(host, port)


def test_shared_state_dir_is_refused_never_chmodded(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 13 item 8: ``--state-dir`` naming a 1777 directory is refused and left as it was."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "other-users-file").write_text("")
    line = _build_fails(
        "--state-dir", str(shared), "--control", f"unix:{tmp_path / 'c' / 'c.sock'}"
    )
    assert line == (
        f"bottlenet: error: --state-dir: {shared} is mode 1777; it must be a 0700 directory "
        "of this user's (0701 too: smolvm adds o+x when it starts a VM as root; a new path is "
        "created 0700)"
    )
    assert os.stat(shared).st_mode & 0o7777 == 0o1777
    assert sorted(os.listdir(shared)) == ["other-users-file"]


@pytest.mark.parametrize(
    ("interface", "why"),
    [
        ("0.0.0.0", "a wildcard listens on every address"),
        ("::", "a wildcard listens on every address"),
        ("127.77.0.5", "is inside the alias pool 127.77.0.0/16"),
        ("::ffff:127.77.0.5", "is inside the alias pool 127.77.0.0/16"),
        ("localhost", "must be one IP address"),
    ],
)
def test_tls_interface_is_never_a_wildcard_or_in_the_pool(
    tmp_path, interface: str, why: str
) -> None:  # type: ignore[no-untyped-def]
    """Issue 13 item 9 (TLS): refused at start, before anything is bound."""
    pem = tmp_path / "x.pem"
    pem.write_text("")
    tls = ["--control-tls-port", "9443", "--control-tls-interface", interface]
    for n in ("key", "cert", "ca"):
        tls += [f"--control-tls-{n}", str(pem)]
    line = _build_fails("--state-dir", str(tmp_path / "s"), *tls)
    assert "\n" not in line
    assert line.startswith("bottlenet: error: --control-tls-interface:") and why in line


def test_changed_alias_pool_refuses_to_start_and_keeps_every_bottle(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 13 item 9: recovery would tear down (or drop) every bottle outside the new pool."""
    import json

    from bottlenet.bottles.store import SCHEMA_VERSION

    state = tmp_path / "s"
    state.mkdir(mode=0o700)
    doc = {
        "schema": SCHEMA_VERSION,
        "instance_id": "0123456789abcdef",
        "bottles": {
            "kept": {"kind": "forward", "alias": "127.77.0.9", "created_at": 1.0, "forwards": []}
        },
    }
    (state / "state.json").write_text(json.dumps(doc))
    os.chmod(state / "state.json", 0o600)
    before = (state / "state.json").read_bytes()
    line = _build_fails("--state-dir", str(state), "--alias-pool", "127.88.0.0/16")
    assert line.startswith("bottlenet: error: --alias-pool 127.88.0.0/16: persisted bottle(s)")
    assert "'kept' ('127.77.0.9')" in line
    assert (state / "state.json").read_bytes() == before
    # The lock was let go: the next start may take it.
    StateDirLock(str(state)).acquire()


def test_compose_parents_in_the_documented_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``build_service`` in process, every optional child on: the children are in the order
    docs/architecture.md gives (start in this order, stop in reverse); nothing starts."""
    config = _write_config(tmp_path, "[[bottle]]\nname = 'demo'\nalias = '127.77.0.9'\n")
    pem = tmp_path / "x.pem"
    pem.write_text("")
    options = Options()
    options.parseOptions(
        ["--state-dir", str(tmp_path / "s"), "--config", config,
         "--control", f"unix:{tmp_path / 'c.sock'}", "--metrics", "tcp:0:interface=127.0.0.1",
         "--control-tls-port", "9443", "--control-tls-interface", "127.0.0.1",
         "--control-tls-key", str(pem), "--control-tls-cert", str(pem),
         "--control-tls-ca", str(pem)]
    )  # fmt: skip
    root = build_service(options, MemoryReactorClock())
    try:
        assert [type(child).__name__ for child in root] == [
            "VmctlService", "KitKeeper", "ForwardTable", "ConfigBottles", "RecoveryService",
            "EgressWatch", "ListeningService", "ListeningService", "ListeningService",
            "SystemdNotifier",
        ]  # fmt: skip
        assert root.getServiceNamed("forwards") is root.table
        assert not root.running and len(root.control_factories) == 2
    finally:
        assert root.state_lock is not None
        root.state_lock.release()


class _BrokenSmolvm:
    """A smolvm whose version call fails with something that is not smolvm's own error."""

    async def version(self) -> None:
        raise RuntimeError("probe exploded")


def test_a_failed_smolvm_probe_is_logged_not_dropped() -> None:
    """The root's smolvm version probe: a failure other than smolvm's own is logged with its
    traceback (architecture-2.md 5.5), never left as an unhandled Deferred."""
    parts: Any = None  # the probe touches neither table, registry nor control factory
    smolvm: Any = _BrokenSmolvm()
    root = BottlenetService(
        MemoryReactorClock(), parts, parts, smolvm, parts, "/", vm_uids=VmUids.ONE
    )
    events: list[dict[str, Any]] = []
    root.log = Logger(observer=events.append)
    done: list[object] = []
    root.probe_smolvm().addBoth(done.append)
    assert done == [None]
    (event,) = events
    assert event["log_format"] == "the smolvm version probe failed"
    assert event["log_failure"].check(RuntimeError)


class _ProcessReactor(MemoryReactorClock, FakeProcessReactor):
    """Memory sockets and a clock; processes recorded, never finished."""

    def __init__(self) -> None:
        MemoryReactorClock.__init__(self)
        FakeProcessReactor.__init__(self)


class _SlowSmolvm:
    """A smolvm whose version probe answers only when the test says (``answer``)."""

    binary = "/opt/smolvm"
    data_dir_root: str | None = None
    vmm_seen: VmmSeen | None = None

    def __init__(self) -> None:
        self.pending: Deferred[SmolvmVersion] = Deferred()

    def describe(self) -> str:
        return "/opt/smolvm (from --smolvm)"

    def version(self) -> Deferred[SmolvmVersion]:
        return self.pending


def test_first_hello_waits_for_the_smolvm_probe(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 30: a Hello that comes before the daemon's smolvm probe has settled (the first
    call under socket activation) waits for it and reports smolvm, not ``unavailable``."""
    options = Options()
    options.parseOptions(
        ["--state-dir", str(tmp_path / "s"), "--control", f"unix:{tmp_path / 'c.sock'}"]
    )
    root = build_service(options, _ProcessReactor())  # recovery's smolvm ls stays pending
    slow = _SlowSmolvm()
    root.smolvm = cast(Any, slow)
    factory = root.control_factory
    me = PeerCred(uid=os.geteuid(), pid=1)
    factory.admission = evolve(factory.admission, peer_credentials=lambda sock: me)
    root.startService()
    try:
        conn = Conn(factory)
        conn.send(encode_request(C.Hello, b"1", {"client_version": "t", "protocols": [1]}))
        assert conn.boxes() == []  # no answer while the probe runs
        slow.pending.callback(SmolvmVersion(1, 32, 2))
        (box,) = conn.boxes()
        answer = decode_answer(C.Hello, box)
        assert (answer["smolvm_available"], answer["smolvm_version"]) == (True, "1.32.2")
        later = Conn(factory).call(C.Hello, client_version="t", protocols=[1])
        assert later["smolvm_version"] == "1.32.2"  # settled: answered at once
    finally:
        root.stopService()


def test_vm_uids_row_says_what_was_seen(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 30: Hello's ``vm_uids_basis`` says what the last VM start showed (the VMM's uid
    against the daemon's), else that nothing was seen; ``vm_uids`` stays the model the
    daemon's uid implies, and the status row prints both (a root daemon whose smolvm dropped
    no uid: ``per-VM uids (seen: ... ran as uid 0: one uid in fact)``)."""
    options = Options()
    options.parseOptions(["--state-dir", str(tmp_path / "s"), "--control", f"unix:{tmp_path}/c"])
    root = build_service(options, _ProcessReactor())
    slow = _SlowSmolvm()
    slow.pending.callback(SmolvmVersion(1, 32, 2))
    root.smolvm = cast(Any, slow)
    factory = root.control_factory
    me = PeerCred(uid=os.geteuid(), pid=1)
    factory.admission = evolve(factory.admission, peer_credentials=lambda sock: me)
    root.startService()
    euid = os.geteuid()
    expected = "per-VM uids" if euid == 0 else "one uid"
    try:
        hello = Conn(factory).call(C.Hello, client_version="t", protocols=[1])
        who = "root" if euid == 0 else f"uid {euid}"
        assert (hello["vm_uids"], hello["vm_uids_basis"]) == (
            expected,
            f"expected: the daemon runs as {who}; no VM start seen yet",
        )
        slow.vmm_seen = VmmSeen("bn-a-sidecar", euid)  # the VMM ran as the daemon's uid
        hello = Conn(factory).call(C.Hello, client_version="t", protocols=[1])
        basis = f"seen: bn-a-sidecar's VM process ran as uid {euid}"
        if euid == 0:
            basis += ": one uid in fact"
        assert (hello["vm_uids"], hello["vm_uids_basis"]) == (expected, basis)
        slow.vmm_seen = VmmSeen("bn-a-agent", euid + 2_000_001)
        hello = Conn(factory).call(C.Hello, client_version="t", protocols=[1])
        assert _vm_uids_row(hello["vm_uids"], hello["vm_uids_basis"]) == (
            f"{expected} (seen: bn-a-agent's VM process ran as uid {euid + 2_000_001}"
            + ("" if euid == 0 else ": per-VM uids in fact")
            + ")"
        )
    finally:
        root.stopService()


@pytest.mark.skipif(os.geteuid() != 0, reason="smolvm uses per-VM uids only as root")
def test_root_daemon_says_which_parents_smolvm_opens(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 30: as root, the start log names the parents of smolvm's data dir that its first
    VM start will make ``o+x`` (they may lie outside the state dir), and changes none."""
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    options = Options()
    options.parseOptions(["--state-dir", str(tmp_path / "s"), "--control", f"unix:{tmp_path}/c"])
    root = build_service(options, _ProcessReactor())
    slow = _SlowSmolvm()
    slow.data_dir_root = str(closed / "d" / "smolvm")  # not made yet: its parents are read
    root.smolvm = cast(Any, slow)
    events: list[dict[str, Any]] = []
    root.log = Logger(observer=events.append)
    root.startService()
    try:
        said = [formatEvent(e) for e in events if "adds o+x" in e["log_format"]]
        assert len(said) == 1 and f"adds o+x to {closed}" in said[0], said
        assert os.stat(closed).st_mode & 0o777 == 0o700
    finally:
        root.stopService()


def test_clean_relay_ends_are_logged_only_at_twist_debug_level() -> None:
    from twisted.logger import LogLevel

    from bottlenet.settings import logs_relay_ends

    assert logs_relay_ends({"fileLogObserverFactory": None, "logLevel": LogLevel.debug})
    assert not logs_relay_ends({"fileLogObserverFactory": None, "logLevel": LogLevel.info})
    assert not logs_relay_ends({"logger": None, "nodaemon": True})  # twistd
    assert not logs_relay_ends(None)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_sigint_stops_a_daemon_started_with_sigint_ignored(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``twist bottlenet`` started with SIGINT ignored (a script's ``&``) still stops on it."""
    from tests.control.daemon_helpers import daemon_argv, wait_ready

    control = str(tmp_path / "run" / "control.sock")
    proc = subprocess.Popen(
        daemon_argv(str(tmp_path / "s"), f"unix:{control}"),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=_ignore_sigint,
    )
    try:
        wait_ready(control, proc)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, -signal.SIGINT), out.decode(errors="replace")
    assert b"Received SIGINT" in out


def _run_until_ready(args: list[str], then: Any = None) -> str:
    """The text log of ``twist bottlenet ARGS`` from start until stopped once ready (after
    ``then()``, if given)."""
    proc = _start([sys.executable, "-m", "twisted", "--log-format=text", "bottlenet", *args])
    assert proc.stdout is not None
    reader = OutputReader(proc.stdout.fileno())
    try:
        reader.wait_for(rb"ready: .*\n", 90)
        if then is not None:
            then()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    return (reader.seen + proc.stdout.read()).decode(errors="replace")


def test_start_and_stop_log_is_plain(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The start and stop log of the README's demo: no Twisted class names (``_Forward
    starting on``, ``_QuietSite (CappedFactory)``, ``Port N Closed``), no ``N -> N`` no-op,
    and counts with their plurals right; after a restart the ready line counts the restored
    bottle too (issue 30: it said ``0 configured bottles`` after ``1 bottle(s) restored``)."""
    config = _write_config(
        tmp_path,
        "[[bottle]]\nname = 'demo'\nalias = '127.77.0.3'\n"
        "[[bottle.forward]]\nlabel = 'web'\nport = 0\ntarget = '127.0.0.1:9'\n",
    )
    control = str(tmp_path / "s" / "control.sock")
    args = ["--state-dir", str(tmp_path / "s"), "--config", config, "--max-connections", "9"]

    def create() -> None:
        with BlockingControlClient(control, timeout=30) as c:
            c.create_bottle("extra")

    log = _run_until_ready(args, create)
    assert "forward demo/web listening on 127.77.0.3:" in log
    assert "ready: 1 bottle (1 configured, 0 restored)\n" in log
    assert re.search(
        r"relays: \w+ engine, at most 9 connections in all \(--max-connections\), 4096 per "
        r"bottle \(capped by the total\), idle timeout 900s",
        log,
    ), log
    for noise in ("starting on", "Port", "CappedFactory", "_Forward", "_QuietSite"):
        assert noise not in log, log
    assert not re.search(r"\b(\d+) -> \1\b", log), log
    again = _run_until_ready(args)
    assert "recovery done: 1 bottle(s) restored" in again
    assert "ready: 2 bottles (1 configured, 1 restored)\n" in again
