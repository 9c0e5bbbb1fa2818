"""Issue 13's resource figures: one bottle at its full budget starves nobody; control memory.

Runs the real daemon (``python -m twisted bottlenet``) on loopback only, and reports:

1. With bottle ``aa`` holding every connection its budget allows (``--max-bottle-connections``,
   spread over two forwards, each relayed to an echo target), and more of its attempts being
   refused: how long a fresh connection to another bottle's (``bb``) endpoint takes to connect
   and echo, and how long a fresh control connection takes to answer ``ping`` (median and
   worst of N, in ms; the target is under 100 ms).
2. The daemon's RSS and open fds with 1,000 idle control connections (the cap holds some,
   the rest are refused), and with every held one sending an unterminated 195 KB box (the
   security review's F8: 300 such connections used to add 74.5 MiB).

3. (security T4, ``fd_budget_under_stall``) A second daemon under ``prlimit --nofile``
   (``--stall-nofile``, default 1200): bottle ``aa``'s agent opens ``--stall-relays`` (1,000)
   connections to a target that sends until it blocks and never reads, and itself writes until
   it blocks and never reads, so every relay it gets stalls both ways (a splice relay then holds
   6 fds). Reported: how many were relayed and refused, the daemon's peak fds and pipes against
   its limit and reserve, EMFILE lines in its log, whether bottle ``bb``'s endpoint and a fresh
   control connection still answer, and how long the daemon takes to drop the relays once the
   agent resets every connection.

Control-plane hardening (security-2, issue 20; ``control_hardening`` below, run as root: the
fake smolvm's exec needs ``unshare``):

4. T2: a daemon with a TLS control listener gets ``--tls-silent`` (1,000) plain TCP
   connections that never send a ClientHello; with them held, a launcher with a valid
   certificate connects and pings (median and worst of 5, target under 1 s), and the
   daemon's log lines added by the flood are counted (target: a handful).
5. T3: a tty exec of ``sleep`` is fed up to ``--tty-flood-mib`` (1024) MiB of stdin; the
   daemon stops reading once the pty is full, so the client's send blocks. The bytes the
   daemon accepted and its RSS before and after are reported (target: within 16 MiB).

Timing figures depend on the machine: quote them with the load it had. Benchmark tooling
only: nothing here is a test.

    .venv/bin/python -m benchmarks.starvation [--budget 1000] [--samples 30] [--json OUT]
    .venv/bin/python -m benchmarks.starvation --only-control-hardening
    .venv/bin/python -m benchmarks.starvation --only-stall
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks.echoserver import serve_echo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def echo_once(host: str, port: int, timeout: float = 5.0) -> socket.socket:
    s = socket.create_connection((host, port), timeout=timeout)
    s.sendall(b"x")
    if s.recv(1) != b"x":
        s.close()
        raise ConnectionError("no echo")
    return s


def percentiles(samples: list[float]) -> dict[str, float]:
    return {
        "median_ms": round(statistics.median(samples) * 1000, 2),
        "max_ms": round(max(samples) * 1000, 2),
        "n": len(samples),
    }


def wait_for_daemon(control: str) -> None:
    """Until the daemon's control socket answers ``ping`` (at most about a minute)."""
    from bottlenet.control.blocking import BlockingControlClient, ControlConnectionError

    for _ in range(1200):
        try:
            with BlockingControlClient(control, timeout=2) as c:
                c.ping()
            return
        except (OSError, ControlConnectionError):
            time.sleep(0.05)


def amp_box(values: dict[str, bytes]) -> bytes:
    out = b""
    for k, v in values.items():
        out += struct.pack(">H", len(k)) + k.encode() + struct.pack(">H", len(v)) + v
    return out


# -- 3. fd budget under stalled splice relays (security T4) --------------------------------


def _stall_target(srv: socket.socket, held: list[socket.socket], stop: threading.Event) -> None:
    """Accept; send until the socket blocks; never read (the relay's both pipes fill)."""
    srv.settimeout(0.2)
    chunk = b"t" * 65536
    while not stop.is_set():
        try:
            c, _ = srv.accept()
        except (TimeoutError, OSError):
            continue
        c.setblocking(False)
        _fill(c, chunk)
        held.append(c)


def _fill(s: socket.socket, chunk: bytes, limit: int = 64 << 20) -> int:
    sent = 0
    while sent < limit:
        try:
            sent += s.send(chunk)
        except BlockingIOError:
            break
        except OSError:
            break
    return sent


def _pipes(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("pipe:")
        except OSError:
            pass
    return n


def fd_budget_under_stall(relays: int, nofile: int) -> dict[str, Any]:
    """One bottle stalls ``relays`` splice relays under ``--nofile``: the daemon stays inside
    its fd budget, another bottle and the control socket keep working (docstring, part 3)."""
    import resource

    from bottlenet.control.blocking import BlockingControlClient
    from bottlenet.forward.budget import RESERVED_FDS

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # our own 2 x relays sockets
    work = tempfile.mkdtemp(prefix="bn-stall-")
    stop = threading.Event()
    target_held: list[socket.socket] = []
    stall = socket.create_server(("127.0.0.1", 0), backlog=2048)
    threading.Thread(target=_stall_target, args=(stall, target_held, stop), daemon=True).start()
    echo = socket.create_server(("127.0.0.1", 0), backlog=128)
    threading.Thread(target=serve_echo, args=(echo,), daemon=True).start()
    state, control = os.path.join(work, "s"), os.path.join(work, "c", "c.sock")
    log = os.path.join(work, "daemon.log")
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["PYTHONPATH"] = ROOT
    argv = ["prlimit", f"--nofile={nofile}:{nofile}", sys.executable, "-m", "twisted"]
    argv += ["--log-file", log, "bottlenet", "--state-dir", state, "--control", f"unix:{control}"]
    daemon = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    agent: list[socket.socket] = []
    out: dict[str, Any] = {"nofile": nofile, "reserve": RESERVED_FDS, "attempts": relays}
    try:
        wait_for_daemon(control)
        with BlockingControlClient(control, timeout=30) as c:
            c.create_bottle("aa")
            c.create_bottle("bb")
            a = c.add_forward("aa", "web", f"127.0.0.1:{stall.getsockname()[1]}")
            b = c.add_forward("bb", "web", f"127.0.0.1:{echo.getsockname()[1]}")
        out["daemon_fds_before"] = fds(daemon.pid)
        chunk = b"a" * 65536
        peak = 0
        for _ in range(relays):
            try:
                s = socket.create_connection((a.host, a.port), timeout=5)
            except OSError:
                continue
            s.setblocking(False)
            time.sleep(0.002)  # the relay connects its target and starts
            try:
                if s.recv(1, socket.MSG_PEEK) == b"":
                    s.close()  # closed at once: refused by a budget
                    continue
            except BlockingIOError:
                pass
            except OSError:
                s.close()  # reset: refused by a budget
                continue
            _fill(s, chunk)
            agent.append(s)
            peak = max(peak, fds(daemon.pid))
        time.sleep(1.0)  # let every accepted relay stall
        alive = 0
        for s in agent:
            try:
                alive += s.recv(1, socket.MSG_PEEK) != b""
            except BlockingIOError:
                alive += 1
            except OSError:
                pass
        peak = max(peak, fds(daemon.pid))
        out["aa_relays_kept"] = alive
        out["aa_refused"] = relays - alive
        out["daemon_fds_peak"] = peak
        out["daemon_pipe_fds_stalled"] = _pipes(daemon.pid)
        out["daemon_fd_limit_minus_reserve"] = nofile - RESERVED_FDS
        out["inside_budget"] = peak <= nofile - RESERVED_FDS
        t0 = time.perf_counter()
        echo_once(b.host, b.port).close()
        out["bb_echo_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        t0 = time.perf_counter()
        with BlockingControlClient(control, timeout=5) as c:
            c.ping()
        out["control_ping_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        # The agent goes away: every connection reset. The relays end at once (T4).
        before = fds(daemon.pid)
        t0 = time.perf_counter()
        for s in agent:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        agent.clear()
        deadline = time.monotonic() + 30
        while fds(daemon.pid) > out["daemon_fds_before"] + 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        out["after_agent_reset"] = {
            "daemon_fds_before_reset": before,
            "daemon_fds_after": fds(daemon.pid),
            "seconds_to_drop": round(time.perf_counter() - t0, 3),
        }
        with open(log, errors="replace") as f:
            out["emfile_log_lines"] = sum("EMFILE" in line or "Too many open" in line for line in f)
    finally:
        for s in agent:
            s.close()
        stop.set()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        for s in target_held:
            s.close()
        shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=1000, help="--max-bottle-connections")
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--control-connections", type=int, default=1000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--stall-relays", type=int, default=1000, help="part 3: stalled relays")
    ap.add_argument("--stall-nofile", type=int, default=1200, help="part 3: daemon's nofile")
    ap.add_argument("--only-stall", action="store_true", help="run part 3 alone")
    ap.add_argument("--tls-silent", type=int, default=1000)
    ap.add_argument("--tty-flood-mib", type=int, default=1024)
    ap.add_argument("--only-control-hardening", action="store_true")
    args = ap.parse_args()
    if args.only_stall:
        sys.path.insert(0, ROOT)
        print(json.dumps(fd_budget_under_stall(args.stall_relays, args.stall_nofile), indent=1))
        return

    sys.path.insert(0, ROOT)
    if args.only_control_hardening:
        return _report({"control_hardening": control_hardening(args)}, args.json)
    from bottlenet.control.blocking import BlockingControlClient

    work = tempfile.mkdtemp(prefix="bn-starve-")
    echo = socket.create_server(("127.0.0.1", 0), backlog=1024)
    threading.Thread(target=serve_echo, args=(echo,), daemon=True).start()
    echo_port = echo.getsockname()[1]
    state, control = os.path.join(work, "s"), os.path.join(work, "c", "c.sock")
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["PYTHONPATH"] = ROOT
    argv = [sys.executable, "-m", "twisted", "bottlenet", "--state-dir", state]
    argv += ["--control", f"unix:{control}", "--max-bottle-connections", str(args.budget)]
    daemon = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    held: list[socket.socket] = []
    result: dict[str, Any] = {"budget": args.budget, "loadavg": os.getloadavg()}
    try:
        wait_for_daemon(control)
        with BlockingControlClient(control, timeout=30) as c:
            c.create_bottle("aa")
            c.create_bottle("bb")
            a1 = c.add_forward("aa", "e1", f"127.0.0.1:{echo_port}")
            a2 = c.add_forward("aa", "e2", f"127.0.0.1:{echo_port}")
            b1 = c.add_forward("bb", "e1", f"127.0.0.1:{echo_port}")
        base_rss, base_fds = rss_kib(daemon.pid), fds(daemon.pid)
        # 1. bottle aa takes its whole budget (alternating forwards), then is refused.
        eps = [(a1.host, a1.port), (a2.host, a2.port)]
        for i in range(args.budget):
            held.append(echo_once(*eps[i % 2]))
        refused = 0
        for i in range(50):
            try:
                s = echo_once(*eps[i % 2], timeout=2)
            except OSError:
                refused += 1
            else:
                held.append(s)
        result["aa_held"] = len(held)
        result["aa_refused_of_50_more"] = refused
        result["daemon_fds_at_budget"] = fds(daemon.pid)
        other, ping = [], []
        for _ in range(args.samples):
            t0 = time.perf_counter()
            echo_once(b1.host, b1.port).close()
            other.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with BlockingControlClient(control, timeout=5) as c:
                c.ping()
            ping.append(time.perf_counter() - t0)
        result["other_bottle_connect_echo"] = percentiles(other)
        result["control_ping_fresh_connection"] = percentiles(ping)
        for s in held:
            s.close()
        held.clear()
        time.sleep(1.0)
        # 2. control memory: idle connections, then unterminated boxes on the held ones.
        rss0 = rss_kib(daemon.pid)
        conns = []
        for _ in range(args.control_connections):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            try:
                s.connect(control)
            except OSError:
                s.close()
                continue
            conns.append(s)
        time.sleep(1.0)
        alive = 0
        for s in conns:
            s.setblocking(False)
            try:
                if s.recv(1) == b"":
                    continue  # closed by the cap
            except BlockingIOError:
                alive += 1
            except OSError:
                continue
        rss_idle = rss_kib(daemon.pid)
        partial = amp_box({"_ask": b"1", "_command": b"bottlenet.Ping"})
        partial += amp_box({f"k{i}": b"v" * 65000 for i in range(3)})  # no terminator
        for s in conns:
            try:
                s.setblocking(True)
                s.sendall(partial)
            except OSError:
                pass
        time.sleep(1.5)
        rss_boxes = rss_kib(daemon.pid)
        result["control"] = {
            "connections_attempted": args.control_connections,
            "held_open_by_daemon": alive,
            "rss_before_kib": rss0,
            "rss_1000_idle_kib": rss_idle,
            "rss_with_unterminated_boxes_kib": rss_boxes,
            "daemon_fds": fds(daemon.pid),
        }
        for s in conns:
            s.close()
        result["baseline"] = {"rss_kib": base_rss, "fds": base_fds}
        with BlockingControlClient(control, timeout=10) as c:
            c.ping()  # still answers
    finally:
        for s in held:
            s.close()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    result["fd_budget_under_stall"] = fd_budget_under_stall(args.stall_relays, args.stall_nofile)
    result["control_hardening"] = control_hardening(args)
    _report(result, args.json)


def _report(result: dict[str, Any], path: str | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


# -- control-plane hardening (security-2 T2 and T3) ----------------------------------------


def control_hardening(args: argparse.Namespace) -> dict[str, Any]:
    """One daemon on the fake smolvm with a TLS listener and a VM bottle: T2, then T3."""
    import resource

    from tests.control import certs
    from tests.control.vmdaemon import VMDaemon

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.tls_silent + 512)), hard))
    d = VMDaemon()
    ca = certs.make_ca("starvation CA")
    skey, scert = certs.write(
        d.dir, "server", certs.issue(ca, "daemon", server=True, ips=("127.0.0.1",))
    )
    ca_path = certs.write(d.dir, "ca", ca)[1]
    ckey, ccert = certs.write(d.dir, "launcher", certs.issue(ca, "launcher-1", server=False))
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    d.extra = ("--control-tls-port", str(port), "--control-tls-interface", "127.0.0.1")
    d.extra += ("--control-tls-key", skey, "--control-tls-cert", scert, "--control-tls-ca", ca_path)
    d.start()
    try:
        d.create_vm_bottle("b1")
        assert d.proc is not None
        return {
            "loadavg": os.getloadavg(),
            "tls_silent_connections": _tls_silent_connections(
                d, port, (ccert, ckey, ca_path), args.tls_silent
            ),
            "tty_stdin_flood": _tty_stdin_flood(d, args.tty_flood_mib),
        }
    finally:
        d.cleanup()


def _log_lines(d: Any) -> int:
    return len(d.log().splitlines())


def _tls_silent_connections(
    d: Any, port: int, creds: tuple[str, str, str], count: int
) -> dict[str, Any]:
    """T2: ``count`` silent TCP peers held; a launcher's connect + ping time; log lines."""
    from bottlenet.control.address import TLSCredentials
    from bottlenet.control.blocking import BlockingControlClient

    tls = TLSCredentials(*creds)
    address = f"tls:127.0.0.1:{port}"
    with BlockingControlClient(address, timeout=10, tls=tls) as c:
        c.ping()  # warm: the daemon's TLS context is built
    lines0 = _log_lines(d)
    fds0 = fds(d.proc.pid)
    silent = []
    for _ in range(count):  # non-blocking: past the listen backlog they wait for accept
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        silent.append(s)
    time.sleep(2.0)  # the daemon accepts them all
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        with BlockingControlClient(address, timeout=10, tls=tls) as c:
            c.ping()
        samples.append(time.perf_counter() - t0)
    pid = d.proc.pid
    fds_launching = fds(pid)
    lines_flood = _log_lines(d) - lines0
    time.sleep(6.0)  # past the 5 s handshake deadline: the last silent ones are closed
    fds_after_deadline = fds(pid)
    for s in silent:
        s.close()
    time.sleep(11.0)  # the rate-limited logger reports what it suppressed
    return {
        "silent_connections": count,
        "launcher_connect_and_ping": percentiles(samples),
        # The kernel queues what the daemon has not accepted yet (SYN retries): the
        # daemon's own fds show what it holds.
        "daemon_fds_before": fds0,
        "daemon_fds_while_launching": fds_launching,
        "daemon_fds_after_deadline": fds_after_deadline,
        "log_lines_added": lines_flood,
        "log_lines_added_incl_suppressed_counts": _log_lines(d) - lines0,
        "tracebacks_in_log": d.log().count("Traceback"),
    }


def _tty_stdin_flood(d: Any, mib: int) -> dict[str, Any]:
    """T3: ``mib`` MiB of STDIN frames into a tty ``sleep``; what the daemon took, its RSS."""
    from bottlenet.control import stream

    pid = d.proc.pid
    rss0 = rss_kib(pid)
    frame = stream.encode(stream.STDIN, b"\0" * (stream.MAX_FRAME - 1))
    with d.client(timeout=30) as c:
        session = c.open_exec("b1", ["sleep", "600"], tty=True, stdin=True, size=(24, 80))
        session.sock.settimeout(3.0)
        sent = 0
        t0 = time.perf_counter()
        try:
            while sent < mib * 1024 * 1024:
                session.sock.sendall(frame)
                sent += len(frame)
        except (TimeoutError, OSError):
            pass  # the daemon stopped reading: back-pressure
        elapsed = time.perf_counter() - t0
        time.sleep(1.0)
        rss_fed = rss_kib(pid)
        session.close()
    time.sleep(1.0)
    return {
        "offered_mib": mib,
        "sent_before_blocking_mib": round(sent / 2**20, 2),
        "seconds_until_blocked_or_done": round(elapsed, 2),
        "rss_before_kib": rss0,
        "rss_fed_kib": rss_fed,
        "rss_delta_mib": round((rss_fed - rss0) / 1024, 2),
        "rss_after_close_kib": rss_kib(pid),
    }


if __name__ == "__main__":
    main()
