"""``bottlenet-kit``: the one program of bottlenet's guest kit, run INSIDE a guest.

The kit (``bottlenet/kit/build.py``) is an interpreter with its own loader, libraries and the
part of the standard library these programs use, plus this dispatcher and the guest programs
it runs, byte-compiled. It is mounted read-only at a fixed guest path and run by naming its
loader (``kit.program``), so nothing of the image runs: no ``/bin/sh``, no ``python3``, no
libc. Each subcommand is one of bottlenet's guest commands:

``version``                  the kit's format and machine, as JSON
``digest``                   the digest of the kit's files as they are in this guest
``probe``                    the launch gate (its request on stdin: the plan and the digest the
                             host built; a kit whose files differ refuses to run the checks)
``bridge PORT=PATH ...``     the in-guest bridge (stdin is its lifeline)
``reach``                    the bridge's proof (its request on stdin)
``session ARGV...``          an attached command that ends with its session
``workload prepare|run|wait|logs ...``, ``whoami``   the workload's steps
``idle``                     waits until killed (the agent VM's wait command)
``write PATH``               stdin to PATH, atomically (the sidecar's egress policy)
``read PATH``                PATH's bytes (a regular file, at most 1 MiB) on stdout
``procs REVERSED``           how many processes carry REVERSED, read backwards, in their argv
``wait-for PATH SECONDS CODE WORD...``   waits until PATH exists (SECONDS at most), prints the
                             WORDs and exits CODE (a workload that needs no shell)
``egress install|serve|run|remove ...``   the transparent egress layer (issue 37:
                             ``bottlenet.transparent.layer.main``; stdin is its lifeline)

Standard library only. The daemon imports it too, for :func:`tree_digest`: the host and the
guest compute the kit's digest with this one function.
"""

from __future__ import annotations

import json
import marshal
import os
import stat
import sys
import time
from collections.abc import Callable

#: Bumped when the subcommands or the layout change incompatibly.
FORMAT = 1
#: Where the guest programs are, relative to the kit's root.
APP = "app"
#: Where the package the programs import (``bottlenet.transparent``) is: on ``sys.path``.
PKG = "pkg"
EXIT_USAGE = 2
#: The probe's exit when the kit's files are not the ones the host built.
EXIT_KIT_MISMATCH = 5
#: Exit codes of ``workload prepare`` (as the image-python3 path's).
PREPARE_NO_DIR = 125
PREPARE_NOT_FOUND = 127
#: The bound on what ``write`` takes from stdin.
MAX_WRITE = 1 << 20
_CHUNK = 1 << 16


def tree_digest(root: str) -> str:
    """sha256 of one line per entry under ``root`` (sorted, links never followed): its
    relative path, type, mode, size and, for a file, its sha256. Anything added, removed,
    changed or re-typed changes it. A FIFO or device is listed, never opened."""
    import hashlib

    top = hashlib.sha256(b"bottlenet-kit-tree 1\n")
    stack = [""]
    while stack:
        rel = stack.pop()
        here = os.path.join(root, rel) if rel else root
        for name in sorted(os.listdir(here), reverse=True):
            path = os.path.join(here, name)
            sub = os.path.join(rel, name) if rel else name
            st = os.lstat(path)
            kind = "d" if stat.S_ISDIR(st.st_mode) else "f" if stat.S_ISREG(st.st_mode) else "o"
            line = "%s %o %s" % (kind, st.st_mode, sub)
            if kind == "d":
                stack.append(sub)
            elif kind == "f":
                line += " %d %s" % (st.st_size, _file_sha256(path))
            top.update(line.encode("utf-8", "surrogateescape") + b"\n")
    return top.hexdigest()


def _file_sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not-a-file"
        while True:
            data = os.read(fd, 1 << 20)
            if not data:
                return h.hexdigest()
            h.update(data)
    finally:
        os.close(fd)


def kit_root() -> str:
    """The kit's root: this file is ``<root>/app/main.pyc``."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name: str, run_name: str | None = None) -> dict[str, object]:
    """Run the kit's program ``name`` (``app/<name>.pyc``) as a module; its globals."""
    path = os.path.join(kit_root(), APP, name + ".pyc")
    with open(path, "rb") as fh:
        code = marshal.loads(fh.read()[16:])
    env: dict[str, object] = {"__name__": run_name or "bottlenet_kit_" + name, "__file__": path}
    exec(code, env)
    return env


def _stdin_json() -> dict:
    return json.loads(sys.stdin.buffer.read(MAX_WRITE).decode("utf-8"))


def _call(env: dict[str, object], fn: str) -> int:
    main = env[fn]
    assert callable(main)
    return int(main() or 0)


def cmd_version(args: list[str]) -> int:
    info = {"format": FORMAT, "machine": os.uname().machine, "python": sys.version.split()[0]}
    sys.stdout.write(json.dumps(info, sort_keys=True) + "\n")
    return 0


def cmd_digest(args: list[str]) -> int:
    sys.stdout.write(tree_digest(kit_root()) + "\n")
    return 0


def _interfaces() -> list[str]:
    """This network namespace's interfaces (/proc/net/dev; /sys/class/net is the fallback,
    as it shows the namespace sysfs was mounted in)."""
    try:
        with open("/proc/net/dev") as fh:
            return [ln.split(":", 1)[0].strip() for ln in fh.readlines()[2:] if ":" in ln]
    except OSError:
        pass
    try:
        return sorted(os.listdir("/sys/class/net"))
    except OSError:
        return []


def cmd_probe(args: list[str]) -> int:
    """The launch gate: the same lines as the sh script's, then the kit's own digest (which
    must be the one the host sent), then the checks."""
    request = _stdin_json()
    plan = request["plan"]

    def say(*words: object) -> None:
        sys.stdout.write(" ".join(["BNP", plan["nonce"]] + [str(w) for w in words]) + "\n")
        sys.stdout.flush()

    say("begin", 1)
    for name in _interfaces():
        say("iface", name)
    say("tool", "kit")
    got = tree_digest(kit_root())
    say("kit", got)
    if got != request["kit"]:
        say("end", "kit-mismatch")
        return EXIT_KIT_MISMATCH
    env = load("probe")
    env["PLAN"] = plan
    return _call(env, "main")


def cmd_bridge(args: list[str]) -> int:
    bridges = []
    for word in args:
        port, _, path = word.partition("=")
        bridges.append([int(port), path])
    env = load("bridge")
    env["BRIDGES"] = bridges
    return _call(env, "main")


def cmd_reach(args: list[str]) -> int:
    env = load("reach")
    env["CHECK"] = _stdin_json()
    return _call(env, "main")


def cmd_session(args: list[str]) -> int:
    if not args:
        return EXIT_USAGE
    sys.argv = ["bottlenet-session", *args]
    load("session", "__main__")  # it ends the process itself
    return 0


def cmd_idle(args: list[str]) -> int:
    """Waits until killed: the agent VM's own workload until the gate has passed (bottlenet's
    wait command, in place of the image's ENTRYPOINT+CMD; an image may have no ``sleep``)."""
    while True:
        time.sleep(3600)


def cmd_whoami(args: list[str]) -> int:
    sys.stdout.write("%d:%d\n" % (os.getuid(), os.getgid()))
    return 0


def _remove_tree(d: str) -> None:
    if os.path.islink(d) or (os.path.lexists(d) and not os.path.isdir(d)):
        os.unlink(d)
        return
    if not os.path.lexists(d):
        return
    for top, dirs, files in os.walk(d, topdown=False):
        for name in files + dirs:
            p = os.path.join(top, name)
            if os.path.islink(p) or not os.path.isdir(p):
                os.unlink(p)
            else:
                os.rmdir(p)
    os.rmdir(d)


def _runnable(word: str) -> bool:
    """``word`` runs here: an executable path, else found on this environment's PATH."""
    if "/" in word:
        return os.access(word, os.X_OK) and not os.path.isdir(word)
    for d in os.environ.get("PATH", "").split(":"):
        p = os.path.join(d, word)
        if d and os.access(p, os.X_OK) and not os.path.isdir(p):
            return True
    return False


def workload_prepare(args: list[str]) -> int:
    """A fresh root-owned directory (0755) with an empty log; the command must be runnable."""
    d, command = args[0], args[1]
    try:
        _remove_tree(d)
        os.mkdir(d, 0o755)
        os.chmod(d, 0o755)
        os.close(os.open(os.path.join(d, "log"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except OSError:
        return PREPARE_NO_DIR
    return 0 if _runnable(command) else PREPARE_NOT_FOUND


def workload_run(args: list[str]) -> int:
    env = load("parent")
    main = env["main"]
    assert callable(main)
    return int(main(args) or 0)


def workload_wait(args: list[str]) -> int:
    """Prints the workload's exit code once ``DIR/exit`` exists; exit 3 when ``DIR`` went."""
    d = args[0]
    while not os.path.exists(os.path.join(d, "exit")):
        if not os.path.isdir(d):
            return 3
        time.sleep(1)
    with open(os.path.join(d, "exit")) as fh:
        sys.stdout.write(fh.read(64))
    return 0


def _last_lines(data: bytes, n: int) -> bytes:
    if n <= 0:
        return b""
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-n:])


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def workload_logs(args: list[str]) -> int:
    """The last N lines of the log (its rotated part first); with ``-F``, of the log, then
    what is appended, followed by name across a rotation."""
    d, n, follow = args[0], int(args[1]), args[2:] == ["-F"]
    log = os.path.join(d, "log")
    if not os.path.exists(log):
        sys.stderr.write("no workload log yet\n")
        return 1
    out = sys.stdout.buffer
    if not follow:
        out.write(_last_lines(_read(log + ".1") + _read(log), n))
        out.flush()
        return 0
    fh = open(log, "rb")  # reopened on rotation
    out.write(_last_lines(fh.read(), n))
    out.flush()
    while True:
        data = fh.read(_CHUNK)
        if data:
            out.write(data)
            out.flush()
            continue
        try:
            moved = os.stat(log).st_ino != os.fstat(fh.fileno()).st_ino
        except OSError:
            moved = False
        if moved:
            fh.close()
            fh = open(log, "rb")
            continue
        time.sleep(0.5)


def cmd_workload(args: list[str]) -> int:
    steps = {
        "prepare": (workload_prepare, 2),
        "run": (workload_run, 3),
        "wait": (workload_wait, 1),
        "logs": (workload_logs, 2),
    }
    if not args or args[0] not in steps or len(args) - 1 < steps[args[0]][1]:
        return _usage()
    return steps[args[0]][0](args[1:])


def cmd_write(args: list[str]) -> int:
    """stdin into ``PATH.tmp``, then renamed to ``PATH``."""
    if len(args) != 1:
        return _usage()
    data = sys.stdin.buffer.read(MAX_WRITE + 1)
    if len(data) > MAX_WRITE:
        sys.stderr.write("write: more than %d bytes\n" % MAX_WRITE)
        return 1
    path = args[0]
    with open(path + ".tmp", "wb") as fh:
        fh.write(data)
    os.rename(path + ".tmp", path)
    return 0


def cmd_read(args: list[str]) -> int:
    """A regular file's first :data:`MAX_WRITE` bytes on stdout (never a FIFO's block, a
    device or a link followed); exit 1 when it cannot be read."""
    if len(args) != 1:
        return _usage()
    try:
        fd = os.open(args[0], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        sys.stderr.write("read: %s\n" % e.strerror)
        return 1
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            sys.stderr.write("read: not a regular file\n")
            return 1
        sys.stdout.buffer.write(fh.read(MAX_WRITE))
    return 0


def cmd_procs(args: list[str]) -> int:
    """The number of processes whose argv carries the mark given reversed (so this
    command's own argv does not carry it)."""
    if len(args) != 1:
        return _usage()
    mark, n = args[0][::-1].encode(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open("/proc/%s/cmdline" % pid, "rb") as fh:
                    n += mark in fh.read()
            except OSError:
                pass
    sys.stdout.write("%d\n" % n)
    return 0


def cmd_wait_for(args: list[str]) -> int:
    """Waits until PATH exists (polled ten times a second, SECONDS at most), then prints
    the WORDs and exits CODE."""
    if len(args) < 3 or not args[1].isdigit() or not args[2].isdigit():
        return _usage()
    end = time.monotonic() + int(args[1])
    while not os.path.exists(args[0]) and time.monotonic() < end:
        time.sleep(0.1)
    sys.stdout.write(" ".join(args[3:]) + "\n")
    sys.stdout.flush()
    return int(args[2]) & 0xFF


def cmd_egress(args: list[str]) -> int:
    from bottlenet.transparent.layer import main as layer_main

    return layer_main(args)


#: Every subcommand.
COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "version": cmd_version,
    "digest": cmd_digest,
    "probe": cmd_probe,
    "bridge": cmd_bridge,
    "reach": cmd_reach,
    "session": cmd_session,
    "workload": cmd_workload,
    "whoami": cmd_whoami,
    "idle": cmd_idle,
    "write": cmd_write,
    "read": cmd_read,
    "procs": cmd_procs,
    "wait-for": cmd_wait_for,
    "egress": cmd_egress,
}


def _usage() -> int:
    sys.stderr.write("usage: bottlenet-kit {%s} ...\n" % ",".join(COMMANDS))
    return EXIT_USAGE


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        return _usage()
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(kit_root(), PKG))
    sys.exit(main(sys.argv[1:]))
