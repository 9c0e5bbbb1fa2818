"""Contract tests: the argv vmctl generates, through the REAL smolvm CLI and through the fake.

The real CLIs are every tested version (``tests/vmctl/realclis.py``: 1.32.2 and 1.37.3, the
venv's wheel and ``.smolvm/<version>`` prefixes that ``.ci/run`` installs); each test runs
against each, with the fake playing the same version. Nothing here boots a VM (these hosts
cannot): every call is one that needs no KVM, plus one ``machine start`` that must fail with a
KVM error on a host without usable KVM. Each case runs the same argv (built by vmctl's own argv
functions, with the features each binary reports) through both binaries, each in its own fresh
state directory, and checks that they agree: accepted or refused, the ``--error-format json``
code, the class vmctl's :func:`classify` gives, and the shape of ``ls --json`` / ``status
--json`` as vmctl parses it. Where they disagree the fake is wrong and gets fixed."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from bottlenet.bottles.creation import (
    agent_machine_spec,
    sidecar_guest_socket,
    sidecar_machine_spec,
    sidecar_socket_path,
)
from bottlenet.bottles.isolation import AGENT_WAIT_COMMAND
from bottlenet.bottles.model import SocketEndpoint
from bottlenet.bottles.spec import BottleSpec, parse_bottle_spec
from bottlenet.bottles.vmmaccess import read_started_uid
from bottlenet.forward.spec import bottle_dir
from tests.fakes import FAKE_SMOLVM, FAST_PATH
from tests.vmctl.realclis import VERSIONS, real_install, versions
from tests.vmctl.wheeltemplates import real_templates
from vmctl.errors import (
    AlreadyExists,
    KvmUnavailable,
    NotFound,
    NotRunning,
    SmolvmFailed,
    UsageError,
    classify,
    json_error,
    strip_notes,
)
from vmctl.install import SmolvmInstall
from vmctl.ports import pid_alive
from vmctl.runner import build_env
from vmctl.smolvm import MIN_VERSION, Features, Machine, SmolvmVersion, machine_argv
from vmctl.spec import (
    ExposeSocket,
    MachineSpec,
    PortMapping,
    Volume,
    create_args,
    exec_args,
)
from vmctl.uidranges import Block
from vmctl.uids import LAST_RESERVED, registered_vm_uid, registry_of, reserve_vm_uid

__all__ = ["real_templates"]  # the fixture (tests/vmctl/wheeltemplates.py)

#: The faults' version key: the fake plays the real CLI's version in each contract test.
V137 = (1, 37, 0)
LABELS = (("bottlenet.owner", "c0ffee"), ("bottlenet.bottle", "b1"), ("bottlenet.role", "agent"))


#: The features each binary's ``--help`` reports, read from it once per session (its help
#: text is fixed; every test builds its argv from these, and
#: ``test_version_is_supported_and_features_agree`` checks them).
_FEATURES: dict[tuple[str, str], Features] = {}


class CLI:
    """One smolvm binary, its own state directory, and the features it reports."""

    def __init__(
        self, kind: str, install: SmolvmInstall, state_dir: str, home: str, version: str
    ) -> None:
        self.kind = kind
        self.install = install
        self.state_dir = state_dir
        self.tier = version
        if kind == "fake":
            self.fake_faults()
        # The fake reads its faults (its version) from its data dir: for the calls without
        # --state-dir (--version, --help) that is SMOLVM_DATA_DIR, as vmctl passes it.
        data_dir = state_dir if kind == "fake" else None
        self.env = build_env({"PATH": FAST_PATH, "HOME": home, "LANG": "C.UTF-8"}, data_dir,
                             install.env())  # fmt: skip
        if (install.binary, version) not in _FEATURES:
            create_help = self.raw(["machine", "create", "--help"]).stdout
            exec_help = self.raw(["machine", "exec", "--help"]).stdout
            _FEATURES[install.binary, version] = Features.from_help(create_help, exec_help)
        self.features = _FEATURES[install.binary, version]

    def fake_faults(self, *fail: str) -> None:
        """The fake's ``fake-faults.json``: its version (the real CLI's) and ``fail`` names."""
        os.makedirs(self.state_dir, exist_ok=True)
        with open(os.path.join(self.state_dir, "fake-faults.json"), "w") as fh:
            json.dump({"version": self.tier, "fail": list(fail)}, fh)

    @property
    def v137(self) -> bool:
        return SmolvmVersion.parse(f"smolvm {self.tier}".encode()).triple >= V137

    def raw(self, args: Sequence[str], timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
        r = subprocess.run(
            [self.install.binary, *args],
            env=self.env,
            capture_output=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        return subprocess.CompletedProcess(r.args, r.returncode, r.stdout, strip_notes(r.stderr))

    def machine(self, sub: str, *rest: str, timeout: float = 120) -> Outcome:
        argv = machine_argv(self.features, self.state_dir, sub, rest)
        return Outcome(self.raw(argv, timeout), f"machine {sub}")

    def version(self) -> SmolvmVersion:
        return SmolvmVersion.parse(self.raw(["--version"]).stdout)


class Outcome:
    """What one call did, in the terms vmctl uses."""

    def __init__(self, r: subprocess.CompletedProcess[bytes], what: str) -> None:
        self.r = r
        self.ok = r.returncode == 0
        found = json_error(r.stderr)
        self.code = found[0] if found else None
        self.error: SmolvmFailed | None = (
            None if self.ok else classify(r.stderr, r.returncode, what)
        )

    def kind(self) -> tuple[bool, str | None, type | None]:
        return (self.ok, self.code, type(self.error) if self.error else None)

    def json(self) -> Any:
        return json.loads(self.r.stdout)


@pytest.fixture(params=VERSIONS)
def clis(request: pytest.FixtureRequest) -> Iterator[dict[str, CLI]]:
    """The real CLI of one tested version and the fake playing it, each with its own state
    dir; every machine deleted after.

    The state dirs are short on purpose: smolvm keeps per-machine UNIX sockets 46 bytes below
    its state dir, within the 107-byte limit (pytest's tmp_path is too long for it).
    """
    version: str = request.param
    real = real_install(version)
    fake = SmolvmInstall(FAKE_SMOLVM, "option")
    top = Path(tempfile.mkdtemp(prefix="bn-c-", dir="/tmp"))
    out = {}
    for kind, install in (("real", real), ("fake", fake)):
        base = top / kind
        (base / "home").mkdir(parents=True)
        out[kind] = CLI(kind, install, str(base / "s"), str(base / "home"), version)
    yield from _cleaned(out, top)


def _cleaned(out: dict[str, CLI], top: Path) -> Iterator[dict[str, CLI]]:
    try:
        yield out
    finally:
        _teardown(out, top)


def _teardown(out: dict[str, CLI], top: Path) -> None:
    for cli in out.values():
        listed = cli.machine("ls", "--json")
        for m in listed.json() if listed.ok else []:
            cli.machine("stop", "--name", m["name"])
            cli.machine("delete", "--name", m["name"], "-f")
    fake_pids = top / "fake" / "s" / "fake-pids.txt"
    survivors = []
    if fake_pids.exists():
        survivors = [
            int(line.split()[0])
            for line in fake_pids.read_text().split("\n")
            if line.strip() and pid_alive(int(line.split()[0]))
        ]
    shutil.rmtree(top, ignore_errors=True)
    assert not survivors, f"fake VMMs outlived their machines: {survivors}"


def both(clis: dict[str, CLI], sub: str, *rest: str) -> tuple[Outcome, Outcome]:
    return clis["real"].machine(sub, *rest), clis["fake"].machine(sub, *rest)


def agree(clis: dict[str, CLI], sub: str, *rest: str) -> Outcome:
    real, fake = both(clis, sub, *rest)
    assert real.kind() == fake.kind(), (
        f"real and fake disagree on machine {sub} {' '.join(rest)}: real {real.kind()} "
        f"{real.r.stderr[-300:]!r}; fake {fake.kind()} {fake.r.stderr[-300:]!r}"
    )
    return real


def make_tar(path: Path) -> str:
    """A small local image archive (smolvm stages it by content at create)."""
    (path.parent / "layer.txt").write_text("layer\n")
    with tarfile.open(path, "w") as tf:
        tf.add(path.parent / "layer.txt", arcname="layer.txt")
    return str(path)


# -- version and features -----------------------------------------------------------------


def test_version_is_supported_and_features_agree(clis: dict[str, CLI]) -> None:
    real, fake = clis["real"], clis["fake"]
    assert real.version() >= SmolvmVersion(*MIN_VERSION)
    assert str(real.version()) == real.tier  # the tier's version, a tested one
    assert real.version().tested
    assert real.version() == fake.version()
    assert real.features == fake.features
    # Everything vmctl uses from 1.32 is there, detected from the real --help.
    assert real.features.names() == sorted(
        ["error_format_json", "state_dir", "expose_socket", "user", "exec_timeout", "exec_user",
         "block_private"]
    )  # fmt: skip


def test_fake_models_older_versions(tmp_path: Path) -> None:
    """Version-dependent flags: a fake 1.9.3 has no --error-format/--state-dir/--user."""
    env = {"PATH": FAST_PATH, "HOME": str(tmp_path), "FAKE_SMOLVM_VERSION": "1.9.3"}
    helps = [
        subprocess.run([FAKE_SMOLVM, "machine", sub, "--help"], env=env, capture_output=True)
        for sub in ("create", "exec")
    ]
    f = Features.from_help(helps[0].stdout, helps[1].stdout)
    assert f == Features(expose_socket=True, exec_timeout=True)
    r = subprocess.run(
        [FAKE_SMOLVM, "machine", "create", "--name", "x", "--user", "1000"],
        env=env,
        capture_output=True,
    )
    assert r.returncode == 2
    env["FAKE_SMOLVM_VERSION"] = "1.7.7"
    r = subprocess.run(
        [FAKE_SMOLVM, "machine", "create", "--name", "x", "--label", "a=b"],
        env=env,
        capture_output=True,
    )
    assert r.returncode == 2 and b"--label" in r.stderr


# -- the machine create argv bottlenet generates -------------------------------------------


def _bottle(tmp: Path, listen: str = "unix") -> BottleSpec:
    image = make_tar(tmp / "agent.tar")
    vol = tmp / "work"
    vol.mkdir(exist_ok=True)
    return parse_bottle_spec(
        "b1",
        {
            "mode": "socket",
            "sidecar": {
                "image": "alpine",
                "listen": listen,
                "service": [
                    {
                        "name": "proxy",
                        "guest_port": 3128,
                        "env": ["HTTPS_PROXY=http://{host}:{port}"],
                    },
                    {"name": "git", "guest_port": 9418},
                ],
            },
            "agent": {"image": image, "volumes": [f"{vol}:/work:ro"], "user": "1000:1000"},
        },
    )


def sidecar_spec(tmp: Path, features: Features) -> MachineSpec:
    """The sidecar exactly as the lifecycle builds it: services on exposed UNIX sockets."""
    bottle = _bottle(tmp)
    assert bottle.sidecar is not None
    state = str(tmp / "st")
    os.makedirs(bottle_dir(state, "b1"), mode=0o700, exist_ok=True)
    sockets = [
        ExposeSocket(sidecar_guest_socket(s.name), sidecar_socket_path(state, "b1", s.name))
        for s in bottle.sidecar.services
    ]
    return sidecar_machine_spec("bn-b1-sidecar", bottle.sidecar, LABELS, sockets=sockets)


def sidecar_tcp_spec(tmp: Path, features: Features) -> MachineSpec:
    """The raw-port opt-in sidecar (``sidecar.listen = "tcp"``), as the lifecycle builds it."""
    bottle = _bottle(tmp, listen="tcp")
    assert bottle.sidecar is not None
    ports = [PortMapping(38401, 3128), PortMapping(38402, 9418)]
    return sidecar_machine_spec("bn-b2-sidecar", bottle.sidecar, LABELS, ports=ports)


def agent_spec(tmp: Path) -> MachineSpec:
    """The socket-mode agent as the lifecycle builds it: local image, mounted endpoints, no
    network, bottlenet's wait command as its workload (its ENTRYPOINT never runs early)."""
    bottle = _bottle(tmp)
    assert bottle.agent is not None
    state = str(tmp / "st")
    endpoints = [
        SocketEndpoint(svc, port, os.path.join(bottle_dir(state, "b1"), f"{svc}.sock"),
                       f"/run/bottle/{svc}.sock", f"/s/sidecar/{svc}.sock")
        for svc, port in (("proxy", 3128), ("git", 9418))
    ]  # fmt: skip
    env = (("HTTPS_PROXY", "http://127.0.0.1:3128"),)
    volumes = [Volume.parse(v) for v in bottle.agent.volumes]  # as resolved at create
    return agent_machine_spec("bn-b1-agent", bottle.agent, LABELS, env, endpoints, volumes)


def test_bottlenet_create_argvs_accepted_and_listed_alike(
    clis: dict[str, CLI], tmp_path: Path
) -> None:
    features = clis["real"].features
    specs = [sidecar_spec(tmp_path, features), sidecar_tcp_spec(tmp_path, features),
             agent_spec(tmp_path)]  # fmt: skip
    for spec in specs:
        out = agree(clis, "create", *create_args(spec)[2:])
        assert out.ok, out.r.stderr
    listings = {k: c.machine("ls", "--json") for k, c in clis.items()}
    parsed = {}
    for kind, out in listings.items():
        assert out.ok
        raw = out.json()
        assert isinstance(raw, list)
        for obj in raw:
            # Every key vmctl reads is present, with the JSON type vmctl expects.
            for key, types in READ_KEYS.items():
                assert key in obj, (kind, key)
                assert isinstance(obj[key], types), (kind, key, obj[key])
        parsed[kind] = {m.name: m for m in map(Machine.from_json, raw) if m is not None}
    assert parsed["real"].keys() == parsed["fake"].keys() == {s.name for s in specs}
    for name, real in parsed["real"].items():
        fake = parsed["fake"][name]
        assert (real.state, real.pid, real.ports, real.mounts, real.network, real.cmd) == (
            fake.state,
            fake.pid,
            fake.ports,
            fake.mounts,
            fake.network,
            fake.cmd,
        ), name
        assert dict(real.labels) == dict(fake.labels) == dict(LABELS)
        assert real.state == "created" and real.pid is None
        assert real.image is not None and fake.image is not None
        assert real.image.startswith("local:") == fake.image.startswith("local:")
    agent = parsed["real"]["bn-b1-agent"]
    assert agent.network is False and agent.cmd == AGENT_WAIT_COMMAND
    # --net --block-private: outbound for the proxy, never host loopback, LAN or metadata
    assert parsed["real"]["bn-b1-sidecar"].network is True
    assert parsed["real"]["bn-b2-sidecar"].network is True
    assert parsed["real"]["bn-b2-sidecar"].ports == 2
    for kind, cli in clis.items():
        st = cli.machine("status", "--name", "bn-b1-agent", "--json")
        assert st.ok, kind
        assert Machine.from_json(st.json()) == parsed[kind]["bn-b1-agent"]


READ_KEYS: dict[str, Any] = {
    "name": str,
    "state": str,
    "pid": (int, type(None)),
    "labels": dict,
    "ports": int,
    "mounts": int,
    "ephemeral": bool,
    "network": bool,
    "image": (str, type(None)),
    "cpus": int,
    "memory_mib": int,
    "created_at": int,
    "state_reason": (str, type(None)),
    "cmd": list,
}


# -- errors -------------------------------------------------------------------------------


def test_lifecycle_errors_classified_alike(clis: dict[str, CLI]) -> None:
    create = ["--name", "m1", "--label", "bottlenet.owner=c0ffee", "--cpus", "1", "--mem", "256"]
    assert agree(clis, "create", *create).ok
    dup = agree(clis, "create", *create)
    # 1.37: CONFLICT ("admit VM startup: machine already exists"); 1.32: CONFIG_ERROR
    v137 = clis["real"].v137
    assert isinstance(dup.error, AlreadyExists)
    assert dup.code == ("CONFLICT" if v137 else "CONFIG_ERROR")
    # exec and stop on a machine that is not running
    ex = agree(clis, "exec", *exec_args("m1", ["true"])[2:])
    assert isinstance(ex.error, NotRunning), ex.r.stderr
    ex_u = agree(clis, "exec", *exec_args("m1", ["true"], user="1000", guest_timeout=5)[2:])
    assert isinstance(ex_u.error, NotRunning)
    workload = exec_args("m1", ["/bin/agent"], {"K": "v"}, detach=True, user="1000:1000")
    assert isinstance(agree(clis, "exec", *workload[2:]).error, NotRunning)
    stop = agree(clis, "stop", "--name", "m1")
    assert stop.ok and b"is not running" in stop.r.stdout
    # status of a machine that does not exist: 1.37 NOT_FOUND; 1.32 CONFIG_ERROR, refined
    # from the message
    st = agree(clis, "status", "--name", "nope", "--json")
    assert isinstance(st.error, NotFound) and st.code == ("NOT_FOUND" if v137 else "CONFIG_ERROR")
    for sub in ("start", "stop", "exec"):
        rest = ["--name", "nope"] + (["--", "true"] if sub == "exec" else [])
        out = agree(clis, sub, *rest)
        assert isinstance(out.error, NotFound) and out.code == "NOT_FOUND", sub
    # delete twice: the second is NOT_FOUND
    assert agree(clis, "delete", "--name", "m1", "-f").ok
    again = agree(clis, "delete", "--name", "m1", "-f")
    assert isinstance(again.error, NotFound) and again.code == "NOT_FOUND"
    assert agree(clis, "ls", "--json").json() == []


def test_exec_session_argvs_reach_the_machine(clis: dict[str, CLI]) -> None:
    """What ``Exec``, ``bottle shell`` and ``bottle logs`` run (``-i``, ``-t``, ``-w``, ``-e``,
    ``--user``) passes both parsers: a machine that is not running is the answer, never a
    usage error."""
    assert agree(clis, "create", "--name", "x1", "--cpus", "1", "--mem", "256").ok
    for kw in (
        {"interactive": True},
        {"interactive": True, "tty": True},
        {"interactive": True, "tty": True, "user": "1000:1000"},
        {"user": "agent"},
    ):
        args = exec_args("x1", ["/bin/sh", "-c", "echo hi"], {"LANG": "C"}, "/work", **kw)
        out = agree(clis, "exec", *args[2:])
        assert isinstance(out.error, NotRunning), (kw, out.r.stderr)
    assert agree(clis, "delete", "--name", "x1", "-f").ok


REFUSED = [
    (["--label", "nokey"], "CONFIG_ERROR"),
    (["--label", "=v"], "CONFIG_ERROR"),
    (["--volume", "/etc:/x"], "MOUNT_ERROR"),
    (["--volume", "/usr/lib:/x"], "MOUNT_ERROR"),
    (["--volume", "/nonexistent-dir:/x"], "NOT_FOUND"),
    (["--mount-socket", "/tmp/a.sock:run/rel.sock"], "CONFIG_ERROR"),
    (["--mount-socket", "/tmp/a.sock:/run/a.sock", "--mount-socket", "/tmp/b.sock:/run/a.sock"],
     "CONFIG_ERROR"),
    (["--expose-socket", "run/x.sock:/tmp/x.sock"], "CONFIG_ERROR"),
    (["--net", "--allow-cidr", "10.0.0.1/32", "--net-backend", "tsi"], "CONFIG_ERROR"),
    (["--net", "--net-backend", "tsi", "--port", "38400:80"], "CONFIG_ERROR"),
    (["--net-backend", "virtio-net"], "CONFIG_ERROR"),
    (["--port", "38400:80", "--port", "38400:81"], "CONFIG_ERROR"),
    (["--image", "/nonexistent.tar"], "CONFIG_ERROR"),
    (["--cpus", "0"], "CONFIG_ERROR"),
    (["--mem", "10"], "CONFIG_ERROR"),
    (["--name", "a--b"], "CONFIG_ERROR"),
    (["--allow-host", "example.invalid"], "CONFIG_ERROR"),
]  # fmt: skip
USAGE = [
    ["--port", "127.0.0.1:8080:80"],
    ["--bogus"],
    ["--name", "-bad"],
    ["positional"],
]


@pytest.mark.parametrize(("extra", "code"), REFUSED, ids=lambda v: str(v)[:40])
def test_refused_create_argv_agree(clis: dict[str, CLI], extra: list[str], code: str) -> None:
    args = ["--name", "r1", *extra] if "--name" not in extra else extra
    out = agree(clis, "create", *args)
    assert not out.ok and out.code == code, out.r.stderr
    assert agree(clis, "ls", "--json").json() == []


@pytest.mark.parametrize("extra", USAGE, ids=lambda v: " ".join(v))
def test_usage_errors_agree(clis: dict[str, CLI], extra: list[str]) -> None:
    out = (
        agree(clis, "create", "--name", "u1", *extra)
        if extra[0] != "--name"
        else agree(clis, "create", *extra)
    )
    assert isinstance(out.error, UsageError) and out.r.returncode == 2


def test_accepted_where_vmctl_is_stricter(clis: dict[str, CLI]) -> None:
    """smolvm accepts these; vmctl refuses them itself before spawning (documented)."""
    for i, extra in enumerate(
        [
            ["--expose-socket", "/run/x.sock:relative/x.sock"],
            ["--expose-socket", "/run/x.sock:/tmp/x1.sock",
             "--expose-socket", "/run/x.sock:/tmp/y1.sock"],
            ["--env", "NOEQ"],
        ]
    ):  # fmt: skip
        assert agree(clis, "create", "--name", f"s{i}", *extra).ok


# -- the start failure on a host without usable KVM ------------------------------------------


def kvm_usable() -> bool:
    """Can a smolvm VM process use KVM here? Not as root on these hosts (uid drop) and not
    under PVM; only a host where start succeeds proves it, so this is a cheap pre-check."""
    return False if not os.path.exists("/dev/kvm") else os.environ.get("BOTTLENET_KVM") == "1"


@pytest.mark.usefixtures("real_templates")
@pytest.mark.skipif(kvm_usable(), reason="this host says its KVM boots smolvm VMs")
def test_start_without_usable_kvm_is_one_typed_error_and_leaves_nothing(
    clis: dict[str, CLI],
) -> None:
    real, fake = clis["real"], clis["fake"]
    fake.fake_faults("kvm-root" if os.geteuid() == 0 else "kvm")
    create = ["--name", "k1", "--label", "bottlenet.owner=c0ffee", "--cpus", "1", "--mem", "256"]
    assert agree(clis, "create", *create, "--", *AGENT_WAIT_COMMAND).ok
    # The first real start after an install expands the wheel's disk templates (~19 s, done
    # beforehand by real_templates); from then on the start fails on KVM within a second.
    start = {k: c.machine("start", "--name", "k1", timeout=300) for k, c in clis.items()}
    for kind, out in start.items():
        assert isinstance(out.error, KvmUnavailable), (kind, out.r.stderr[-400:])
        msg = out.error.message
        assert "KVM is not usable on this host" in msg, msg
        for noise in ("rootfs", "Usage", "KvmContext", "libkrun"):
            assert noise not in msg, msg
    assert start["real"].code == start["fake"].code
    listed = {k: c.machine("ls", "--json").json() for k, c in clis.items()}
    # 1.37 records a start whose VMM died as stopped, with the dead VMM's pid; 1.32 created.
    after = "stopped" if real.v137 and os.geteuid() == 0 else "created"
    assert [m["state"] for m in listed["real"]] == [m["state"] for m in listed["fake"]] == [after]
    if after == "stopped":
        for kind, machines in listed.items():
            assert machines[0]["pid"] is not None and not pid_alive(machines[0]["pid"]), kind
    # vmctl's undo: stop (kills a VMM a failed start left behind), then delete.
    for cli in clis.values():
        assert cli.machine("stop", "--name", "k1").ok
        assert cli.machine("delete", "--name", "k1", "-f").ok
        assert cli.machine("ls", "--json").json() == []
    assert not _vmm_processes(real.state_dir)


def _vmm_processes(state_dir: str) -> list[int]:
    """Live smolvm VM processes (``_boot-vm``) whose argv mentions ``state_dir``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if b"_boot-vm" in argv and any(state_dir.encode() in a for a in argv):
            found.append(int(pid))
    return found


# -- the privilege model as root (issue 19): what a failed start still shows ------------------

#: The first uid smolvm 1.32.2's registry hands out (``.cache/smolvm/uids/<uid>``).
FIRST_VM_UID = 2_000_000


@pytest.mark.usefixtures("real_templates")
@pytest.mark.skipif(os.geteuid() != 0, reason="smolvm drops to per-VM uids only as root")
@pytest.mark.skipif(kvm_usable(), reason="this host says its KVM boots smolvm VMs")
@pytest.mark.parametrize("kind", ["real", "fake"])
def test_root_start_runs_the_vmm_as_a_per_vm_uid(clis: dict[str, CLI], kind: str) -> None:
    """smolvm 1.32.2 as root, and the fake with ``uid-drop``: uid from a registry at start
    (honouring a reserved entry), ``.vm-uid``, VM dir chowned, o+x added to every ancestor,
    exposed-socket paths reached as that uid; the entry kept by stop, freed by delete."""
    cli = clis[kind]
    state = Path(cli.state_dir)
    top = state.parent  # the fixture's /tmp/bn-c-*/<kind>, 0755 from mkdir
    os.chmod(top, 0o700)
    if kind == "fake":
        cli.fake_faults("uid-drop")
    closed = top / "closed"  # root's, 0700: no way in for the VMM's uid
    closed.mkdir(mode=0o700)
    exposed = closed / "svc.sock"
    bdir = top / "b"
    bdir.mkdir(mode=0o700)
    own_dir = bdir / "vmm"  # made for the VMM's uid before its start
    own_dir.mkdir(mode=0o700)
    granted = own_dir / "svc2.sock"
    create = ["--name", "u1", "--cpus", "1", "--mem", "256"]
    create += ["--expose-socket", f"/run/svc.sock:{exposed}"]
    create += ["--expose-socket", f"/run/svc2.sock:{granted}"]
    assert cli.machine("create", *create, "--", *AGENT_WAIT_COMMAND).ok
    vm_dir = Path(cli.raw(["machine", "data-dir", "--state-dir", str(state), "--name", "u1"])
                  .stdout.decode().strip())  # fmt: skip
    uids = state / ".cache" / "smolvm" / "uids"
    assert not (vm_dir / ".vm-uid").exists()  # nothing is decided at create
    # A registry entry naming this VM is honoured at start: the uid can be reserved beforehand,
    # also outside smolvm's own range (bottlenet's blocks lie above it: vmctl.uidranges).
    reserved = Block(1).first + 123
    uids.mkdir(parents=True, exist_ok=True)
    (uids / str(reserved)).write_text(vm_dir.name)
    os.chown(own_dir, reserved, reserved)
    os.chmod(bdir, 0o701)  # the VMM uid may pass through to its own directory, nothing more
    out = cli.machine("start", "--name", "u1", timeout=300)
    if kind == "real":
        assert isinstance(out.error, KvmUnavailable), out.r.stderr[-400:]
    else:
        assert out.ok, out.r.stderr[-400:]
        vmm = cli.machine("status", "--name", "u1", "--json").json()["pid"]
        assert os.stat(f"/proc/{vmm}").st_uid == reserved  # the "VMM" really dropped
        sock = os.lstat(granted)  # bound as that uid, in its own directory
        assert stat.S_ISSOCK(sock.st_mode) and sock.st_uid == reserved
    assert (vm_dir / ".vm-uid").read_text().strip() == str(reserved)
    st = os.stat(vm_dir)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (reserved, reserved, 0o700)
    # o+x added to each ancestor that lacked it (the VMM uid must reach its VM dir); no more.
    assert os.stat(top).st_mode & 0o7777 == 0o701
    # The VMM prepares --expose-socket host paths after the drop, as its uid: in a root 0700
    # directory that fails and smolvm only logs "failed to add published socket ... disabled"
    # and goes on; in a directory of that uid's it passes (the real bind comes after KVM
    # setup, which these hosts never reach).
    log = (vm_dir / "agent-startup-error.log").read_text(errors="replace")
    disabled = [line for line in log.splitlines() if "failed to add published socket" in line]
    assert len(disabled) == 1 and str(exposed) in disabled[0], log[-600:]
    assert str(granted) not in log
    assert not exposed.exists()
    assert cli.machine("stop", "--name", "u1").ok
    assert (uids / str(reserved)).exists()  # kept across stop: the same uid at the next start
    assert cli.machine("delete", "--name", "u1", "-f").ok
    assert not (uids / str(reserved)).exists()


@pytest.mark.usefixtures("real_templates")
@pytest.mark.skipif(os.geteuid() != 0, reason="smolvm drops to per-VM uids only as root")
@pytest.mark.skipif(kvm_usable(), reason="this host says its KVM boots smolvm VMs")
@pytest.mark.parametrize("kind", ["real", "fake"])
def test_vmctl_reservation_is_the_uid_start_uses(clis: dict[str, CLI], kind: str) -> None:
    """``vmctl.uids``: the registry it finds from ``machine data-dir`` is smolvm's, the entry it
    writes (from the data dir's own block, next to another VM's entry) is the uid the start
    drops to, its ``.vm-uid`` says so (read as the daemon reads it, through ``open_regular``)
    and the registry still names it: the daemon knows the VMM's uid before the VMM exists."""
    cli = clis[kind]
    state = Path(cli.state_dir)
    if kind == "fake":
        cli.fake_faults("uid-drop")
    assert cli.machine("create", "--name", "r1", "--cpus", "1", "--mem", "256").ok
    vm_dir = cli.raw(["machine", "data-dir", "--state-dir", str(state), "--name", "r1"])
    vm = vm_dir.stdout.decode().strip()
    uids = state / ".cache" / "smolvm" / "uids"
    assert registry_of(vm) == str(uids)
    uids.mkdir(parents=True, exist_ok=True)
    (uids / str(Block(1).first)).write_text("another-vm")  # taken: the next one is ours
    assert not os.path.exists(os.path.join(vm, ".vm-uid"))
    ledger = str(state.parent / "ledger")
    reserved = reserve_vm_uid(vm, ledger=ledger)
    assert reserved == Block(1).first + 1
    assert reserve_vm_uid(vm, ledger=ledger) == reserved  # idempotent: the entry naming the VM
    out = cli.machine("start", "--name", "r1", timeout=300)
    if kind == "real":
        assert isinstance(out.error, KvmUnavailable), out.r.stderr[-400:]
    else:
        assert out.ok, out.r.stderr[-400:]
    assert read_started_uid(os.path.join(vm, ".vm-uid")) == reserved
    assert registered_vm_uid(vm) == reserved
    assert cli.machine("stop", "--name", "r1").ok
    assert cli.machine("delete", "--name", "r1", "-f").ok
    assert sorted(e for e in os.listdir(uids) if e.isdigit()) == [str(Block(1).first)]
    assert LAST_RESERVED in os.listdir(uids)  # bottlenet's own files, beside smolvm's
    assert registered_vm_uid(vm) is None


#: The phrase smolvm's CLI ends an attached session with when its VM goes away (1.9.3
#: ``src/agent/client.rs`` ``interactive_session``).
VM_LOST_PHRASE = b"connection to VM lost"


@versions
def test_vm_lost_text_is_the_real_binarys(tmp_path: Path, version: str) -> None:
    """Fidelity item 6: each real binary holds the lost-VM phrase, and the fake ends an
    attached session with it (exit 1) when its VM dies mid-session."""
    with open(real_install(version).binary, "rb") as fh:
        assert VM_LOST_PHRASE in fh.read()
    env = {"PATH": FAST_PATH, "SMOLVM_DATA_DIR": str(tmp_path), "FAKE_SMOLVM_VERSION": version}

    def fake(*args: str, **kw: Any) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [FAKE_SMOLVM, "machine", *args], env=env, capture_output=True, timeout=60, **kw
        )

    assert fake("create", "--name", "m1").returncode == 0
    assert fake("start", "--name", "m1").returncode == 0
    session = subprocess.Popen(
        [
            FAKE_SMOLVM,
            "machine",
            "exec",
            "--name",
            "m1",
            "-i",
            "--",
            "sh",
            "-c",
            "echo up; sleep 300",
        ],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert session.stdout is not None and session.stdout.readline() == b"up\n"
        assert fake("stop", "--name", "m1").returncode == 0
        _, err = session.communicate(timeout=60)
        assert session.returncode == 1 and VM_LOST_PHRASE in err, err
    finally:
        if session.poll() is None:
            session.kill()
        fake("delete", "--name", "m1", "-f")


def _agent_binary(version: str) -> bytes:
    """The guest agent (``usr/local/bin/smolvm-agent`` in the wheel's agent rootfs)."""
    archive = os.path.join(os.path.dirname(real_install(version).binary), "agent-rootfs.tar.zst")
    unpacked = subprocess.run(["zstd", "-dc", archive], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(unpacked)) as tf:
        member = tf.extractfile("./usr/local/bin/smolvm-agent")
        assert member is not None
        return member.read()


@pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd CLI")
@versions
def test_interactive_session_end_spares_the_command_in_the_real_agent(version: str) -> None:
    """Fidelity item 5, as far as strings show it: the 1.32.2 agent still ends a container's
    interactive session by killing its process (``crun exec``), as 1.9.3's
    ``run_interactive_loop`` does, while only its direct VM exec kills a process group. The
    fake models the former (``end_session``); bottlenet's session wrapper answers it."""
    agent = _agent_binary(version)
    assert b"interactive command timed out, killing process" in agent
    assert b"host disconnected during interactive exec" in agent
    # 1.37's direct VM exec says "killing it" (1.32: "killing process group")
    v137 = SmolvmVersion.parse(f"smolvm {version}".encode()).triple >= V137
    direct = b"killing it" if v137 else b"killing process group"
    assert b"VM exec command timed out, " + direct in agent


# -- the agent rootfs variable (issue 35: 1.37 reads SMOLVM_AGENT_ROOTFS as a directory only) --


@pytest.mark.usefixtures("real_templates")
@pytest.mark.skipif(kvm_usable(), reason="this host says its KVM boots smolvm VMs")
def test_the_rootfs_tarball_goes_where_each_cli_reads_it(clis: dict[str, CLI]) -> None:
    """Each CLI reads the tarball from SMOLVM_AGENT_ROOTFS_TAR (a missing one: ``stat rootfs
    tar``, real and fake alike), vmctl passes it there, and the tarball in
    SMOLVM_AGENT_ROOTFS fails every 1.37 start with ``Not a directory`` (1.32 took it)."""
    real = clis["real"]
    tarball = real.install.agent_rootfs
    assert tarball is not None and tarball.endswith(".tar.zst")
    assert real.install.rootfs_var == "SMOLVM_AGENT_ROOTFS_TAR"
    assert real.install.env()["SMOLVM_AGENT_ROOTFS_TAR"] == tarball
    assert "SMOLVM_AGENT_ROOTFS" not in real.install.env()
    for cli in clis.values():
        assert cli.machine("create", "--name", "t1", "--cpus", "1", "--mem", "256").ok
    base = {k: v for k, v in real.env.items() if not k.startswith("SMOLVM_AGENT_ROOTFS")}
    cases = [
        ({"SMOLVM_AGENT_ROOTFS_TAR": "/nonexistent/rootfs.tar.zst"}, "stat rootfs tar"),
        ({"SMOLVM_AGENT_ROOTFS": tarball}, "Not a directory" if real.v137 else None),
    ]
    for extra, phrase in cases:
        outs = {}
        for kind, cli in clis.items():
            argv = machine_argv(cli.features, cli.state_dir, "start", ["--name", "t1"])
            r = subprocess.run(
                [cli.install.binary, *argv],
                env={**base, **extra},
                capture_output=True,
                timeout=300,
                stdin=subprocess.DEVNULL,
            )
            outs[kind] = Outcome(
                subprocess.CompletedProcess(r.args, r.returncode, r.stdout, strip_notes(r.stderr)),
                "machine start",
            )
            cli.machine("stop", "--name", "t1")
        if phrase is None:  # 1.32 with the tarball in the old variable: on to KVM
            assert isinstance(outs["real"].error, KvmUnavailable), outs["real"].r.stderr[-300:]
            continue
        for kind, out in outs.items():
            assert isinstance(out.error, SmolvmFailed), (kind, out.r.stderr[-300:])
            assert not isinstance(out.error, KvmUnavailable), kind
            assert phrase in out.error.message, (kind, out.error.message)


def test_block_private_help_still_closes_host_loopback(clis: dict[str, CLI]) -> None:
    """The sidecar's floor: ``--block-private`` still names the host's loopback (1.37 made
    host loopback reachable by default without it), and ``--auto-ports`` (1.37: every guest
    listener published on host loopback) is in no argv bottlenet builds."""
    text = clis["real"].raw(["machine", "create", "--help"]).stdout.decode()
    para = text[text.index("--block-private") :][:400]
    assert "the host's loopback" in para, para
    assert ("--auto-ports" in text) == clis["real"].v137


def test_egress_events_where_the_cli_has_them(clis: dict[str, CLI]) -> None:
    """``machine egress-events --json --limit N`` (1.32.2 and 1.37.3): a JSON array, ``[]``
    for a machine that never booted and for one that does not exist (exit 0), real and fake
    alike."""
    assert agree(clis, "create", "--name", "e1", "--net", "--block-private").ok
    for name in ("e1", "nope"):
        out = agree(clis, "egress-events", "--name", name, "--json", "--limit", "50")
        assert out.ok and out.json() == [], out.r.stderr
