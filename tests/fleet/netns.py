"""A Ray cluster of network namespaces on one machine, for the multi-node tier and the fleet
benchmark (docs/fleet.md, "Tests").

Each node is a namespace of its own (network, PID and mount, made by ``unshare``): its own
address on a test bridge, its own raylet and its own bottlenet daemon (fake smolvm, a TEST
DOUBLE). The bridge lives in a *switch* namespace, the Ray head and a Redis (the GCS's store,
so the head can restart) in another, the trainer (the Ray driver) in a third. No namespace has
a default route: nothing can leave them (198.19.77.0/24 is in the benchmarking range that is
never routed).

Teardown is by construction: each namespace's PID 1 is a small reaper; killing it kills every
process in the namespace, and each reaper dies with the ``unshare`` that made it, which dies
with the process that made it (``PR_SET_PDEATHSIG``): a test killed half-way leaves no
namespace, bridge or process behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from tests.control.daemon_helpers import REPO, daemon_argv
from tests.fakes import FAKE_SMOLVM
from tests.fleet.daemons import QUIET_RAY, NodeDaemon

SUBNET = "198.19.77"
HEAD_IP = f"{SUBNET}.1"
TRAINER_IP = f"{SUBNET}.2"
GCS_PORT = 6379
REDIS_PORT = 6380
PR_SET_PDEATHSIG = 1
# PID 1 of each namespace: reaps every orphan (Ray daemonises), dies on SIGTERM/SIGKILL.
_REAPER = (
    "import os, time\n"
    "while True:\n"
    "    try:\n"
    "        os.wait()\n"
    "    except ChildProcessError:\n"
    "        time.sleep(0.2)\n"
)
BIN = os.path.dirname(sys.executable)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def wait_until(what: str, check: Callable[[], bool], timeout: float = 60.0) -> float:
    """Poll ``check`` until it holds; the seconds it took (AssertionError at the deadline)."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"never happened within {timeout:g}s: {what}")
        time.sleep(0.1)
    return time.monotonic() - start


@attrs.define
class Namespace:
    """One namespace (network, PID, mount) held by its reaper."""

    name: str
    #: enter only its network (the switch: its ``ip`` commands name other namespaces by the
    #: pids this process sees)
    net_only: bool = False
    holder: subprocess.Popen[bytes] | None = None
    pid: int = 0  # the reaper's pid as this process sees it

    def start(self) -> None:
        self.holder = subprocess.Popen(
            ["unshare", "--net", "--pid", "--mount", "--fork", "--kill-child", "--mount-proc",
             "--", "/usr/bin/python3", "-c", _REAPER],
            preexec_fn=_die_with_parent,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        children = f"/proc/{self.holder.pid}/task/{self.holder.pid}/children"

        def forked() -> bool:
            with open(children) as f:
                words = f.read().split()
            if not words:
                return False
            self.pid = int(words[0])
            with open(f"/proc/{self.pid}/cmdline", "rb") as f:
                return _REAPER.encode() in f.read()

        wait_until(f"namespace {self.name} up", forked, 30)
        self.sh("ip link set lo up")

    def argv(self, argv: Sequence[str]) -> list[str]:
        enter = ["-n"] if self.net_only else ["-n", "-p", "-m"]
        return ["nsenter", "-t", str(self.pid), *enter, "--", *argv]

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.argv(argv), preexec_fn=_die_with_parent, **kw)

    def run(
        self, argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 120
    ) -> str:
        done = subprocess.run(
            self.argv(argv), env=env, capture_output=True, timeout=timeout, cwd=REPO
        )
        if done.returncode != 0:
            raise AssertionError(
                f"{self.name}: {' '.join(argv[:3])} failed ({done.returncode}): "
                f"{done.stderr.decode(errors='replace')[-2000:]}"
            )
        return done.stdout.decode(errors="replace")

    def sh(self, command: str) -> str:
        return self.run(["sh", "-c", command])

    def pids(self, needle: str) -> list[int]:
        """Host pids of this namespace's processes whose command line holds ``needle``."""
        mine = os.readlink(f"/proc/{self.pid}/ns/pid")
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.pid:
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != mine:
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ")
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue
            except OSError:
                continue
            if needle.encode() in cmdline:
                found.append(int(entry))
        return found

    def stop(self) -> None:
        """Kill every process of the namespace (its reaper first: the kernel does the rest)."""
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if self.holder is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.holder.wait(timeout=30)
            self.holder = None
        self.pid = 0


@attrs.define
class Node(NodeDaemon):
    """A bottle node: its namespace, its bottlenet daemon (state, socket, fake smolvm as
    :class:`NodeDaemon`'s) and its raylet."""

    bottles: int = attrs.field(kw_only=True)
    ns: Namespace = attrs.field(kw_only=True)

    @property
    def ip(self) -> str:
        return f"{SUBNET}.{10 + self.index}"

    @property
    def label(self) -> str:
        return f"n{self.index}"

    def start_daemon(
        self, env: dict[str, str], extra: Sequence[str] = (), *, gate: bool = False
    ) -> None:
        """The node's daemon; without ``gate`` it skips the launch gate (the fake's plain
        ``exec`` runs on the host, where the gate's checks cannot pass)."""
        skip = () if gate else ("--unsafe-skip-isolation-probe",)
        argv = daemon_argv(
            os.path.join(self.root, "state"), self.control,
            "--smolvm", FAKE_SMOLVM, "--smolvm-data-dir", self.fake.path,
            "--uid-ledger", self.fake.uid_ledger, *skip, *extra,
        )  # fmt: skip
        log = open(os.path.join(self.root, "daemon.log"), "ab")
        self.proc = self.ns.popen(argv, env=env, cwd=REPO, stdout=log, stderr=log)
        log.close()
        try:
            wait_until(f"{self.label}'s daemon answers", self._answers, 120)
        except AssertionError as e:
            with open(os.path.join(self.root, "daemon.log"), errors="replace") as f:
                raise AssertionError(f"{e}: {f.read()[-1500:]}") from None

    def _answers(self) -> bool:
        try:
            with self.client(timeout=2) as c:
                c.ping()
        except Exception:
            return False
        return True

    def kill_daemon(self) -> None:
        """SIGKILL the daemon (as a crash): its VMs and state stay."""
        for pid in self.ns.pids("bottlenet --log-format"):
            os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)
            self.proc = None


#: The uid Ray runs as (never root: docs/fleet.md); each daemon admits it scoped.
RAY_UID = 4250
#: Another scoped uid, the "other owner" of the scoped-uid check.
OTHER_UID = 4251
SYSTEM_PYTHON = "/usr/bin/python3"
SITE = sysconfig.get_paths()["purelib"]
_RAY_MAIN = "import sys; from ray.scripts.scripts import main; sys.exit(main())"


def unprivileged_python_works(uid: int = RAY_UID) -> str | None:
    """None when ``uid`` can run Ray and this tree with the system python (as the tier
    runs Ray), else why not (a tree under a 0700 home, no setpriv)."""
    probe = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", SYSTEM_PYTHON,
         "-c", "import ray, bottlenet.fleet"],
        env={"PATH": "/usr/bin:/bin", "HOME": "/", "PYTHONPATH": f"{SITE}:{REPO}"},
        capture_output=True, cwd="/", timeout=120,
    )  # fmt: skip
    if probe.returncode == 0:
        return None
    return probe.stderr.decode(errors="replace").strip().splitlines()[-1:][0][:200]


@attrs.define
class NetCluster:
    """Switch, head (GCS + Redis), trainer and ``len(bottles)`` bottle nodes. Ray (head,
    raylets, workers, the trainer) runs as ``ray_uid`` with the system python, or as this
    process's uid with this interpreter when ``ray_uid`` is None."""

    root: str
    bottles: Sequence[int]
    ray_uid: int | None = RAY_UID
    lease_grace: float = 3.0
    #: VMs that take this many seconds to boot, each node's launch gate run (the fake's
    #: isolating ``exec-netns`` stand-in, as root); None: instant VMs, no gate.
    vm_boot: float | None = None
    token: str = "bottlenet-fleet-test-token-0123456789abcdef"
    switch: Namespace = attrs.field(factory=lambda: Namespace("switch", net_only=True))
    head: Namespace = attrs.field(factory=lambda: Namespace("head"))
    trainer: Namespace = attrs.field(factory=lambda: Namespace("trainer"))
    redis: Namespace = attrs.field(factory=lambda: Namespace("redis"))
    nodes: list[Node] = attrs.field(factory=list)
    head_kills: int = 0

    @property
    def address(self) -> str:
        return f"{HEAD_IP}:{GCS_PORT}"

    @property
    def home(self) -> str:
        return os.path.join(self.root, "home")

    def env(self, **extra: str) -> dict[str, str]:
        """Every process's environment: this tree importable, Ray quiet and
        token-authenticated, a HOME of the cluster's own (Ray's bootstrap-config stand-in)."""
        path = "/usr/bin:/bin:/usr/sbin:/sbin" if self.ray_uid else f"{BIN}:/usr/bin:/bin"
        env = {
            "PATH": path,
            "HOME": self.home,
            "PYTHONPATH": f"{SITE}:{REPO}" if self.ray_uid else REPO,
            "LANG": "C.UTF-8",
            **QUIET_RAY,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": os.path.join(self.home, "token"),
            # a lost node is declared dead after ~3 s (1 s checks, 3 misses), not 15+
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
            "RAY_gcs_rpc_server_reconnect_timeout_s": "60",
        }
        env.update(extra)
        return env

    def as_ray(self, argv: Sequence[str]) -> list[str]:
        """``argv`` (a Python program's arguments) as Ray's uid runs it."""
        if self.ray_uid is None:
            return [sys.executable, *argv]
        uid = str(self.ray_uid)
        return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                SYSTEM_PYTHON, *argv]  # fmt: skip

    def _own(self, path: str) -> None:
        if self.ray_uid is not None:
            os.chown(path, self.ray_uid, self.ray_uid)

    def start(self) -> None:
        os.chmod(self.root, 0o711)
        os.makedirs(self.home, exist_ok=True)
        with open(os.path.join(self.home, "ray_bootstrap_config.yaml"), "w") as f:
            f.write("provider:\n  type: local\n")
        token = os.path.join(self.home, "token")
        with open(token, "w") as f:
            f.write(self.token)
        os.chmod(token, 0o600)
        self._own(self.home)
        self._own(token)
        self.switch.start()
        self.switch.sh("ip link add br0 type bridge && ip link set br0 up")
        self._plug(self.redis, f"{SUBNET}.3", "vredis")
        self.redis.popen(
            ["redis-server", "--port", str(REDIS_PORT), "--bind", f"{SUBNET}.3",
             "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.start_head()
        self._plug(self.trainer, TRAINER_IP, "vtrainer")
        self._ray_start(self.trainer, TRAINER_IP, "trainer", num_cpus=2, bottles=0)
        for i, count in enumerate(self.bottles):
            root = os.path.join(self.root, f"n{i + 1}")
            node = Node(root, i + 1, bottles=count, ns=Namespace(f"n{i + 1}"))
            os.makedirs(node.root, exist_ok=True)
            os.chmod(node.root, 0o701)  # Ray's uid reaches the control socket (0666) in it
            self._plug(node.ns, node.ip, f"vn{node.index}")
            self.start_daemon(node)
            self.nodes.append(node)
            self.start_raylet(node)

    def start_daemon(self, node: Node) -> None:
        scoped: list[str] = []
        for uid in (self.ray_uid, OTHER_UID):
            if uid is not None:
                scoped += ["--allow-uid", f"{uid}:scoped"]
        extra = [
            "--label", f"bottlenet-node={node.label}", "--lease-grace", f"{self.lease_grace:g}",
            *scoped,
        ]  # fmt: skip
        if self.vm_boot is not None:
            node.fake.set_faults("exec-netns", "slow-start", slow_start=self.vm_boot)
        env = self.env(PATH=f"{BIN}:/usr/bin:/bin", PYTHONPATH=REPO)
        node.start_daemon(env, extra, gate=self.vm_boot is not None)
        os.chmod(node.control, 0o666)  # as a systemd socket's group would let Ray reach it

    def _plug(self, ns: Namespace, ip: str, veth: str) -> None:
        if not ns.pid:
            ns.start()
        self.switch.sh(
            f"ip link add {veth} type veth peer name eth0 netns {ns.pid} && "
            f"ip link set {veth} master br0 up"
        )
        ns.sh(f"ip addr add {ip}/24 dev eth0 && ip link set eth0 up")

    def _ray_start(
        self, ns: Namespace, ip: str, label: str, *, num_cpus: int, bottles: int,
        head: bool = False, env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        temp = os.path.join(self.root, "ray-" + label)
        os.makedirs(temp, exist_ok=True)
        self._own(temp)
        argv = [
            "-c", _RAY_MAIN, "start", f"--node-ip-address={ip}",
            f"--num-cpus={num_cpus}", f"--resources={json.dumps({'bottle': bottles})}",
            f"--labels=bottlenet-node={label}", "--object-store-memory=80000000",
            f"--temp-dir={temp}", "--disable-usage-stats",
        ]  # fmt: skip
        if head:
            argv += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
        else:
            argv += [f"--address={self.address}"]
        ns.run(self.as_ray(argv), env=env or self.env(), timeout=180)

    def start_head(self) -> None:
        self._plug(self.head, HEAD_IP, "vhead")
        env = self.env(RAY_REDIS_ADDRESS=f"{SUBNET}.3:{REDIS_PORT}")
        self._ray_start(self.head, HEAD_IP, "head", num_cpus=0, bottles=0, head=True, env=env)

    def kill_head(self) -> None:
        """The head's namespace goes (GCS, its raylet, everything; its veth with it)."""
        self.head.stop()
        self.head = Namespace("head")
        self.head_kills += 1

    def start_raylet(self, node: Node) -> None:
        env = self.env(BOTTLENET_CONTROL=f"unix:{node.control}")
        self._ray_start(node.ns, node.ip, node.label, num_cpus=0, bottles=node.bottles, env=env)

    def kill_raylet(self, node: Node) -> None:
        for pid in node.ns.pids("/raylet"):
            os.kill(pid, signal.SIGKILL)

    def stop_ray(self, node: Node) -> None:
        """Every Ray process of ``node`` (raylet, agents, workers) killed."""
        for pid in node.ns.pids("site-packages/ray/"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def partition(self, node: Node, up: bool = False) -> None:
        self.switch.sh(f"ip link set vn{node.index} {'up' if up else 'down'}")

    def driver(self) -> Driver:
        with open(os.path.join(self.root, "driver.log"), "ab") as log:
            proc = self.trainer.popen(
                self.as_ray(["-m", "tests.fleet.driver", self.address]),
                env=self.env(),
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        return Driver(proc)

    def all_namespaces(self) -> list[Namespace]:
        return [*(n.ns for n in self.nodes), self.trainer, self.head, self.redis, self.switch]

    def namespace_ids(self) -> set[str]:
        """The network and PID namespaces of the cluster as the kernel names them."""
        ids = set()
        for ns in self.all_namespaces():
            if ns.pid:
                for kind in ("net", "pid"):
                    with contextlib.suppress(OSError):
                        ids.add(os.readlink(f"/proc/{ns.pid}/ns/{kind}"))
        return ids

    @staticmethod
    def processes_in(ids: set[str]) -> list[int]:
        """Processes of this machine still in any of those namespaces."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            for kind in ("net", "pid"):
                try:
                    if os.readlink(f"/proc/{entry}/ns/{kind}") in ids:
                        found.append(int(entry))
                        break
                except OSError:
                    continue
        return found

    def stop(self) -> None:
        """Everything down, nodes first (their daemons' fakes' VMs die with them)."""
        for node in self.nodes:
            node.ns.stop()
        for ns in (self.trainer, self.head, self.redis, self.switch):
            ns.stop()


@attrs.define
class Driver:
    """The trainer: ``tests.fleet.driver`` in the trainer's namespace, one JSON line per call."""

    proc: subprocess.Popen[bytes]
    pending: bytes = b""

    def call(self, op: str, timeout: float = 300, **args: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            line, newline, rest = self.pending.partition(b"\n")
            if newline:
                self.pending = rest
                if line.startswith(b"@reply "):
                    break
                continue
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                raise AssertionError(f"the driver did not answer {op} within {timeout:g}s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"the driver ended during {op} (see driver.log)")
            self.pending += chunk
        reply = json.loads(line[len(b"@reply ") :])
        if "error" in reply:
            raise AssertionError(f"driver {op}: {reply['error']}")
        return reply["result"]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("quit", timeout=60)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=60)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def net_cluster(root: str, bottles: Sequence[int], **kw: Any) -> Iterator[NetCluster]:
    cluster = NetCluster(root, bottles, **kw)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
