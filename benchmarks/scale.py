"""Scale benchmark: the real daemon holding as many idle relays as its fd limit allows.

    .venv/bin/python benchmarks/scale.py [--relays 9500] [--bottles 40] [--engine auto]

Runs ``python -m twisted bottlenet`` with a generated config of ``--bottles`` forward-only
bottles (one alias and one forward each), echo backends in ``--backends`` processes and
clients in ``--clients`` processes (every process here is capped at the same hard
RLIMIT_NOFILE, so the load must be spread). Then:

1. opens ``--relays`` connections round-robin over the forwards, each proven by a 1-byte echo,
   and records the time from connect() to the echo (p50/p99);
2. reads the daemon's RSS and fd count: memory and fds per relay;
3. pushes ``--extra`` more connections to find where the daemon stops (refuses or holds in
   the backlog), pinging the AMP control socket meanwhile;
4. closes ``--free`` relays and checks that waiting and new connections are served again.

The relay engine is picked with ``BOTTLENET_RELAY_ENGINE`` by this script's daemon launcher
(``--engine``) until the daemon has its own ``--relay-engine`` option. Prints one markdown
summary and writes JSON next to it. This is a benchmark, not a test: it takes a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's bottlenet, not an installed copy

from echoserver import serve_echo  # noqa: E402 - sibling module (run as a script)
from stats import pct  # noqa: E402 - sibling module

PORT = 9100


def raise_nofile() -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# Roles run in child processes -------------------------------------------------------------


def role_backend() -> None:
    """A selector-based echo server: one process, many connections, few bytes."""
    raise_nofile()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4096)
    print(srv.getsockname()[1], flush=True)
    serve_echo(srv, recv_size=4096)


def echo(c: socket.socket) -> bool:
    try:
        c.sendall(b"x")
        return c.recv(1) == b"x"
    except OSError:
        return False


def classify(
    socks: list[socket.socket], wait: float
) -> tuple[list[socket.socket], list[socket.socket], list[socket.socket]]:
    """Each socket sent b"x": (echoed, still waiting after ``wait`` s, reset or closed)."""
    sel = selectors.EpollSelector()
    for c in socks:
        c.setblocking(False)
        sel.register(c, selectors.EVENT_READ)
    echoed: list[socket.socket] = []
    gone: list[socket.socket] = []
    deadline = time.monotonic() + wait
    left = len(socks)
    while left and (remaining := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(remaining):
            c = key.fileobj
            assert isinstance(c, socket.socket)
            sel.unregister(c)
            left -= 1
            try:
                data = c.recv(16)
            except OSError:
                data = b""
            (echoed if data.endswith(b"x") else gone).append(c)
    done = set(echoed) | set(gone)
    waiting = [c for c in socks if c not in done]
    sel.close()
    for c in socks:
        c.setblocking(True)
    return echoed, waiting, gone


def role_client(targets: list[tuple[str, int]], count: int, offset: int) -> None:
    """Opens ``count`` echo-proven connections, then obeys commands on stdin."""
    raise_nofile()
    held: list[socket.socket] = []
    times: list[float] = []
    failed = 0
    for i in range(count):
        t0 = time.perf_counter()
        try:
            c = socket.create_connection(targets[(offset + i) % len(targets)], timeout=10)
        except OSError:
            failed += 1
            continue
        if echo(c):
            times.append(time.perf_counter() - t0)
            held.append(c)
        else:
            failed += 1
            c.close()
    print(json.dumps({"held": len(held), "failed": failed, "times": times}), flush=True)
    extra: list[socket.socket] = []
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "extra":  # try more connections: served / reset / waiting (in the backlog)
            n = int(arg)
            batch: list[socket.socket] = []
            reset = 0
            for i in range(n):
                try:
                    c = socket.create_connection(targets[i % len(targets)], timeout=5)
                    c.sendall(b"x")
                    batch.append(c)
                except OSError:
                    reset += 1
            served, waiting, gone = classify(batch, 1.0)
            reset += len(gone)
            for c in gone:
                c.close()
            extra += served + waiting
            print(
                json.dumps({"served": len(served), "reset": reset, "waiting": len(waiting)}),
                flush=True,
            )
        elif cmd == "free":
            n = int(arg)
            for c in held[:n]:
                c.close()
            del held[:n]
            print(json.dumps({"held": len(held)}), flush=True)
        elif cmd == "recheck":  # every extra (waiting ones too) and fresh ones must echo now
            for c in extra:
                try:
                    c.setblocking(False)
                    while c.recv(16):  # drain earlier echoes
                        pass
                except OSError:
                    pass
                try:
                    c.setblocking(True)
                    c.sendall(b"x")
                except OSError:
                    pass
            ok, _, _ = classify(extra, 5.0)
            fresh_batch = []
            for i in range(int(arg or 0)):
                try:
                    c = socket.create_connection(targets[i % len(targets)], timeout=5)
                    c.sendall(b"x")
                    fresh_batch.append(c)
                except OSError:
                    pass
            fresh, _, _ = classify(fresh_batch, 5.0)
            print(
                json.dumps({"extra_ok": len(ok), "extra": len(extra), "fresh_ok": len(fresh)}),
                flush=True,
            )
        elif cmd == "quit":
            break


# The driver -------------------------------------------------------------------------------


def note(msg: str) -> None:
    print(f"scale: {msg}", file=sys.stderr, flush=True)


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:")):
                out[line.split(":")[0]] = int(line.split()[1])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


class Child:
    def __init__(self, args: list[str]) -> None:
        self.p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=ROOT),
        )

    def read(self) -> Any:
        assert self.p.stdout is not None
        return json.loads(self.p.stdout.readline())

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def control_ping_ms(path: str) -> float:
    from bottlenet.control.blocking import BlockingControlClient

    t0 = time.perf_counter()
    client = BlockingControlClient(path, timeout=10)
    try:
        client.ping()
    finally:
        close = getattr(client, "close", None)
        if close is not None:
            close()
    return 1000 * (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--relays", type=int, default=9500)
    p.add_argument("--bottles", type=int, default=40)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--backends", type=int, default=2)
    p.add_argument("--extra", type=int, default=1200)
    p.add_argument("--free", type=int, default=1500)
    p.add_argument("--engine", default="auto", choices=("auto", "splice", "portable"))
    p.add_argument("--reactor", default="epoll")
    p.add_argument("--json", default=None)
    p.add_argument("--keep", action="store_true", help="keep the work dir (config, daemon log)")
    args = p.parse_args()
    hard = raise_nofile()
    work = tempfile.mkdtemp(prefix="bn-scale-")
    children: list[Child] = []
    daemon: subprocess.Popen[str] | None = None
    try:
        backends = [Child(["--role", "backend"]) for _ in range(args.backends)]
        children += backends
        bports = [b.read() for b in backends]
        lines = []
        targets = []
        for i in range(args.bottles):
            alias = f"127.77.{2 + i // 250}.{1 + i % 250}"
            targets.append((alias, PORT))
            lines += [
                "[[bottle]]",
                f'name = "scale{i}"',
                f'alias = "{alias}"',
                "[[bottle.forward]]",
                'label = "web"',
                f"port = {PORT}",
                f'target = "127.0.0.1:{bports[i % len(bports)]}"',
                "max_connections = 4096",
            ]
        cfg = os.path.join(work, "scale.toml")
        with open(cfg, "w") as f:
            f.write("\n".join(lines) + "\n")
        control = os.path.join(work, "control.sock")
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.scale_daemon",
            "--reactor",
            args.reactor,
            "bottlenet",
            "--config",
            cfg,
            "--state-dir",
            os.path.join(work, "state"),
            "--control",
            f"unix:{control}",
        ]
        log = open(os.path.join(work, "daemon.log"), "w")
        daemon = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, PYTHONPATH=ROOT, BOTTLENET_RELAY_ENGINE=args.engine),
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                control_ping_ms(control)
                for t in targets:
                    socket.create_connection(t, timeout=1).close()
                break
            except Exception:  # DaemonUnreachable, ConnectionRefusedError: not up yet
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise SystemExit(f"daemon did not come up; see {log.name}") from None
                time.sleep(0.2)
        note(f"daemon up: {args.bottles} forwards, engine {args.engine}")
        time.sleep(1.0)  # let the probe relays end
        base = proc_status(daemon.pid)
        per = [args.relays // args.clients] * args.clients
        per[0] += args.relays - sum(per)
        t0 = time.perf_counter()
        clients = []
        offset = 0
        for n in per:
            clients.append(Child(["--role", "client", json.dumps(targets), str(n), str(offset)]))
            offset += n
        children += clients
        results = [c.read() for c in clients]
        ramp = time.perf_counter() - t0
        held = sum(r["held"] for r in results)
        note(f"{held} relays held after {ramp:.1f} s")
        times = [t for r in results for t in r["times"]]
        time.sleep(1.0)
        full = proc_status(daemon.pid)
        ping_full = control_ping_ms(control)
        # Push past the limit.
        clients[0].send(f"extra {args.extra}")
        ping_during = control_ping_ms(control)
        over = clients[0].read()
        note(f"past the limit: {over}")
        at_limit = proc_status(daemon.pid)
        ping_limit = control_ping_ms(control)
        # Free some relays: waiting clients must be served, new ones must work.
        clients[1].send(f"free {args.free}")
        clients[1].read()
        time.sleep(2.5)  # the accept backoff is at most 1 s
        clients[0].send("recheck 20")
        rec = clients[0].read()
        ping_after = control_ping_ms(control)
        report = {
            "engine": args.engine,
            "hard_nofile": hard,
            "bottles": args.bottles,
            "requested": args.relays,
            "held": held,
            "failed": sum(r["failed"] for r in results),
            "ramp_s": ramp,
            "connect_echo_ms": {
                "p50": 1000 * pct(times, 50),
                "p99": 1000 * pct(times, 99),
                "max": 1000 * max(times),
            },
            "daemon_base": base,
            "daemon_full": full,
            "rss_kib_per_relay": (full["VmRSS"] - base["VmRSS"]) / max(1, held),
            "fds_per_relay": (full["fds"] - base["fds"]) / max(1, held),
            "over_limit": over,
            "daemon_at_limit": at_limit,
            "relays_at_limit": held + over["served"],
            "control_ping_ms": {
                "full": ping_full,
                "during_overload": ping_during,
                "at_limit": ping_limit,
                "after_free": ping_after,
            },
            "after_free": rec,
            "daemon_alive": daemon.poll() is None,
        }
        print(json.dumps(report, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        for c in clients:
            c.send("quit")
    finally:
        for c in children:
            c.stop()
        if daemon is not None and daemon.poll() is None:
            daemon.terminate()
            try:
                daemon.wait(20)
            except subprocess.TimeoutExpired:
                daemon.kill()
        if args.keep:
            note(f"work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--role":
        if sys.argv[2] == "backend":
            role_backend()
        else:
            role_client(
                [tuple(t) for t in json.loads(sys.argv[3])], int(sys.argv[4]), int(sys.argv[5])
            )
    else:
        main()
