"""The documentation's commands work: docs/quickstart.md is run against a real daemon.

Blocks preceded by ``<!-- test -->`` run in order in one ``bash -euo pipefail`` (so an
``export`` or a background job carries over); the ``<!-- test: daemon -->`` block is started
first, in the background, and stopped at the end. The VM section works the same way with
``<!-- test: vm-daemon -->`` and ``<!-- test: vm -->`` (run from the checkout, against the fake
smolvm, as root only; every process the fake started is killed afterwards and none may
survive). ``/tmp/bn-quick`` and the two ports are replaced by a fresh directory and free ports.
Separately, every ``bottlenetctl`` and ``twist bottlenet`` line in the docs must parse with the
program's own option parser.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bottlenet.cli.main import build_parser
from tests import netguard
from tests.fakes import UID_LEDGER, FakeSmolvm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "docs", "quickstart.md")
BLOCK = re.compile(r"(?:<!-- (test(?:: [\w-]+)?) -->\n)?```sh\n(.*?)```", re.S)


def shell_blocks(path: str) -> list[tuple[str | None, str]]:
    """(marker or None, body) of every ```sh block."""
    with open(path) as f:
        return [(m.group(1), m.group(2)) for m in BLOCK.finditer(f.read())]


def _free_port(host: str) -> int:
    with socket.create_server((host, 0)) as s:
        port: int = s.getsockname()[1]
        return port


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for name in (
        "BOTTLENET_CONTROL",
        "XDG_RUNTIME_DIR",
        "LISTEN_FDS",
        "LISTEN_PID",
        "NOTIFY_SOCKET",
    ):
        env.pop(name, None)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = ROOT
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def _wait_ready(notify: socket.socket, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until the daemon sends ``READY=1`` to ``$NOTIFY_SOCKET`` (its control socket is up).

    Fails at once if the daemon exits first, or after a minute without it.
    """
    deadline = time.monotonic() + 60
    notify.settimeout(0.5)  # only how often the daemon's exit is checked for
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"the daemon never said READY=1:\n{log.read_text()}"
        try:
            datagram = notify.recv(4096)
        except TimeoutError:
            continue
        if b"READY=1" in datagram.split(b"\n"):
            return


def _run_against_daemon(
    tmp_path: Path, daemon_block: str, steps: list[str], cwd: str
) -> tuple[int, str, str]:
    """Start ``daemon_block`` in the background, run ``steps`` in one bash once the daemon is
    ready (its systemd readiness message), stop the daemon.

    Returns (exit status, stdout, stderr) of the steps; the daemon's log has no traceback.
    """
    env = _env()
    log_path = tmp_path / "daemon.log"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    log = open(log_path, "wb")  # closed in the finally below
    proc = subprocess.Popen(
        ["bash", "-euc", daemon_block],
        env={**env, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")},
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    script: subprocess.Popen[bytes] | None = None
    out = err = ""
    try:
        _wait_ready(notify, proc, log_path)
        script = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", "\n".join(steps)],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        out_b, err_b = script.communicate(timeout=120)
        out, err = out_b.decode(), err_b.decode()
    finally:
        if script is not None:
            _kill_group(script)
        _kill_group(proc)
        log.close()
        notify.close()
    assert "Traceback" not in log_path.read_text()
    assert script.returncode is not None
    return script.returncode, out, err


def test_quickstart_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    blocks = shell_blocks(QUICKSTART)
    daemon = [body for marker, body in blocks if marker == "test: daemon"]
    steps = [body for marker, body in blocks if marker == "test"]
    assert len(daemon) == 1 and len(steps) >= 5

    base = str(tmp_path / "bn-quick")
    web, agent = _free_port("127.0.0.1"), _free_port("127.77.0.1")

    def fill(text: str) -> str:
        text = text.replace("/tmp/bn-quick", base)
        return re.sub(r"\b8090\b", str(web), re.sub(r"\b8078\b", str(agent), text))

    code, out, err = _run_against_daemon(
        tmp_path, fill(daemon[0]), [fill(s) for s in steps], str(tmp_path)
    )
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    # The outputs the quickstart promises in its comments.
    assert "created demo on 127.77.0.1\n" in out
    assert f"127.77.0.1:{agent}\n" in out
    assert "hello through bottlenet\n" in out
    assert "destroyed demo\n" in out and "no bottles\n" in out
    assert "Traceback" not in err


def _netns_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--net", "--mount", "true"], check=False).returncode == 0


@pytest.mark.skipif(not _netns_works(), reason="the fake's exec-netns stand-in needs root")
@pytest.mark.skipif(not netguard.active(), reason="the gate with the fake needs the netguard")
def test_quickstart_vm_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Section 5 against a real daemon and the fake smolvm (a test double); nothing survives."""
    blocks = shell_blocks(QUICKSTART)
    daemon = [body for marker, body in blocks if marker == "test: vm-daemon"]
    steps = [body for marker, body in blocks if marker == "test: vm"]
    assert len(daemon) == 1 and len(steps) >= 6

    # short: smolvm binds sockets below its state dir (vmctl.smolvm.MAX_STATE_DIR)
    base = tempfile.mkdtemp(prefix="bnq-", dir="/tmp")
    spec = tmp_path / "bottle-socket.toml"
    with open(os.path.join(ROOT, "examples", "bottle-socket.toml")) as f:
        spec.write_text(f.read().replace("/tmp/bn-quick", base))

    def fill(text: str) -> str:
        text = text.replace("/tmp/bn-quick", base)
        # The fake runs the gate's probe on the host: its outside and DNS checks go to
        # stand-ins in the suite's own namespace (tests/netguard.py), never off the machine.
        # As root its VMs' uids come from the suite's uid ledger, never the host's own.
        own = [*netguard.GATE_STAND_INS, "--uid-ledger", UID_LEDGER]
        text = text.replace("twist bottlenet ", "twist bottlenet " + " ".join(own) + " ")
        return text.replace("examples/bottle-socket.toml", str(spec))

    fake = FakeSmolvm(os.path.join(base, "smolvm"))
    try:
        code, out, err = _run_against_daemon(
            tmp_path, fill(daemon[0]), [fill(s) for s in steps], ROOT
        )
        machines = fake.state()["machines"]
        live = fake.live_pids()
    finally:
        survivors = fake.cleanup()
        shutil.rmtree(base, ignore_errors=True)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert not survivors and not live and machines == {}
    # The outputs the quickstart promises in its comments.
    assert "error: ISOLATION_FAILED: isolation probe failed in bn-agent1-agent" in err
    assert "bottle torn down" in err and "refused\n" in out
    assert "launch gate: isolation probe PASS" in out
    assert "hello through a VM bottle\n" in out
    assert "running (3128, 9418)" in out  # bottlenet's bridge, in the status table
    assert "hello through the bridge\n" in out  # a guest TCP client through it
    assert "agent1: egress allows 2 host(s)\n" in out and "pypi.org\n*.github.com\n" in out
    assert "agent1: isolation probe PASS\n" in out
    assert "destroyed agent1\n" in out and "No machines found\n" in out
    assert "Traceback" not in err


SHELL_OPERATORS = ("||", "&&", "|", ";", ">", "2>&1")
DOCS = sorted(n for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))


@pytest.mark.parametrize("doc", DOCS)
def test_every_bottlenetctl_line_parses(doc: str) -> None:
    parser = build_parser()
    path = os.path.join(ROOT, "docs", doc)
    if not os.path.exists(path):
        pytest.skip(f"{doc} does not exist")
    lines = [
        line.split("#", 1)[0].strip()
        for _, body in shell_blocks(path)
        for line in body.splitlines()
        if line.strip().startswith("bottlenetctl ")
    ]
    with open(path) as f:
        text = f.read()
    lines += re.findall(r"`(bottlenetctl [^`]*)`", text)
    for line in lines:
        argv = shlex.split(line)[1:]
        if not argv or any(a.isupper() or "..." in a or a.startswith(("[", "<")) for a in argv):
            continue  # a synopsis (COMMAND, ...), not a command
        if any(a in SHELL_OPERATORS for a in argv):
            argv = argv[: min(argv.index(a) for a in argv if a in SHELL_OPERATORS)]
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            raise AssertionError(f"{doc}: {line!r} is not a valid bottlenetctl command") from e


@pytest.mark.parametrize("doc", DOCS)
def test_every_daemon_command_line_parses(doc: str) -> None:
    """``twist bottlenet OPTIONS`` in a shell block names only options the daemon has."""
    from bottlenet.tap import Options

    with open(os.path.join(ROOT, "docs", doc)) as f:
        text = f.read()
    lines = [  # also behind a wrapper (setpriv, systemd-socket-activate, a venv's path)
        line.split("#", 1)[0].strip()
        for _, body in shell_blocks(os.path.join(ROOT, "docs", doc))
        for line in body.replace("\\\n", " ").splitlines()  # a continued line is one
        if re.match(r"(\S*/)?twist bottlenet", line.strip())
        or " twist bottlenet" in line
        or "/twist bottlenet" in line
    ]
    lines += re.findall(r"`(twist bottlenet [^`]*)`", text)
    for line in lines:
        words = shlex.split(line)
        at = next(
            i
            for i, w in enumerate(words)
            if w.endswith("twist") and words[i + 1 :][:1] == ["bottlenet"]
        )
        argv = words[at + 2 :]
        if any(a in SHELL_OPERATORS for a in argv):  # "twist bottlenet ... && ..." or "| ..."
            argv = argv[: min(argv.index(a) for a in argv if a in SHELL_OPERATORS)]
        if any(a.isupper() or "..." in a for a in argv):
            continue  # a synopsis
        argv = [a for a in argv if not a.startswith("--log-format")]  # acts on twist itself
        try:
            Options().parseOptions(argv)
        except Exception as e:
            raise AssertionError(f"{doc}: {line!r}: {e}") from e


def test_security_doc_names_real_tests() -> None:
    """Every ``tests/...py::name`` (and following ``::name`` / ``Class.method``) exists."""
    with open(os.path.join(ROOT, "docs", "security.md")) as f:
        text = f.read()
    current: str | None = None
    checked = 0
    for m in re.finditer(r"`([^`]+)`", text):
        span = m.group(1)
        file_part, _, name = span.partition("::")
        if file_part.startswith("tests/") and file_part.endswith(".py"):
            current = file_part
            assert os.path.exists(os.path.join(ROOT, current)), span
        elif span.startswith("::") or re.fullmatch(r"[A-Z]\w+\.test_\w+", span):
            name = span.lstrip(":")
        else:
            continue
        if not name or current is None:
            continue
        with open(os.path.join(ROOT, current)) as f:
            source = f.read()
        for part in name.split("."):
            assert re.search(rf"(def|class) {re.escape(part)}\b", source), f"{current}::{name}"
        checked += 1
    assert checked > 30


# Fixed parts of the messages docs/operations.md quotes in its troubleshooting section.
QUOTED = [
    "is not in the alias pool",
    "cannot listen on",
    "EADDRINUSE",
    "another bottlenet daemon holds",
    "not taking over",
    "another daemon is answering on",
    "is a symlink; refusing to use or remove it",
    "exists and is not a socket; refusing to remove it",
    "0700 directory of its own",
    "cannot reach the bottlenet daemon at",
    "hint: is the bottlenet daemon running? its control socket is expected at",
    "the daemon closed the connection",
    "closed the connection before answering",
    "hint: the daemon refused this connection: it accepts only its own uid and the",
    "control: refused peer uid=",
    "similar suppressed",
    "no smolvm binary found; VM calls will fail (SMOLVM_UNAVAILABLE)",
    "smolvm is unusable: ",
    "is too old: vmctl needs smolvm",
    "the daemon holds its maximum of",
    "is exhausted",
    "refused a connection: ",
    "the bottle's connection budget is used up",
    "one daemon per state directory",
    "connections are open",
    "accept paused: ",
    "retrying with backoff",
    "open files limit ",
    "no isolation mode can be enforced: ",
    "isolation probe failed in ",
    "; bottle torn down",
    "sidecar VM process exited",
    "teardown incomplete: ",
    "recovery done: ",
    "deleting orphan machine",
]


def test_troubleshooting_quotes_real_messages() -> None:
    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        doc = f.read().replace("\n   ", " ").replace("\n    ", " ")
    sources = ""
    for top in ("bottlenet", "vmctl"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name)) as f:
                        sources += f.read()
    for fragment in QUOTED:
        assert fragment in doc, f"operations.md does not quote {fragment!r}"
        assert fragment in sources, f"no code writes {fragment!r} any more"


def test_readme_options_table_names_every_daemon_option() -> None:
    from bottlenet.tap import Options

    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    table = readme[readme.index("## Options") : readme.index("## Control")]
    o = Options()
    for name in sorted(_daemon_options() - {"help"}):
        assert f"`--{name}" in table, f"README options table lacks --{name}"
    for name, _, default, *_ in o.optParameters:
        if default is not None:
            assert f"`{default}`" in table, f"README: --{name} default {default!r} missing"


def _daemon_options() -> set[str]:
    """Every long option ``twist bottlenet`` takes (its parameters, flags and ``opt_``
    methods: ``--label``, ``--allow-uid``), as its own parser gathers them."""
    from bottlenet.tap import Options

    return {name.rstrip("=") for name in Options().longOpt}


def _ports(text: str) -> set[str]:
    return set(re.findall(r"(?:127\.[0-9.]+|localhost):([0-9]+)", text))


def test_readme_demo_and_quickstart_use_different_ports() -> None:
    """The README's demo and the quickstart share no port (the quickstart runs with the demo
    still up), and the README says how to stop what its demo started."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    demo = readme.split("## What it is")[0]
    with open(QUICKSTART) as f:
        quick = f.read()
    assert _ports(demo) and _ports(quick)
    assert _ports(demo) & _ports(quick) == set()
    assert "kill %1" in demo and "Stop the daemon with Ctrl-C" in demo


def test_readme_says_the_real_vm_tier_needs_its_kit() -> None:
    """The README names the build step without which the real-VM tier skips, and the skip
    reason (shown by pytest's -rs summary) names the same command."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    demo = readme.split("## What it is")[0]
    assert "python -m tests.realvm.build" in demo
    assert "pip install '.[ray]'" in demo  # the fleet tiers' skip (tests/fleet/conftest.py)
    with open(os.path.join(ROOT, "tests", "fleet", "conftest.py")) as f:
        assert "pip install '.[ray]'" in f.read()
    with open(os.path.join(ROOT, "tests", "realvm", "test_realvm.py")) as f:
        assert "run python -m tests.realvm.build first" in f.read()
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert re.search(r'addopts = ".*-rs', f.read())


def _readme_demo() -> tuple[str, str]:
    """The README's daemon command (its ``twist`` part) and its demo block."""
    with open(os.path.join(ROOT, "README.md")) as f:
        top = f.read().split("## What it is")[0]
    blocks = [body for _, body in BLOCK_ANY.findall(top)]
    daemon = blocks[0].splitlines()[0].split("&& ")[-1].replace(".venv/bin/", "")
    return daemon, blocks[1]


BLOCK_ANY = re.compile(r"(<!-- test[^>]*-->\n)?```sh\n(.*?)```", re.S)


def test_readme_demo_waits_for_its_web_server() -> None:
    """The demo's first request through the bottle comes only after a loop that waits for the
    web server it started in the background (pasted as one block, curl would otherwise race it)."""
    lines = _readme_demo()[1].splitlines()
    server = next(i for i, line in enumerate(lines) if "http.server" in line)
    through = next(i for i, line in enumerate(lines) if "127.77.0.2" in line)
    assert lines[server].rstrip().endswith("&")
    waits = [line for line in lines[server + 1 : through] if line.startswith("until curl")]
    assert waits and "127.0.0.1:8080" in waits[0], lines


def test_readme_demo_runs(tmp_path: Path) -> None:
    """The README's first command's daemon and its demo block, pasted as written (fresh
    directories and free ports), print the promised line."""
    daemon, demo = _readme_demo()
    web, agent = _free_port("127.0.0.1"), _free_port("127.77.0.2")
    with open(os.path.join(ROOT, "examples", "demo.toml")) as f:
        config = f.read().replace("8077", str(agent)).replace("8080", str(web))
    (tmp_path / "demo.toml").write_text(config)
    daemon = daemon.replace("examples/demo.toml", str(tmp_path / "demo.toml"))
    demo = demo.replace("/tmp/bn-demo", str(tmp_path / "www"))
    demo = demo.replace("8077", str(agent)).replace("8080", str(web))
    home = f"export XDG_STATE_HOME={tmp_path}/state XDG_RUNTIME_DIR={tmp_path}/run\n"
    os.mkdir(tmp_path / "run", 0o700)
    code, out, err = _run_against_daemon(tmp_path, home + daemon, [home + demo], ROOT)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert out.endswith("hello through bottlenet\n"), out


def _rooms_table() -> list[tuple[str, str, set[str]]]:
    """(first cell, room folder or "", the ``name.py`` the second cell names) for each row of
    docs/architecture.md's rooms table."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = f.read()
    section = text[text.index("## The rooms") : text.index("## The doors")]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) != 3 or not line.startswith("| "):
            continue
        folder = re.fullmatch(r"`([\w/]+/)`", cells[0])
        rows.append((cells[0], folder.group(1) if folder else "", set(MODULE.findall(cells[1]))))
    return rows


MODULE = re.compile(r"`(\w+\.py)`")


def test_rooms_table_names_every_module_of_each_room() -> None:
    """docs/architecture.md's rooms table: each room's row names exactly the ``.py`` files in
    its folder (``__init__.py`` aside), and every top-level module of ``bottlenet/`` has a row."""
    rows = _rooms_table()
    assert len([r for r in rows if r[1]]) >= 12, rows
    for _, folder, named in rows:
        if not folder:
            continue
        here = {n for n in os.listdir(os.path.join(ROOT, folder)) if n.endswith(".py")}
        here.discard("__init__.py")
        assert not here - named, f"the rooms table's {folder} row lacks {sorted(here - named)}"
        assert not named - here, f"the rooms table's {folder} row names {sorted(named - here)}"
    first = " ".join(cell for cell, _, _ in rows)
    for name in os.listdir(os.path.join(ROOT, "bottlenet")):
        if name.endswith(".py") and name != "__init__.py":
            assert f"`bottlenet/{name}`" in first, f"the rooms table has no row for {name}"


def test_every_room_lists_its_modules() -> None:
    """Each room's ``__init__.py`` names every module of the room (``:mod:`` or ``name.py``)."""
    for _, folder, _ in _rooms_table():
        init = os.path.join(ROOT, folder, "__init__.py")
        if not folder or not os.path.exists(init):
            continue
        with open(init) as f:
            text = f.read()
        for name in os.listdir(os.path.join(ROOT, folder)):
            module = name.removesuffix(".py")
            if module == name or module == "__init__":
                continue
            said = re.search(rf"[.`]{re.escape(module)}(`|\.py`)", text)
            assert said, f"{folder}__init__.py does not name its module {name}"


def _commands() -> dict[str, list[str]]:
    """bottlenetctl's commands, each with its subcommands, from its own parser."""
    import argparse

    def subs(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    return {name: list(subs(p)) for name, p in subs(build_parser()).items()}


def test_readme_control_section_names_every_command() -> None:
    """README's Control section names every ``bottlenetctl`` command and subcommand the
    parser has (``bottle rm|ls``, ``node info``, ``top``)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## Control") : readme.index("## Documentation")]
    section = " ".join(section.split())  # a command may be wrapped across lines
    commands = _commands()
    assert len(commands) >= 10 and commands["bottle"], commands
    for command, subcommands in commands.items():
        if not subcommands:
            assert re.search(rf"`{command}[ `]", section), f"README's Control lacks {command}"
        for sub in subcommands:
            said = re.search(rf"`{command} ([\w-]+\|)*{sub}[|` ]", section)
            assert said, f"README's Control section lacks `{command} {sub}`"


def test_readme_options_table_names_only_daemon_options() -> None:
    """Each ``--option`` in the first column of README's options table is one the daemon's
    own parser takes (the converse of the test above)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    table = readme[readme.index("## Options") : readme.index("## Control")]
    first = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `--")]
    assert len(first) >= 20, first
    takes = _daemon_options()
    for cell in first:
        for option in re.findall(r"`--([\w-]+)", cell):
            assert option in takes, f"README's options table names --{option}: no such option"


#: A figure: a number with a unit, a ratio or a percentage ("20.9 ms", "1.3x", "1,024 fds").
FIGURE = re.compile(r"\b\d[\d,.]*\s?(?:µs|ms|s|MiB|KiB|MB|GB|Gbit/s|x|%)(?![\w/])")
#: What may make a figure: a benchmark or a real-VM script of the tree, fwdbench (beside it).
MAKER = re.compile(
    r"(?:benchmarks/|python -m benchmarks\.|tests/realvm/)([\w.]+)|fwdbench\.py|"
    r"no benchmark in the tree"
)


def _performance_sections() -> list[tuple[str, str]]:
    """(heading, body) of each ``##`` and ``###`` section of docs/performance.md."""
    with open(os.path.join(ROOT, "docs", "performance.md")) as f:
        parts = re.split(r"(?m)^(#{2,3} .*)$", f.read())
    return list(zip(parts[1::2], parts[2::2], strict=True))


def test_every_performance_figure_names_its_benchmark() -> None:
    """Each section of docs/performance.md that gives a figure names what made it: a file of
    ``benchmarks/`` or ``tests/realvm/`` that exists (or says plainly that none in the tree
    did); every benchmark named anywhere in it exists, and "How to run" runs each one."""
    sections = _performance_sections()
    assert len(sections) >= 20
    for heading, body in sections:
        makers = list(MAKER.finditer(heading + body))
        for m in makers:
            if m.group(1):
                top = "benchmarks" if "realvm" not in m.group(0) else "tests/realvm"
                name = m.group(1).rstrip(".")
                path = os.path.join(ROOT, top, name)
                if not name.endswith((".py", ".md")) and name != "run":
                    path += ".py"  # python -m benchmarks.NAME
                assert os.path.exists(path), f"performance.md, {heading}: no {top}/{name}"
        if FIGURE.search(body):
            assert makers, f"performance.md, {heading}: figures, and no benchmark named"
    how = dict(sections)["## How to run"]
    for name in os.listdir(os.path.join(ROOT, "benchmarks")):
        with open(os.path.join(ROOT, "benchmarks", name), "rb") as f:
            runnable = b'__name__ == "__main__"' in f.read() or name == "run"
        if runnable and not re.search(rf"benchmarks[/.]{re.escape(name.removesuffix('.py'))}", how):
            raise AssertionError(f"performance.md's How to run does not run benchmarks/{name}")


def test_protocol_doc_names_every_command_and_error_code() -> None:
    """docs/protocol.md has a section for each AMP command the daemon declares and names no
    other; its Errors table names each error code the daemon can answer, and no other."""
    import inspect

    from twisted.protocols import amp

    import bottlenet.control.commands as commands
    import bottlenet.errors as errors

    with open(os.path.join(ROOT, "docs", "protocol.md")) as f:
        doc = f.read()
    declared = {c.commandName.decode() for c in [*commands.ALL_COMMANDS, *commands.PUSHED_COMMANDS]}
    headings = " ".join(re.findall(r"(?m)^### .*$", doc))
    documented = set(re.findall(r"`(bottlenet\.\w+)`", headings))
    assert declared - documented == set(), f"protocol.md has no section for {declared - documented}"
    assert documented - declared == set(), f"protocol.md documents {documented - declared}"

    def codes(module: object) -> set[str]:
        return {
            v.code
            for v in vars(module).values()
            if inspect.isclass(v)
            and issubclass(v, Exception)
            and isinstance(getattr(v, "code", None), str)
        }

    answered = codes(errors) | codes(commands) | {amp.UNHANDLED_ERROR_CODE.decode()}
    table = doc[doc.index("## Errors") : doc.index("## Records")]
    listed = {
        code
        for row in re.findall(r"(?m)^\| (`.*?) \|", table)
        for code in re.findall(r"`(\w+)`", row)
    }
    assert answered - listed == set(), f"protocol.md's Errors table lacks {answered - listed}"
    assert listed - answered == set(), f"protocol.md's Errors table names {listed - answered}"


def test_metrics_table_names_every_metric() -> None:
    """docs/operations.md's metrics table names each family ``bottlenet/ops/metrics.py``
    writes, and no other."""
    with open(os.path.join(ROOT, "bottlenet", "ops", "metrics.py")) as f:
        written = set(re.findall(r'"(bottlenet_\w+)"', f.read()))
    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        rows = re.findall(r"(?m)^\| `(bottlenet_\w+)` \|", f.read())
    assert len(written) >= 10, written
    assert written - set(rows) == set(), (
        f"operations.md's metrics table lacks {written - set(rows)}"
    )
    assert set(rows) - written == set(), (
        f"operations.md's metrics table names {set(rows) - written}"
    )


def test_the_doors_list_the_layers_contract() -> None:
    """docs/architecture.md's order of the rooms is pyproject's ``layers`` contract, and that
    contract's ground floor is the rooms table's ground floor, module for module."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = f.read()
    said = re.search(r"lists the rooms top\s+to bottom \((.*?)\), so", text, re.S)
    assert said, "architecture.md no longer lists the rooms in order"
    drawn = [p.strip().strip("`") for p in " ".join(said.group(1).split()).split(";")]
    rooms = [layer.replace("bottlenet.", "") for layer in layers]
    assert drawn[:-1] == rooms[:-1] and drawn[-1] == "the ground floor", (drawn, rooms)
    ground = {m.removeprefix("bottlenet.") for m in layers[-1].split(" : ")}
    first = next(cell for cell, _, _ in _rooms_table() if cell.startswith("ground floor"))
    assert ground == set(re.findall(r"`bottlenet/(\w+)\.py`", first)), (ground, first)


def test_protocol_doc_names_each_commands_arguments_and_answer() -> None:
    """Each command's section of docs/protocol.md names (as ``name``) every argument and
    answer key the command declares; ``capability``, which every scoped call may carry, is
    named once, in "Scoped peers"."""
    import bottlenet.control.commands as commands

    with open(os.path.join(ROOT, "docs", "protocol.md")) as f:
        doc = f.read()
    sections: dict[str, str] = {}
    for part in re.split(r"(?m)^### ", doc)[1:]:
        heading, _, body = part.partition("\n")
        for name in re.findall(r"`bottlenet\.(\w+)`", heading):
            sections[name] = sections.get(name, "") + body
    scoped = doc[doc.index("### Scoped peers") :]
    assert "`capability`" in scoped[: scoped.index("\n### ")]
    for command in [*commands.ALL_COMMANDS, *commands.PUSHED_COMMANDS]:
        named = set(re.findall(r"`(\w+)`", sections[command.__name__]))
        keys = {k.decode() if isinstance(k, bytes) else k for k, _ in command.arguments}
        keys |= {k.decode() if isinstance(k, bytes) else k for k, _ in command.response}
        keys.discard("capability")
        assert keys <= named, f"protocol.md, {command.__name__}: {sorted(keys - named)} unnamed"


def test_the_session_cap_the_docs_give_is_the_codes() -> None:
    """docs/protocol.md's BUSY row gives the cap and its split (the agent's connections, those
    kept for bottlenet's own); bottles.md the cap: both are ``bottles/sessions.py``'s."""
    from bottlenet.bottles.sessions import AGENT_CONNECTIONS, RESERVED, SESSION_CAP

    with open(os.path.join(ROOT, "docs", "protocol.md")) as f:
        protocol = f.read()
    found = re.search(
        r"cap of (\d+) sessions .*?serves (\d+) connections at once, (\d+) are kept", protocol
    )
    assert found, "docs/protocol.md no longer gives the session cap"
    assert tuple(map(int, found.groups())) == (SESSION_CAP, AGENT_CONNECTIONS, RESERVED)
    with open(os.path.join(ROOT, "docs", "bottles.md")) as f:
        bottles = f.read()
    assert f"at most {SESSION_CAP} `bottle exec`/`bottle logs` sessions" in bottles
