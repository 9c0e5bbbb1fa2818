"""Start the real daemon as a fwdbench peer, the way users start it (benchmark tooling only).

    python3 benchmarks/daemon_peer.py readme --listen HOST:PORT --to HOST:PORT
    python3 benchmarks/daemon_peer.py unit --listen HOST:PORT --to HOST:PORT [--unit FILE]

``readme``: the README's run command, ``twist bottlenet --config FILE``, with a config file of
one forward-only bottle (alias HOST) and one forward (PORT -> the target), every other option
left at its default (state and runtime directories in a fresh temp dir through
``XDG_STATE_HOME``/``XDG_RUNTIME_DIR``, so nothing of the user's is touched).

``unit``: the ``ExecStart=`` line of the shipped systemd unit (``contrib/systemd/system/
bottlenet.service`` by default), word for word except for the binary's directory (this venv's
``twist``) and ``--state-dir`` (a temp dir, as ``StateDirectory=`` would give). What systemd
does around it is done here: the control socket of ``bottlenet.socket`` is passed as fd 3 with
``LISTEN_FDS``/``LISTEN_FDNAMES=control``, ``NOTIFY_SOCKET`` is a datagram socket, and once the
daemon says ``READY=1`` a detached helper creates the bottle and its forward over the control
socket with the blocking client (as a launcher would), then exits.

Either way this process execs the daemon (same PID: the harness measures the daemon's own
process tree, and the helper is not part of it).
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT = os.path.join(ROOT, "contrib", "systemd", "system", "bottlenet.service")
BOTTLE, LABEL = "bench", "fwd"


def split_addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def twist_path() -> str:
    return os.path.join(os.path.dirname(sys.executable), "twist")


def readme(listen: str, target: str) -> None:
    host, port = split_addr(listen)
    work = tempfile.mkdtemp(prefix="bottlenet-bench-readme-")
    config = os.path.join(work, "bench.toml")
    with open(config, "w") as f:
        f.write(
            f'[[bottle]]\nname = "{BOTTLE}"\nalias = "{host}"\n\n'
            f'[[bottle.forward]]\nlabel = "{LABEL}"\nport = {port}\ntarget = "{target}"\n'
        )
    env = dict(os.environ)
    for var in ("XDG_STATE_HOME", "XDG_RUNTIME_DIR"):
        env[var] = os.path.join(work, var.lower())
        os.makedirs(env[var], mode=0o700)
    argv = [twist_path(), "bottlenet", "--config", config]
    print("daemon_peer: exec", shlex.join(argv), flush=True)
    os.execve(argv[0], argv, env)


def exec_start(unit: str) -> list[str]:
    """The unit's ExecStart= words (one line, no continuation: the shipped units have none)."""
    with open(unit) as f:
        for line in f:
            if line.startswith("ExecStart="):
                return shlex.split(line[len("ExecStart=") :])
    raise SystemExit(f"daemon_peer: no ExecStart= in {unit}")


def unit_argv(unit: str, state_dir: str) -> list[str]:
    words = exec_start(unit)
    if os.path.basename(words[0]) != "twist":
        raise SystemExit(f"daemon_peer: {unit} does not start twist: {words[0]}")
    argv = [twist_path()]
    for word in words[1:]:
        if word.startswith("--state-dir="):
            word = f"--state-dir={state_dir}"
        argv.append(word.replace("%h", os.path.expanduser("~")))
    return argv


def unit(listen: str, target: str, unit_file: str) -> None:
    host, port = split_addr(listen)
    work = tempfile.mkdtemp(prefix="bottlenet-bench-unit-")
    state_dir = os.path.join(work, "state")
    os.mkdir(state_dir, 0o700)
    control_path = os.path.join(work, "control.sock")
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    control.bind(control_path)
    control.listen(64)
    notify_path = os.path.join(work, "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    argv = unit_argv(unit_file, state_dir)
    print("daemon_peer: exec", shlex.join(argv), flush=True)
    middle = os.fork()
    if middle == 0:  # pragma: no cover - helper process
        if os.fork() != 0:
            os._exit(0)
        control.close()
        os._exit(configure(notify, control_path, host, port, target))
    os.waitpid(middle, 0)
    notify.close()
    if control.fileno() != 3:
        os.dup2(control.fileno(), 3)
    os.set_inheritable(3, True)
    env = dict(os.environ)
    env.update(
        LISTEN_FDS="1",
        LISTEN_PID=str(os.getpid()),
        LISTEN_FDNAMES="control",
        NOTIFY_SOCKET=notify_path,
        RUNTIME_DIRECTORY=work,
        STATE_DIRECTORY=state_dir,
    )
    os.execve(argv[0], argv, env)


def configure(notify: socket.socket, control_path: str, host: str, port: int, target: str) -> int:
    """Wait for READY=1, then create the bottle and its forward over the control socket."""
    from bottlenet.control.blocking import BlockingControlClient

    notify.settimeout(60)
    while True:
        try:
            message = notify.recv(4096).decode("utf-8", "replace")
        except TimeoutError:
            print("daemon_peer: no READY=1 within 60 s", file=sys.stderr)
            return 1
        if "READY=1" in message.split("\n"):
            break
    with BlockingControlClient(control_path) as client:
        client.create_bottle(BOTTLE, alias=host)
        client.add_forward(BOTTLE, LABEL, target, port)
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("how", choices=("readme", "unit"))
    p.add_argument("--listen", required=True)
    p.add_argument("--to", required=True)
    p.add_argument("--unit", default=UNIT)
    args = p.parse_args()
    if args.how == "readme":
        readme(args.listen, args.to)
    else:
        unit(args.listen, args.to, args.unit)


if __name__ == "__main__":
    main()
