"""FAKE smolvm: a TEST DOUBLE of the smolvm 1.32.2 CLI, and of 1.37.3 where it differs (its
version knob, ``V137``). It is not smolvm and isolates nothing.

This is the fake's body; run it through its launcher ``tests/fakes/smolvm`` (the executable
every test names), which runs this module from a byte-compiled cache: the fake is a new process
for every smolvm call, so nothing here is imported before a command needs it (``_Lazy``).

It reproduces the argv forms, output lines, exit codes, ``--error-format json`` codes and
process model that bottlenet's vmctl relies on, so the real spawn path can be tested on a host
where no VM boots. ``tests/vmctl/test_contract.py`` runs the same argv through the real CLI
(the ``smolmachines`` wheel) and this fake and fails where they disagree:

* state lives under ``--state-dir`` (or ``$SMOLVM_DATA_DIR``): a JSON file guarded by flock
  for each read-modify-write only, plus per-VM dirs; a ``start`` holds the machine's own
  ``vm.lock`` and a ``stop`` or ``delete`` its ``.NAME.fork-operation.lock`` for the whole
  boot or stop, as the real CLIs do, so two machines start and stop at once;
* the flags it accepts depend on its version (``FLAGS_SINCE``): ``--label`` from 1.8.0,
  ``--error-format``/``--state-dir``/``--user``/``--block-private`` from 1.32.0 (the fake's
  model: 1.9.3 lacks them, 1.32.2 has them), and ``--help`` lists exactly those;
* ``machine start`` runs a real detached "VM" process (this script's ``_boot-vm``) in its own
  process group with stdio on /dev/null. It writes ``agent.pid`` first and records the machine
  ``running`` only once the "agent" is ready (as smolvm does), so a start killed half-way leaves
  an orphan VMM behind a ``created`` record that only ``stop`` kills. The VM listens on every
  published host port on 127.0.0.1 (and ::1 when possible, or on ``$SMOLVM_PUBLISH_ADDR``) and
  on every ``--expose-socket`` host path, and echoes. Then it launches the machine's workload:
  the create ``-- COMMAND``, else the image's ENTRYPOINT+CMD from ``fake-images.json``
  (``{"IMAGE": {"entrypoint": [...], "cmd": [...]}}``), on the host, detached;
* ``machine exec`` runs the command ON THE HOST with the ``-e`` variables (as ``-u UID`` when
  root and the user is numeric). There is no VM and no isolation whatsoever: never point
  anything but tests at this file.

Every call is appended to ``$SMOLVM_DATA_DIR/calls.jsonl`` (argv, all SMOLVM_* variables,
HOME and the names of every environment variable). Every process it starts is appended to
``fake-pids.txt`` so a test fixture can kill them all.

Faults are injected with ``$SMOLVM_DATA_DIR/fake-faults.json`` (works through a runner that
scrubs the environment) or ``FAKE_SMOLVM_FAIL=a,b`` / ``FAKE_SMOLVM_VERSION=X.Y.Z``. Keys:
``fail`` (list of: kvm, kvm-denied, kvm-root, port-clash, slow-start, crash-after-start,
ignore-term, device-budget, exec-netns, unreachable, uid-drop, no-nftables), ``version``,
``port_clash`` (how many starts fail with a foreign EADDRINUSE), ``slow_start`` (s),
``ready_timeout`` (s), ``boot_hold`` (machine names whose "VM" boots only once the test
writes ``boot-release`` into its VM dir), ``crash_after`` (s), ``stop_grace`` (s),
``device_budget`` (int),
``fail_start`` (machine names whose start fails as if KVM were missing), ``unreachable``
(machine names reported ``unreachable`` while their VMM lives; the ``unreachable`` fail name
means every machine), ``volume_swap`` ({GUEST: HOST}: under ``exec-netns`` the guest finds
HOST at a volume's GUEST path instead of what was mounted), ``agent_connections`` (the guest
agent's limit on connections at once, default 8 as smolvm 1.9.3's; 0: none),
``expose_ready_after`` (s during which exposed services drop connections after the start),
``expose_never_ready`` (guest paths of exposed services that never answer).
What is modelled of a booted VM always (issue 27): an ``-i`` session's end or ``--timeout``
kills only the "crun exec" wrapper (the command lives on), every exec's command dies with its
VM and the CLI says ``connection to VM lost`` (exit 1), and under ``uid-drop`` a mounted socket
the "VMM" cannot connect hangs in the guest. docs/smolvm.md has the table, with sources.
``kvm-root`` is the real 1.32.2 text of a root daemon whose VM process cannot open /dev/kvm.
``uid-drop`` (as root) is 1.32.2's per-VM uid model: the uid from a registry at start
(``.cache/smolvm/uids``, 2000000 up, a reserved entry honoured), ``.vm-uid``, the VM dir
chowned, o+x on the registry's ancestors, the "VMM" drops to that uid before it binds its
exposed sockets (one it cannot create is logged and disabled, as smolvm does); ``delete``
frees the uid; the "VMM" of a machine with ``--mount-socket``s connects to each host path
itself, as its uid, for every guest connection (with ``exec-netns`` its relay socket is
what the guest path shows). Off by default: the rest of the suite models ``one uid``.

``no-nftables`` stands in for a guest kernel built without nf_tables: every ``exec``
runs under a seccomp filter that fails ``socket(AF_NETLINK, *, NETLINK_NETFILTER)`` with
EPROTONOSUPPORT, as such a kernel does (the host's kernel has it; this is how it looks
without).

``exec-netns`` is an *isolating stand-in* for a network-less VM, for tests only: ``exec`` of a
machine created without ``--net`` runs the command in a fresh network namespace (only its
own loopback) and a private mount namespace where ``/run`` is a new tmpfs and every
``--mount-socket HOST:GUEST`` host socket is bind-mounted at its GUEST path (which must lie
under ``/run``); ``$HOME`` is an empty tmpfs there and ``/tmp`` the machine's own directory
(empty at create, kept across its execs, as a VM's filesystem keeps it), and the machine-id
and hostname are the "guest's" own (so the launch gate's filesystem checks can pass). It needs root
(``unshare``). Still not a VM: same kernel, the rest of the host's filesystem.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import stat
import struct
import sys
import time
from collections.abc import Callable


class _Lazy:
    """A module imported on first use: each call of the fake is a process of its own, and most
    calls need few of these (``--version`` and ``ls`` none, ``create`` hashlib only)."""

    def __init__(self, name: str) -> None:
        self._lazy_name = name

    def __getattr__(self, attr: str) -> object:
        module = __import__(self._lazy_name)
        globals()[self._lazy_name] = module  # later uses find the module itself
        return getattr(module, attr)


def _import_all_now() -> None:
    """Every ``_Lazy`` module imported at once: the "VMM" needs them after its uid drop, as a
    uid that may not read the interpreter's library (``/root/...``), so it imports as root."""
    for name, value in list(globals().items()):
        if isinstance(value, _Lazy):
            globals()[name] = __import__(name)


hashlib = _Lazy("hashlib")
secrets = _Lazy("secrets")
selectors = _Lazy("selectors")
socket = _Lazy("socket")
subprocess = _Lazy("subprocess")
threading = _Lazy("threading")

VERSION = "1.32.2"
#: The first version (in this fake's model) that accepts each optional flag.
FLAGS_SINCE = {
    "--label": (1, 8, 0),
    "--error-format": (1, 32, 0),
    "--state-dir": (1, 32, 0),
    "--user": (1, 32, 0),
    "-u": (1, 32, 0),
    "--block-private": (1, 32, 0),
    "--deny-cidr": (1, 32, 0),
    "--expose-socket": (1, 6, 4),
    "--mount-socket": (1, 6, 4),
    "--allow-private": (1, 37, 0),
    "--auto-ports": (1, 37, 0),
    "--limit": (1, 32, 0),
}
#: The first version (in this fake's model) that behaves as 1.37.3 where 1.32.2 differs
#: (docs/smolvm.md, "Versions"; read from the 1.37.3 binary, its help, strings and API spec):
#: a duplicate create is CONFLICT, a missing machine's status NOT_FOUND, a failed start leaves
#: the machine ``stopped`` with its dead VMM's pid, ``SMOLVM_AGENT_ROOTFS`` must be a
#: directory, the guest's /tmp is on the machine's disk, the agent refuses an exec past its
#: limit (``exec was not admitted``) instead of queueing it, and ``status --json`` reports
#: ``block_private``.
V137 = (1, 37, 0)
#: Host sources smolvm 1.32.2 refuses for --volume (symlinks resolved first).
PROTECTED_TREES = (
    "/etc",
    "/run",
    "/proc",
    "/sys",
    "/dev",
    "/boot",
    "/usr",
    "/bin",
    "/lib",
    "/lib64",
    "/sbin",
    "/var/log",
    "/var/run",
)
PROTECTED_EXACT = ("/", "/var")
ERROR_JSON = False
DEFAULT_BUDGET = 4


class Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def fail(msg: str, code: str = "SMOLVM_ERROR") -> Exit:
    if ERROR_JSON:
        err(json.dumps({"error": {"code": code, "message": msg}}, separators=(",", ":")))
    else:
        err("Error: " + msg)
    return Exit(1)


def version_tuple() -> tuple[int, ...]:
    v = faults().get("version", VERSION)
    return tuple(int(x) for x in v.split("-")[0].split(".")[:3])


def has_flag(flag: str) -> bool:
    return version_tuple() >= FLAGS_SINCE.get(flag, (0, 0, 0))


def v137() -> bool:
    """This fake plays 1.37 or newer (:data:`V137`)."""
    return version_tuple() >= V137


def usage(msg: str, sub: str) -> Exit:
    err(f"error: {msg}\n\nUsage: smolvm {sub} [OPTIONS]\n\nFor more information, try '--help'.")
    return Exit(2)


# -- state ------------------------------------------------------------------------------


STATE_DIR: str | None = None


def data_dir() -> str:
    d = (
        STATE_DIR
        or os.environ.get("SMOLVM_DATA_DIR")
        or os.path.join(os.environ.get("HOME", "/tmp"), ".fake-smolvm")
    )
    os.makedirs(d, exist_ok=True)
    return d


def prescan(argv: list[str]) -> None:
    """``--state-dir`` and ``--error-format`` act before anything else (as clap's globals)."""
    global STATE_DIR, ERROR_JSON
    words = argv[: argv.index("--")] if "--" in argv else argv
    for i, a in enumerate(words):
        if a == "--state-dir" and i + 1 < len(words):
            STATE_DIR = os.path.abspath(words[i + 1])
        elif a.startswith("--state-dir="):
            STATE_DIR = os.path.abspath(a.partition("=")[2])
        elif a == "--error-format" and i + 1 < len(words):
            ERROR_JSON = words[i + 1] == "json"
        elif a == "--error-format=json":
            ERROR_JSON = True


def faults() -> dict:
    f: dict = {}
    path = os.path.join(data_dir(), "fake-faults.json")
    with contextlib.suppress(FileNotFoundError, ValueError):
        with open(path) as fh:
            f = json.load(fh)
    names = set(f.get("fail", []))
    names.update(x for x in os.environ.get("FAKE_SMOLVM_FAIL", "").split(",") if x)
    f["fail"] = names
    if os.environ.get("FAKE_SMOLVM_VERSION"):
        f["version"] = os.environ["FAKE_SMOLVM_VERSION"]
    return f


def save_faults(f: dict) -> None:
    f = dict(f, fail=sorted(f.get("fail", ())))
    write_json(os.path.join(data_dir(), "fake-faults.json"), f)


def write_json(path: str, obj: object) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
    os.replace(tmp, path)


@contextlib.contextmanager
def locked():
    """The state file's lock: held only for one read-modify-write of it, as the real CLIs
    hold their SQLite database's write lock for one short transaction."""
    fd = os.open(os.path.join(data_dir(), "fake-state.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


#: What ``machine start`` says when another start of the machine holds its ``vm.lock``
#: (1.32.2 and 1.37.3, run here with the lock held by hand).
ALREADY_STARTING = (
    "agent operation failed: start machine: agent operation failed: start agent: another "
    "process is already starting or running this VM"
)


@contextlib.contextmanager
def machine_lock(path: str, wait: bool = True):
    """One machine's own lock, an flock held for a whole start or stop (docs/smolvm.md,
    "Locks"): the real CLIs take ``vms/<id>/vm.lock`` (without waiting) for ``start`` and
    ``vms/.<name>.fork-operation.lock`` (waiting) for ``stop`` and ``delete``, and nothing
    that spans machines for longer than a registry write, so two machines start and stop at
    once."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise fail(ALREADY_STARTING) from None
        yield
    finally:
        os.close(fd)


def start_lock(name: str) -> str:
    return os.path.join(vm_dir(name), "vm.lock")


def stop_lock(name: str) -> str:
    return os.path.join(data_dir(), ".cache", "smolvm", "vms", f".{name}.fork-operation.lock")


def existing(name: str) -> None:
    """NOT_FOUND for a machine with no record (before any lock file is made for it)."""
    with locked():
        get(load(), name)


def commit(name: str, rec: dict) -> None:
    """Write one machine's record back, under the state lock, into the state as it is now
    (other machines' records may have changed since ``rec`` was read)."""
    with locked():
        state = load()
        if name in state["machines"]:
            state["machines"][name] = rec
            save(state)


def load() -> dict:
    try:
        with open(os.path.join(data_dir(), "fake-state.json")) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return {"machines": {}}


def save(state: dict) -> None:
    write_json(os.path.join(data_dir(), "fake-state.json"), state)


def vm_dir(name: str) -> str:
    h = hashlib.sha256(name.encode()).hexdigest()[:16]
    return os.path.join(data_dir(), ".cache", "smolvm", "vms", h)


#: smolvm 1.32.2's first per-VM uid: as root its registry hands them out from here.
FIRST_VM_UID = 2_000_000


def uid_registry() -> str:
    return os.path.join(data_dir(), ".cache", "smolvm", "uids")


def per_vm_uid(name: str) -> int | None:
    """With the ``uid-drop`` fault, as root: this VM's uid as smolvm 1.32.2 picks it at start.

    Its ``.vm-uid``, else the registry entry naming the VM (a reserved one too), else the
    lowest free uid from FIRST_VM_UID, created under the registry's allocation lock.
    """
    if os.geteuid() != 0 or "uid-drop" not in faults()["fail"]:
        return None
    d = vm_dir(name)
    known = read(os.path.join(d, ".vm-uid")).strip()
    if known.isdigit():
        return int(known)
    reg = uid_registry()
    os.makedirs(reg, exist_ok=True)
    with open(os.path.join(reg, ".allocation.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for entry in sorted(os.listdir(reg)):
            if entry.isdigit() and read(os.path.join(reg, entry)).strip() == os.path.basename(d):
                return int(entry)
        uid = FIRST_VM_UID
        while True:
            try:
                fd = os.open(
                    os.path.join(reg, str(uid)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644
                )
            except FileExistsError:
                uid += 1
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(os.path.basename(d))
            return uid


def hand_vm_dir_to(d: str, uid: int) -> None:
    """As smolvm does before the drop: ``.vm-uid``, the VM dir chowned and 0700, and o+x on
    every ancestor of the registry that lacks it (so the uid can reach its VM dir)."""
    with open(os.path.join(d, ".vm-uid"), "w") as fh:
        fh.write(str(uid))
    for root, dirs, files in os.walk(d):
        for entry in (*dirs, *files):
            os.lchown(os.path.join(root, entry), uid, uid)
    os.lchown(d, uid, uid)
    os.chmod(d, 0o700)
    path = uid_registry()
    while True:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if not mode & 0o001:
            os.chmod(path, mode | 0o001)
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def release_vm_uid(name: str) -> None:
    """``delete`` frees the VM's registry entry (``stop`` keeps it)."""
    reg, vm_id = uid_registry(), os.path.basename(vm_dir(name))
    for entry in os.listdir(reg) if os.path.isdir(reg) else ():
        if entry.isdigit() and read(os.path.join(reg, entry)).strip() == vm_id:
            os.unlink(os.path.join(reg, entry))


def record_call(argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k.startswith("SMOLVM_") or k == "HOME"}
    line = {
        "argv": argv,
        "env": env,
        "env_keys": sorted(os.environ),
        "pid": os.getpid(),
        "time": time.time(),
    }
    with open(os.path.join(data_dir(), "calls.jsonl"), "a") as fh:
        fh.write(json.dumps(line) + "\n")


def note_pid(pid: int, kind: str) -> None:
    with open(os.path.join(data_dir(), "fake-pids.txt"), "a") as fh:
        fh.write(f"{pid} {start_time(pid)} {kind}\n")


def start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return "?"


def alive(pid: int | None, started: str | None = None) -> bool:
    """A live process (zombies count as dead) with the recorded start time."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    if fields[0] in ("Z", "X"):
        return False
    return started in (None, "?") or fields[19] == started


def state_of(rec: dict) -> str:
    if rec["state"] == "running":
        if not alive(rec.get("pid"), rec.get("start_time")):
            return "stopped"
        f = faults()
        if "unreachable" in f["fail"] or rec["name"] in f.get("unreachable", []):
            return "unreachable"
    return rec["state"]


def reported_state(rec: dict) -> str:
    """What ``ls``/``status`` show: a running VM whose agent has no free connection misses
    smolvm's 250 ms state ping and is ``unreachable`` (``agent_connections``)."""
    state = state_of(rec)
    if state == "running" and not agent_answers_ping(rec["name"]):
        return "unreachable"
    return state


def to_json(rec: dict) -> dict:
    state = reported_state(rec)
    return {
        "name": rec["name"],
        "state": state,
        "state_reason": "agent did not answer a ping within 250 ms"
        if state == "unreachable"
        else None,
        "pid": rec["pid"],
        "cpus": rec["cpus"],
        "memory_mib": rec["memory_mib"],
        "mounts": len(rec["volumes"]),
        "ports": len(rec["ports"]),
        "network": rec["network"],
        "image": rec.get("shown_image", rec["image"]),
        "ephemeral": rec.get("ephemeral", False),
        "labels": rec["labels"],
        "created_at": rec["created_at"],
        "storage_gb": None,
        "overlay_gb": None,
        "entrypoint": [],
        "cmd": rec["cmd"],
        "gpu": False,
        "gpu_vram_mib": None,
        "restart_policy": "never",
        "restart_max_retries": 0,
        "restart_count": 0,
        **(v137_keys(rec) if v137() else {}),
    }


def v137_keys(rec: dict) -> dict:
    """What 1.37.3's records add: ``block_private`` (the re-opened ranges, only on a machine
    created with ``--block-private``), ``port_mappings`` and ``shared_folders``."""
    keys: dict = {
        "port_mappings": [{"host": h, "guest": g} for h, g in rec["ports"]],
        "shared_folders": [
            {"host": h, "guest": g, "mode": "ro" if ro else "rw"} for h, g, ro in rec["volumes"]
        ],
    }
    if rec.get("block_private"):
        keys["block_private"] = list(rec.get("allow_private", []))
    return keys


# -- argv parsing (a small clap look-alike) ------------------------------------------------


COMMON = {"--error-format": ("error_format", True), "--state-dir": ("state_dir", True)}


def parse(args: list[str], sub: str, spec: dict[str, tuple[str, bool]]) -> tuple[dict, list]:
    """spec maps every accepted spelling to (key, takes_value). Repeats become lists.

    Flags newer than the fake's version are unknown to it (clap's exit 2), and ``--help``
    lists exactly the flags this version accepts.
    """
    spec = {f: v for f, v in {**spec, **COMMON}.items() if has_flag(f)}
    words = args[: args.index("--")] if "--" in args else args
    if "--help" in words or "-h" in words:
        out(f"Usage: smolvm {sub} [OPTIONS]\n\nOptions:")
        for flag in sorted(spec):
            out(f"  {flag}")
        out("  -h, --help")
        raise Exit(0)
    opts: dict = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            rest = args[i + 1 :]
            break
        if not a.startswith("-") or a == "-":
            raise usage(f"unexpected argument '{a}' found", sub)
        flag, eq, inline = a.partition("=")
        if flag not in spec:
            raise usage(f"unexpected argument '{flag}' found", sub)
        key, takes = spec[flag]
        if takes:
            if eq:
                value = inline
            else:
                i += 1
                if i >= len(args):
                    raise usage(f"a value is required for '{flag} <{key.upper()}>'", sub)
                value = args[i]
                if value.startswith("-") and value != "-":
                    raise usage(f"unexpected argument '{value[:2]}' found", sub)
            opts.setdefault(key, []).append(value)
        else:
            opts[key] = True
        i += 1
    return opts, rest


def one(opts: dict, key: str, default: str | None = None) -> str | None:
    v = opts.get(key)
    return v[-1] if v else default


def parse_port(v: str) -> tuple[int, int]:
    def num(text: str, what: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise usage(
                f"invalid value '{v}' for '--port <HOST:GUEST>': invalid {what}: {text}",
                "machine create",
            ) from None
        if not 0 < n < 65536:
            raise usage(
                f"invalid value '{v}' for '--port <HOST:GUEST>': port 0 is not valid",
                "machine create",
            )
        return n

    if ":" in v:
        h, _, g = v.partition(":")
        return num(h, "host port"), num(g, "guest port")
    p = num(v, "port")
    return p, p


NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def name_problem(name: str) -> str | None:
    if not 1 <= len(name) <= 128:
        return "machine name must be 1-128 characters"
    if not set(name) <= NAME_OK:
        return "machine name may only contain [A-Za-z0-9_-]"
    if not name[0].isalnum():
        return "machine name must start with an alphanumeric character"
    if name.endswith("-") or "--" in name:
        return "machine name must not end with '-' or contain '--'"
    return None


def is_local(image: str | None) -> bool:
    return bool(image) and (
        image.startswith(("/", "./", "../"))
        or image == "-"
        or image.endswith((".tar", ".tar.gz", ".tgz"))
    )


# -- commands -----------------------------------------------------------------------------

CREATE = {
    "--name": ("name", True),
    "-n": ("name", True),
    "--label": ("label", True),
    "--image": ("image", True),
    "-I": ("image", True),
    "--from": ("from", True),
    "--cpus": ("cpus", True),
    "--mem": ("mem", True),
    "--storage": ("storage", True),
    "--overlay": ("overlay", True),
    "--volume": ("volume", True),
    "-v": ("volume", True),
    "--port": ("port", True),
    "-p": ("port", True),
    "--env": ("env", True),
    "-e": ("env", True),
    "--workdir": ("workdir", True),
    "-w": ("workdir", True),
    "--init": ("init", True),
    "--net": ("net", False),
    "--net-backend": ("net_backend", True),
    "--allow-cidr": ("allow_cidr", True),
    "--allow-host": ("allow_host", True),
    "--deny-cidr": ("deny_cidr", True),
    "--block-private": ("block_private", False),
    "--allow-private": ("allow_private", True),
    "--auto-ports": ("auto_ports", False),
    "--outbound-localhost-only": ("olo", False),
    "--mount-socket": ("mount_socket", True),
    "--expose-socket": ("expose_socket", True),
    "--user": ("user", True),
    "-u": ("user", True),
    "--smolfile": ("smolfile", True),
    "-s": ("smolfile", True),
}


def cfg_fail(msg: str) -> Exit:
    return fail("config operation failed: " + msg, "CONFIG_ERROR")


def protected(path: str) -> bool:
    real = os.path.realpath(path)
    return real in PROTECTED_EXACT or any(
        real == p or real.startswith(p + "/") for p in PROTECTED_TREES
    )


def check_socket_specs(opts: dict) -> list[list[str]]:
    """--mount-socket HOST:GUEST and --expose-socket GUEST[:HOST], checked as smolvm does."""
    mounted = []
    for spec in opts.get("mount_socket", []):
        host, sep, guest = spec.partition(":")
        if not sep or not host or not guest:
            raise cfg_fail(f"mount-socket: expected HOST_PATH:GUEST_PATH, got '{spec}'")
        if not guest.startswith("/"):
            raise cfg_fail(f"publish-socket: guest path '{guest}' must be absolute")
        if any(c in guest for c in ";|"):
            raise cfg_fail(f"publish-socket: guest path '{guest}' must not contain ';' or '|'")
        if guest in [g for _, g in mounted]:
            raise cfg_fail(f"mount-socket: guest path '{guest}' is mounted more than once")
        mounted.append([host, guest])
    exposed = []
    for spec in opts.get("expose_socket", []):
        guest, _, host = spec.partition(":")
        if not guest.startswith("/"):
            raise cfg_fail(f"publish-socket: guest path '{guest}' must be absolute")
        exposed.append([guest, host or os.path.basename(guest)])
    if len(mounted) + len(exposed) > 64:
        raise cfg_fail("publish-socket: at most 64 sockets")
    return exposed


def cmd_create(args: list[str]) -> None:
    opts, workload = parse(args, "machine create", CREATE)
    name = one(opts, "name") or "vm-" + secrets.token_hex(4)
    problem = name_problem(name)
    if problem:
        raise cfg_fail(f"create machine: {problem}")
    ports = [parse_port(p) for p in opts.get("port", [])]
    backend = one(opts, "net_backend")
    if backend not in (None, "tsi", "virtio-net"):
        raise usage(
            f"invalid value '{backend}' for '--net-backend <NET_BACKEND>'", "machine create"
        )
    labels = {}
    for lab in opts.get("label", []):
        k, sep, v = lab.partition("=")
        if not sep:
            raise cfg_fail(f"--label: expected KEY=VALUE, got '{lab}'")
        if not k:
            raise cfg_fail(f"--label: label key cannot be empty (in '{lab}')")
        labels[k] = v
    for which, limit in (("cpus", 1), ("mem", 64)):
        value = one(opts, which)
        if value is not None and (not value.isdigit() or int(value) < limit):
            raise cfg_fail(f"validate resources: {which} out of range: {value}")
    hosts = [h for h, _ in ports]
    for h in hosts:
        if hosts.count(h) > 1:
            raise cfg_fail(
                f"validate ports: duplicate host port {h}: each host port can only be mapped once"
            )
    volumes = []
    for v in opts.get("volume", []):
        parts = v.split(":")
        ro = False
        if len(parts) == 3 and parts[2] in ("ro", "rw"):
            ro = parts.pop() == "ro"
        if len(parts) != 2:
            raise fail(f"invalid volume specification: {v}", "MOUNT_ERROR")
        if not os.path.exists(parts[0]):
            raise fail(f"mount source not found: {parts[0]}", "NOT_FOUND")
        if protected(parts[0]):
            raise fail(
                "mount operation failed: validate host path: source path on host is a "
                f"protected system path and cannot be mounted: {parts[0]}",
                "MOUNT_ERROR",
            )
        if not parts[1].startswith("/"):
            raise fail(
                "mount operation failed: validate guest path: target path on guest "
                f"should be an absolute directory: {parts[1]}",
                "MOUNT_ERROR",
            )
        if not os.path.isdir(parts[0]):
            raise fail(f"mount source must be a directory: {parts[0]}", "MOUNT_ERROR")
        volumes.append([os.path.realpath(parts[0]), parts[1], ro])
    egress = bool(
        opts.get("allow_cidr")
        or opts.get("allow_host")
        or opts.get("olo")
        or opts.get("deny_cidr")
        or opts.get("block_private")
        or opts.get("allow_private")
    )
    if backend == "tsi" and ports:
        raise cfg_fail(
            "ports: published ports require the virtio-net backend (TSI is "
            "outbound-only); remove --net-backend tsi or set it to virtio-net"
        )
    if backend == "tsi" and egress:
        raise cfg_fail(
            "egress: egress policy (--allow-cidr/--allow-host/"
            "--outbound-localhost-only/--block-private) requires the virtio-net "
            "backend; TSI does not enforce it"
        )
    network = bool(opts.get("net") or egress)
    if backend == "virtio-net" and not network:
        raise cfg_fail("--net-backend: --net-backend virtio-net requires --net")
    if opts.get("allow_host"):
        # smolvm resolves every --allow-host at create; no name resolves here.
        raise cfg_fail(
            f"--allow-host: failed to resolve '{opts['allow_host'][0]}': failed to "
            "lookup address information: Name or service not known"
        )
    exposed = check_socket_specs(opts)
    image = one(opts, "image")
    source = one(opts, "from")
    if image and is_local(image) and image != "-" and not os.path.exists(image):
        raise cfg_fail(
            f"--image: cannot read archive {image}: No such file or directory (os error 2)"
        )
    if image and not is_local(image) and not network and version_tuple() < (1, 32, 0):
        raise fail(
            f"image '{image}' must be pulled from a registry, but this machine has no "
            "network (use --net)"
        )
    if source is not None:
        if not os.path.isfile(source):
            raise cfg_fail(f"create from .smolmachine: file not found: {source}")
        # A pack's own manifest `network` flag is ORed in (smolvm's run_from_smolmachine).
        with contextlib.suppress(OSError, ValueError, AttributeError):
            with open(source) as fh:
                network = network or json.load(fh).get("network") is True
    with locked():
        state = load()
        if name in state["machines"] and v137():
            raise fail(
                "agent operation failed: admit VM startup: machine already exists or is being "
                "created",
                "CONFLICT",
            )
        if name in state["machines"]:
            raise cfg_fail(f"create machine: machine '{name}' already exists or is being created")
        shown = image
        if image and is_local(image) and os.path.isfile(image):
            with open(image, "rb") as fh:  # smolvm stages local archives by content
                shown = "local:" + hashlib.sha256(fh.read()).hexdigest()
        rec = {
            "name": name,
            "state": "created",
            "pid": None,
            "start_time": None,
            "created_at": int(time.time()),
            "labels": labels,
            "shown_image": shown,
            "cpus": int(one(opts, "cpus", "4")),
            "memory_mib": int(one(opts, "mem", "8192")),
            "volumes": volumes,
            "ports": ports,
            "network": network,
            "image": image,
            "from": source,
            "env": opts.get("env", []),
            "workdir": one(opts, "workdir"),
            "cmd": workload,
            "net_backend": backend,
            "egress": egress,
            "mount_sockets": opts.get("mount_socket", []),
            "ephemeral": False,
            "expose_sockets": exposed,
            "user": one(opts, "user"),
            "block_private": bool(opts.get("block_private") or opts.get("allow_private")),
            "allow_private": opts.get("allow_private", []),
        }
        state["machines"][name] = rec
        os.makedirs(vm_dir(name), exist_ok=True)
        with open(os.path.join(vm_dir(name), "name"), "w") as fh:
            fh.write(name)
        save(state)
    out(f"Created machine: {name}")
    out(f"  CPUs: {rec['cpus']}, Memory: {rec['memory_mib']} MiB")
    if volumes:
        out(f"  Mounts: {len(volumes)}")
    if ports:
        out(f"  Ports: {len(ports)}")
    out("")
    out(f"Use 'smolvm machine start --name {name}' to start the machine")
    out(f"Then use 'smolvm machine exec --name {name} -- <command>' to run commands")


def get(state: dict, name: str) -> dict:
    rec = state["machines"].get(name)
    if rec is None:
        raise fail(f"vm not found: {name}", "NOT_FOUND")
    return rec


def check_rootfs() -> None:
    """The agent rootfs variables as the real CLIs read them at ``machine start`` (run here:
    1.32.2 and 1.37.3): ``SMOLVM_AGENT_ROOTFS_TAR`` names a tarball (both; a missing one fails
    with ``stat rootfs tar``); ``SMOLVM_AGENT_ROOTFS`` a directory in 1.37 (a tarball there
    fails every start with ``Not a directory``), a tarball or a directory in 1.32."""
    tar = os.environ.get("SMOLVM_AGENT_ROOTFS_TAR")
    if tar is not None and not os.path.isfile(tar):
        raise fail(
            "agent operation failed: create agent manager: storage operation failed: stat "
            "rootfs tar: No such file or directory (os error 2)"
        )
    rootfs = os.environ.get("SMOLVM_AGENT_ROOTFS")
    if tar is not None or rootfs is None:
        return
    if v137() and not os.path.isdir(rootfs):
        why = "Not a directory (os error 20)"
        if not os.path.exists(rootfs):
            why = "No such file or directory (os error 2)"
        raise fail(
            f"agent operation failed: start machine: agent operation failed: read agent "
            f"rootfs: {why}"
        )
    if not v137() and not os.path.exists(rootfs):
        raise fail(
            "agent operation failed: start machine: agent operation failed: verify rootfs: "
            f"agent rootfs not found: {rootfs}"
        )


#: The disk templates smolvm expands beside its binary on its first start (each from
#: ``<name>.zst``; both versions, strace).
TEMPLATES = ("storage-template.ext4", "overlay-template.ext4")


def expand_templates() -> None:
    """smolvm's first start after an install expands the templates beside its binary that
    have a ``.zst`` and no expansion (to ``<name>.partial``, then a rename), which takes 8-19 s
    (``template_unpack`` seconds here, default 0); each one it expands is appended to
    ``templates-expanded.log`` in the data dir, so a test sees that it did. (The fake's
    "expansion" copies the compressed bytes: nothing reads them.)"""
    import shutil

    here = os.path.dirname(os.path.realpath(sys.argv[0]))
    for name in TEMPLATES:
        target = os.path.join(here, name)
        if not os.path.isfile(target + ".zst") or os.path.exists(target):
            continue
        time.sleep(float(faults().get("template_unpack", 0)))
        shutil.copyfile(target + ".zst", target + ".partial")
        os.replace(target + ".partial", target)
        with open(os.path.join(data_dir(), "templates-expanded.log"), "a") as fh:
            fh.write(name + "\n")


def vmm_died(state: dict, rec: dict) -> None:
    """A start whose VMM was spawned and died: 1.37 records the machine ``stopped`` with the
    dead VMM's pid (1.32 leaves it ``created`` with none), so the pid must never be trusted
    without the state (vmctl checks the state first)."""
    if not v137():
        return
    dead = subprocess.Popen(["true"], stdin=subprocess.DEVNULL)
    dead.wait()
    rec.update(state="stopped", pid=dead.pid, start_time=None)
    commit(rec["name"], rec)


def cmd_start(args: list[str]) -> None:
    spec = {
        "--name": ("name", True),
        "-n": ("name", True),
        "--forkable": ("forkable", False),
        "--proxy": ("proxy", True),
        "--no-proxy": ("no_proxy", True),
    }
    opts, _rest = parse(args, "machine start", spec)
    name = one(opts, "name", "default")
    f = faults()
    existing(name)
    with contextlib.ExitStack() as locks:
        if v137():  # 1.37.3 also holds the machine's stop lock through its start
            locks.enter_context(machine_lock(stop_lock(name)))
        locks.enter_context(machine_lock(start_lock(name), wait=False))
        state = load()
        rec = get(state, name)
        if state_of(rec) == "running":
            out(f"Machine '{name}' already running (PID: {rec['pid']})")
            return
        check_rootfs()
        expand_templates()
        if "kvm" in f["fail"] or name in f.get("fail_start", []):
            raise fail(
                "agent operation failed: start machine: kvm not available: KVM not "
                "available. Ensure KVM kernel module is loaded.\n"
                "  Try: sudo modprobe kvm_intel (or kvm_amd)"
            )
        if "kvm-denied" in f["fail"]:
            raise fail(
                "agent operation failed: start machine: kvm permission denied: Cannot "
                "access /dev/kvm (permission denied).\n"
                "  Add your user to the kvm group: sudo usermod -aG kvm $USER"
            )
        if "kvm-root" in f["fail"]:
            err("WARN VMM exited with code 1 pid=1 cause=Exited")
            vmm_died(state, rec)
            raise fail(
                "agent operation failed: start machine: agent operation failed: monitor "
                "agent: Then log out and log back in for the change to take effect.); "
                "libkrun detail: build microVM: Internal error while starting microVM: "
                "KvmContext(KvmOpen(Error(13))) (boot process exited (code 1) before the "
                "agent was ready)"
            )
        nic = bool(rec["ports"] or rec["egress"] or rec["net_backend"] == "virtio-net")
        devices = len(rec["volumes"]) + int(nic) + int(is_local(rec["image"]) or bool(rec["from"]))
        if "device-budget" in f["fail"] or devices > int(f.get("device_budget", DEFAULT_BUDGET)):
            vmm_died(state, rec)
            raise fail(
                "agent operation failed: start machine: monitor agent: agent operation "
                "failed: start vm: krun_start_enter returned: -22 (EINVAL: Invalid "
                "argument)"
            )
        for other in state["machines"].values():
            if other["name"] == name or state_of(other) != "running":
                continue
            mine = {h for h, _ in rec["ports"]}
            for h, _ in other["ports"]:
                if h in mine:
                    raise fail(
                        f"config operation failed: start machine: host port {h} is "
                        f"already in use by running machine '{other['name']}'",
                        "CONFLICT",
                    )
        clash = int(f.get("port_clash", 0)) or ("port-clash" in f["fail"])
        if clash:
            if f.get("port_clash"):
                f["port_clash"] = int(f["port_clash"]) - 1
                save_faults(f)
            raise fail(foreign_clash())
        mounts, nports = len(rec["volumes"]), len(rec["ports"])
        msg = f"Starting machine '{name}'"
        if mounts:
            msg += f" with {mounts} mount(s)"
        if nports:
            msg += f" and {nports} port mapping(s)"
        err(msg + "...")
        d = vm_dir(name)
        os.makedirs(d, exist_ok=True)
        stale = [n for n in os.listdir(d) if n.startswith("mount-") and n.endswith(".sock")]
        for leftover in ("ready", "agent-startup-error.log", *stale):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, leftover))
        empty_guest_tmp(name)
        vm_uid = per_vm_uid(name)
        if vm_uid is not None:
            hand_vm_dir_to(d, vm_uid)
        workload, workload_user = main_container(rec, name)
        boot = {
            "ports": rec["ports"],
            "publish_addr": os.environ.get("SMOLVM_PUBLISH_ADDR"),
            "slow_start": float(f.get("slow_start", 2.0)) if "slow-start" in f["fail"] else 0.0,
            "boot_hold": name in f.get("boot_hold", []),
            "crash_after": float(f.get("crash_after", 0.3))
            if "crash-after-start" in f["fail"]
            else None,
            "ignore_term": "ignore-term" in f["fail"],
            "expose_sockets": rec.get("expose_sockets", []),
            "workload": workload,
            "workload_env": guest_env(rec),
            "workload_user": workload_user,
            "workload_log": os.path.join(d, "workload.log"),
            # exec-netns: a network-less VM has one network namespace of its own, held by
            # its VMM process, that every exec enters (as every exec sees one VM's loopback).
            "own_netns": "exec-netns" in f["fail"] and not rec["network"],
            # {guest socket path: "HOST:PORT"}: the sidecar's service behind that exposed
            # socket is relayed to a TCP server of the test's (e.g. an HTTP server).
            "expose_relay": f.get("expose_relay", {}),
            "expose_ready_after": f.get("expose_ready_after"),
            "expose_never_ready": f.get("expose_never_ready", []),
            "vm_uid": vm_uid,
            # Under a dropped uid the "VMM" serves each --volume as that uid (virtiofs).
            "volumes": rec.get("volumes", []) if vm_uid is not None else [],
            # Under a dropped uid the "VMM" connects to each --mount-socket host path itself,
            # as that uid (exec-netns mounts its relay socket at the guest path).
            "mount_relays": rec.get("mount_sockets", []) if vm_uid is not None else [],
        }
        write_json(os.path.join(d, "boot-config.json"), boot)
        with open(os.devnull, "r+b") as null:
            vm = subprocess.Popen(
                # The launcher this call was run as (tests/fakes/smolvm, or a link to it).
                [sys.executable, os.path.abspath(sys.argv[0]), "_boot-vm", d],
                stdin=null,
                stdout=null,
                stderr=null,
                close_fds=True,
                process_group=0,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
        started = start_time(vm.pid)
        note_pid(vm.pid, f"vm:{name}")
        # As smolvm: agent.pid first, the record becomes running only once the agent is
        # ready. A start killed in between leaves this VMM behind a `created` record.
        with open(os.path.join(d, "agent.pid"), "w") as fh:
            fh.write(f"{vm.pid}\n{started}\n")
        limit = float(f.get("ready_timeout", 30))
        deadline = time.monotonic() + limit
        while not os.path.exists(os.path.join(d, "ready")):
            code = vm.poll()
            if code is not None:
                rec.update(state="stopped", pid=None, start_time=None)
                commit(name, rec)
                reason = read(os.path.join(d, "agent-startup-error.log"))
                if "Address already in use" in reason:
                    raise fail(foreign_clash())
                raise fail(
                    "agent operation failed: start machine: boot process exited "
                    f"(code {code}) before the agent was ready"
                )
            if time.monotonic() > deadline:
                kill_group(vm.pid, 0.5)
                vm.wait()
                rec.update(state="stopped", pid=None, start_time=None)
                commit(name, rec)
                raise fail(
                    "agent operation failed: start machine: agent operation failed: "
                    f"wait for ready: agent did not become ready within {limit:g} seconds"
                )
            time.sleep(0.01)
        rec.update(state="running", pid=vm.pid, start_time=started)
        commit(name, rec)
    out(f"Machine '{name}' running (PID: {vm.pid})")


def main_container(rec: dict, name: str) -> tuple[list[str], str | None]:
    """What ``machine start`` launches as the main container (``workload.rs``
    ``launch_image_workload``): the create command, else the image's ENTRYPOINT+CMD, as the
    machine's or the image's user (``uid:gid``), with the image's environment. A command not
    on the image's PATH fails ``crun create``, so the start fails (1.32.2 context string
    ``start background CMD``; the rest of the real text is not pinned). Each start gives the
    container a fresh ``/tmp`` (a RAM tmpfs with no size, ``oci.rs`` ``default_mounts``)."""
    argv = at_volume_hosts(rec["cmd"] or image_entrypoint(rec), rec)
    user = default_user(rec)
    if argv and not on_guest_path(argv[0], guest_env(rec)):
        raise fail(
            f"agent operation failed: start background CMD: crun create: executable "
            f"file `{argv[0]}` not found in $PATH"
        )
    import shutil

    shutil.rmtree(os.path.join(vm_dir(name), "guest-tmp"), ignore_errors=True)
    if user and os.geteuid() == 0:
        user = "%d:%d" % resolve_user(user)  # noqa: UP031 - as it always was
    return argv, user


def image_config(rec: dict) -> dict:
    """The machine's image config from ``fake-images.json`` (``{IMAGE: {...}}``): keys
    ``entrypoint``, ``cmd``, ``user`` (the image's USER) and ``env`` (its Env, ``K=V``)."""
    images = {}
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(data_dir(), "fake-images.json")) as fh:
            images = json.load(fh)
    conf = images.get(rec.get("image") or rec.get("from") or "", {})
    return conf if isinstance(conf, dict) else {}


def image_entrypoint(rec: dict) -> list[str]:
    """The image's ENTRYPOINT+CMD (from fake-images.json), run when create gave no command."""
    conf = image_config(rec)
    return list(conf.get("entrypoint", [])) + list(conf.get("cmd", []))


#: The PATH the 1.32.2 guest agent adds when the image's Env has none (its strings;
#: ``crun.rs`` ``ensure_path_in_env`` in v1.9.3). The host's PATH never reaches the guest.
DEFAULT_GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def guest_env(rec: dict, extra: list[str] = ()) -> dict:
    """A guest command's environment: the image's Env (PATH added only when it has none),
    then the machine's ``--env``, then the exec's ``-e`` (``ResolvedLaunch::resolve`` →
    ``merge_image_env``). Nothing of the host's environment."""
    env = {}
    for pair in [*image_config(rec).get("env", []), *rec.get("env", []), *extra]:
        k, sep, v = pair.partition("=")
        if k and sep:
            env[k] = v
    env.setdefault("PATH", DEFAULT_GUEST_PATH)
    return env


def default_user(rec: dict) -> str | None:
    """Who runs a command given no ``-u``: the machine's ``--user``, then the image's USER
    (1.32.2 ``machine exec --help``; ``ResolvedLaunch::resolve``). None: root."""
    return rec.get("user") or image_config(rec).get("user") or None


def at_volume_hosts(argv: list[str], rec: dict) -> list[str]:
    """A command run on the host (the fake's plain mode) names a read-only volume's files by
    their host path: the word at or under the volume's GUEST path becomes its HOST path, so a
    program mounted into the "guest" (bottlenet's kit at /run/bottlenet-kit) runs. Only argv
    is mapped: the program's own file accesses must follow from it (the kit's do)."""
    out = []
    for word in argv:
        for host, guest, ro in rec.get("volumes", []):
            if ro and (word == guest or word.startswith(guest + "/")):
                word = host + word[len(guest) :]
                break
        out.append(word)
    return out


def on_guest_path(word: str, env: dict) -> bool:
    """Whether ``word`` runs in the guest: a path that is executable, else found on the
    guest's PATH (as ``crun`` looks it up; the fake's guest filesystem is the host's)."""
    if "/" in word:
        return os.access(word, os.X_OK)
    return any(
        os.access(os.path.join(d, word), os.X_OK) for d in env.get("PATH", "").split(":") if d
    )


def kill_orphan(name: str, grace: float) -> bool:
    """smolvm's stop: a VMM named by agent.pid (same start time) is killed though the record
    is not running (a start that never finished). delete does not do this."""
    try:
        with open(os.path.join(vm_dir(name), "agent.pid")) as fh:
            pid_s, started = [*fh.read().split(), "?", "?"][:2]
        pid = int(pid_s)
    except (OSError, ValueError):
        return False
    if not alive(pid, started):
        return False
    err(f"Killing orphaned _boot-vm process (PID {pid})")
    kill_group(pid, grace)
    return True


def foreign_clash() -> str:
    return (
        "agent operation failed: start machine: configure virtio-net: failed to start "
        "virtio network runtime: Address already in use (os error 98) "
        "(boot process exited (code 1) before the agent was ready)"
    )


def read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


def kill_group(pid: int, grace: float) -> None:
    """TERM the VM's process group, then KILL after ``grace`` seconds."""
    started = start_time(pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while alive(pid, started) and time.monotonic() < deadline:
        time.sleep(0.02)
    if alive(pid, started):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 3
        while alive(pid, started) and time.monotonic() < deadline:
            time.sleep(0.02)


def stop_rec(rec: dict, grace: float) -> None:
    out(f"Stopping machine '{rec['name']}'...")
    kill_group(rec["pid"], grace)
    kill_guests(rec["name"])
    if alive(rec["pid"], rec["start_time"]):
        raise fail(f"process {rec['pid']} still alive after stop attempts")
    rec.update(state="stopped", pid=None, start_time=None)


def cmd_stop(args: list[str]) -> None:
    opts, _ = parse(args, "machine stop", {"--name": ("name", True), "-n": ("name", True)})
    name = one(opts, "name", "default")
    grace = float(faults().get("stop_grace", 2.0))
    existing(name)
    with machine_lock(stop_lock(name)):
        rec = get(load(), name)
        current = state_of(rec)
        if current not in ("running", "unreachable"):
            if rec["state"] == "running":
                rec.update(state="stopped", pid=None, start_time=None)
                commit(name, rec)
            kill_orphan(name, grace)
            out(f"Machine '{name}' is not running (state: {current})")
            return
        stop_rec(rec, grace)
        commit(name, rec)
    out(f"Stopped machine: {name}")


def cmd_delete(args: list[str]) -> None:
    spec = {
        "--name": ("name", True),
        "-n": ("name", True),
        "-f": ("force", False),
        "--force": ("force", False),
        "--cascade": ("cascade", False),
    }
    opts, _ = parse(args, "machine delete", spec)
    name = one(opts, "name")
    if name is None:
        raise usage(
            "the following required arguments were not provided:\n  --name <NAME>", "machine delete"
        )
    grace = float(faults().get("stop_grace", 2.0))
    existing(name)
    with machine_lock(stop_lock(name)):
        rec = get(load(), name)
        if state_of(rec) in ("running", "unreachable"):
            stop_rec(rec, grace)
            commit(name, rec)
        if not opts.get("force"):
            sys.stderr.write(f"Delete machine '{name}'? [y/N] ")
            sys.stderr.flush()
            answer = sys.stdin.readline().strip().lower()
            if answer not in ("y", "yes"):
                out("Cancelled")
                return
        d = vm_dir(name)
        if os.path.isdir(d):
            if not v137():
                out(f"Cleaning up data directory for vm: {name}")
            import shutil

            shutil.rmtree(d, ignore_errors=True)
        empty_guest_tmp(name)
        release_vm_uid(name)
        with locked():
            state = load()
            state["machines"].pop(name, None)
            save(state)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stop_lock(name))  # as smolvm: its lock file goes with the machine
    out(f"Deleted machine: {name}")


def cmd_ls(args: list[str]) -> None:
    spec = {"--json": ("json", False), "-v": ("verbose", False), "--verbose": ("verbose", False)}
    opts, _ = parse(args, "machine ls", spec)
    with locked():
        recs = list(load()["machines"].values())
    if opts.get("json"):
        out(json.dumps([to_json(r) for r in recs], indent=2, sort_keys=True))
        return
    if not recs:
        out("No machines found")
        return
    out(
        f"{'NAME':<20}{'STATE':<12}{'CPUS':<5}{'MEMORY':<10}{'MOUNTS':<7}{'PORTS':<7}"
        f"{'STORAGE':<8}{'OVERLAY':<8}"
    )
    out("-" * 88)
    for r in recs:
        n = r["name"] if len(r["name"]) <= 18 else r["name"][:15] + "..."
        out(
            f"{n:<20}{reported_state(r):<12}{r['cpus']:<5}{str(r['memory_mib']) + ' MiB':<10}"
            f"{len(r['volumes']):<7}{len(r['ports']):<7}{'20 GiB':<8}{'-':<8}"
        )


def cmd_status(args: list[str]) -> None:
    spec = {"--name": ("name", True), "-n": ("name", True), "--json": ("json", False)}
    opts, _ = parse(args, "machine status", spec)
    name = one(opts, "name", "default")
    with locked():
        rec = load()["machines"].get(name)
    if rec is None:
        if opts.get("json") and not v137():
            raise cfg_fail(f"machine status: machine '{name}' not found")
        raise fail(f"vm not found: {name}", "NOT_FOUND")
    if opts.get("json"):
        out(json.dumps(to_json(rec), indent=2, sort_keys=True))
    elif reported_state(rec) == "running":
        out(f"Machine '{name}': running (PID: {rec['pid']})")
    else:
        out(f"Machine '{name}': {reported_state(rec)}")


def deny_nf_tables() -> None:
    """``no-nftables``: this process and its children see a kernel without nf_tables'
    netlink (a seccomp filter: ``socket(AF_NETLINK, _, NETLINK_NETFILTER)`` fails with
    EPROTONOSUPPORT; every other call is allowed)."""
    import ctypes

    def stmt(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    ld, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    allow, errno_ret = 0x7FFF0000, 0x00050000 | 93  # SECCOMP_RET_ALLOW, ERRNO(EPROTONOSUPPORT)
    prog = b"".join(
        [
            stmt(ld, 4),  # arch
            stmt(jeq, 0xC000003E, 0, 6),  # AUDIT_ARCH_X86_64, else allow
            stmt(ld, 0),  # nr
            stmt(jeq, 41, 0, 4),  # __NR_socket
            stmt(ld, 16),  # args[0]
            stmt(jeq, 16, 0, 2),  # AF_NETLINK
            stmt(ld, 32),  # args[2]
            stmt(jeq, 12, 1, 0),  # NETLINK_NETFILTER: refuse
            stmt(ret, allow),
            stmt(ret, errno_ret),
        ]
    )
    n = len(prog) // 8
    buf = ctypes.create_string_buffer(prog)
    fprog = struct.pack("=HxxxxxxQ", n, ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        os._exit(126)
    if libc.prctl(22, 2, ctypes.addressof(fbuf), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
        os._exit(126)


def _then(first, second):  # type: ignore[no-untyped-def]
    """Two preexec_fns in order (``first`` may be None). The user drop goes first: a change
    of the effective uid or gid clears PR_SET_PDEATHSIG."""

    def both() -> None:
        if first is not None:
            first()
        second()

    return both


def _die_with_parent(parent: int):  # type: ignore[no-untyped-def]
    """A preexec_fn: the child gets SIGKILL when ``parent`` dies (Linux; elsewhere a no-op)."""

    def setup() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(1)

    return setup


# -- the guest agent's connection limit (fidelity item 4; mode ``agent_connections``) --------

#: smolvm 1.9.3's guest agent serves this many connections at once and the next one waits in
#: its accept loop (``crates/smolvm-agent/src/main.rs`` ``run_server_with_listener``,
#: ``MAX_CONCURRENT_CONNECTIONS``). Every ``machine exec`` holds one while it runs, and so does
#: smolvm's own 250 ms state ping. 1.32.2's value is unknown (a constant, not in its strings).
AGENT_CONNECTIONS = 8
#: 1.37's refusal of an exec past the agent's limit (the agent's string; the CLI's prefix is
#: the one its other agent failures carry).
AGENT_ADMISSION = "agent operation failed: exec was not admitted"


def agent_connections() -> int:
    """The limit in force: ``agent_connections`` in the faults (0: none), else smolvm's 8."""
    return int(faults().get("agent_connections", AGENT_CONNECTIONS))


def _agent_slot_paths(name: str) -> list[str]:
    d = os.path.join(vm_dir(name), "agent-connections")
    os.makedirs(d, exist_ok=True)
    return [os.path.join(d, str(i)) for i in range(agent_connections())]


def _try_slot(path: str) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def agent_connection(name: str) -> int | None:
    """One of the agent's connections, held (an flock) until this CLI closes the fd or exits.

    With all of them taken the call waits, as the 9th connection waits in the real agent's
    accept loop (forever: only the caller's own timeout ends it). From 1.37 the agent admits
    execs explicitly and refuses one past its limit at once (``exec was not admitted``, a
    string of the 1.37.3 agent; the CLI's wrapping of it is inferred: no boot here)."""
    if agent_connections() <= 0:
        return None
    while True:
        for path in _agent_slot_paths(name):
            fd = _try_slot(path)
            if fd is not None:
                return fd
        if v137():
            raise fail(AGENT_ADMISSION)
        time.sleep(0.05)


def agent_answers_ping(name: str) -> bool:
    """smolvm's state ping needs a connection too: with every one taken it gets no answer
    in 250 ms, and ``ls``/``status`` say ``unreachable``."""
    if agent_connections() <= 0 or not os.path.isdir(vm_dir(name)):
        return True
    for path in _agent_slot_paths(name):
        fd = _try_slot(path)
        if fd is not None:
            os.close(fd)
            return True
    return False


# -- guest processes die with their VM (fidelity item 6) ------------------------------------

#: The text smolvm's CLI ends an exec session with when the agent's socket hangs up without
#: an ``Exited`` (``src/agent/client.rs`` ``interactive_session``; the phrase is in the 1.32.2
#: binary's strings, pinned by tests/vmctl/test_contract.py).
VM_LOST = "agent operation failed: connection to VM lost"


def kill_guests(name: str) -> None:
    """Every "guest" process of the machine dies with it (its VM is gone): the ones ``exec``
    started (attached, plain and ``-d``), by their process groups."""
    with contextlib.suppress(FileNotFoundError):
        with open(os.path.join(data_dir(), "fake-pids.txt")) as fh:
            rows = [line.split() for line in fh if line.strip()]
        for row in rows:
            if len(row) == 3 and row[2] == f"exec:{name}" and alive(int(row[0]), row[1]):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(int(row[0]), signal.SIGKILL)


def vm_gone(rec: dict) -> bool:
    return bool(rec.get("pid")) and not alive(rec.get("pid"), rec.get("start_time"))


def watch_vm(rec: dict, command_group: int, restore=None) -> None:
    """A thread: when the machine's VMM dies, so does the command (it ran in that VM), and
    this CLI ends as smolvm's does, with :data:`VM_LOST` and exit 1."""
    pid = rec.get("pid")
    if not pid:
        return
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return

    def wait() -> None:
        import select

        while alive(pid, rec.get("start_time")):
            select.select([pidfd], [], [], 1.0)
        vm_lost(command_group, restore)

    threading.Thread(target=wait, daemon=True).start()


def vm_lost(command_group: int, restore=None) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(command_group, signal.SIGKILL)
    if restore is not None:
        restore()
    with contextlib.suppress(Exit):
        raise fail(VM_LOST)
    os._exit(1)


def cmd_exec(args: list[str]) -> None:
    spec = {
        "--name": ("name", True),
        "-e": ("env", True),
        "--env": ("env", True),
        "-w": ("workdir", True),
        "--workdir": ("workdir", True),
        "--timeout": ("timeout", True),
        "-i": ("interactive", False),
        "--interactive": ("interactive", False),
        "-t": ("tty", False),
        "--tty": ("tty", False),
        "-u": ("user", True),
        "--user": ("user", True),
        "--stream": ("stream", False),
        "-d": ("detach", False),
        "--detach": ("detach", False),
    }
    opts, command = parse(args, "machine exec", spec)
    if opts.get("detach") and (opts.get("interactive") or opts.get("tty") or opts.get("stream")):
        raise usage("the argument '--detach' cannot be used with '--interactive'", "machine exec")
    name = one(opts, "name", "default")
    if not command:
        raise usage(
            "the following required arguments were not provided:\n  <COMMAND>...", "machine exec"
        )
    with locked():
        rec = get(load(), name)
        if state_of(rec) not in ("running", "unreachable"):
            raise fail(
                f"agent operation failed: connect: machine '{name}' is not running. "
                f"Start it with 'smolvm machine start --name {name}'; if a start is "
                "already in progress, retry once it finishes."
            )
    if opts.get("detach") and (opts.get("interactive") or opts.get("tty") or opts.get("stream")):
        raise usage("the argument '--detach' cannot be used with '--interactive'", "machine exec")
    connection = agent_connection(name)  # held while this exec runs (the agent's limit)
    env = guest_env(rec, opts.get("env", []))
    cwd = one(opts, "workdir") or rec.get("workdir")
    if cwd and not os.path.isdir(cwd):
        cwd = None
    user = one(opts, "user") or default_user(rec)
    preexec = as_user(user)
    if "exec-netns" in faults()["fail"] and not rec["network"]:
        bare = bare_bin(rec)
        if preexec is not None:  # drop the user inside the namespaces (unshare needs root)
            drop = drop_argv(*resolve_user(user))
            if bare is not None:  # no setpriv on the bare image's PATH: the fake's own copy
                drop[0] = BARE_SETPRIV
            command = [*drop, *command]
            preexec = None
        command = netns_wrap(
            name,
            rec.get("mount_sockets", []),
            command,
            rec.get("pid"),
            guest_volumes(rec, vm_uid_of(name)),
            bare,
        )
    else:
        command = at_volume_hosts(command, rec)
    if "no-nftables" in faults()["fail"]:
        preexec = _then(preexec, deny_nf_tables)
    timeout = one(opts, "timeout")
    seconds = humantime(timeout) if timeout else None
    if opts.get("interactive") or opts.get("tty"):
        raise Exit(
            exec_attached(
                name,
                command,
                env,
                cwd,
                preexec,
                tty=bool(opts.get("tty")),
                rec=rec,
                seconds=seconds,
            )
        )
    if opts.get("detach"):
        with open(os.devnull, "r+b") as null:
            p = subprocess.Popen(
                command,
                env=env,
                cwd=cwd,
                stdin=null,
                stdout=null,
                stderr=null,
                process_group=0,
                preexec_fn=preexec,
            )
        note_pid(p.pid, f"exec:{name}")
        if connection is not None:
            os.close(connection)
        out(str(p.pid))
        return
    stdin = sys.stdin.buffer.read() if opts.get("interactive") else b""
    # The "guest" command gets its own process group, recorded for the test fixture, and dies
    # with this CLI (as a guest process would die with its VM, never outliving the test).
    # The TERM handler is in place before the guest exists, and the guest gets SIGKILL when
    # this CLI dies in any way (PR_SET_PDEATHSIG; a SIGKILL cannot be handled): on a loaded
    # machine a TERM could land between spawn and handler, or a KILL follow the TERM at once,
    # and either orphaned the guest.
    guest: list[int] = []

    def on_term(signum: int, frame: object) -> None:
        for pid in guest:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        p = subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            process_group=0,
            preexec_fn=_then(preexec, _die_with_parent(os.getpid())),
        )
    except FileNotFoundError:
        raise fail(
            f"agent operation failed: exec: command not found: {command[0]}", "COMMAND_FAILED"
        ) from None
    guest.append(p.pid)
    note_pid(p.pid, f"exec:{name}")
    watch_vm(rec, p.pid)
    try:
        stdout, stderr = p.communicate(stdin, timeout=seconds)
    except subprocess.TimeoutExpired:
        # smolvm's --timeout kills the guest command; the exit status is 124 (as timeout(1)).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise Exit(124) from None
    if vm_gone(rec):
        vm_lost(p.pid)
    sys.stdout.buffer.write(stdout)
    sys.stdout.flush()
    sys.stderr.buffer.write(stderr)
    sys.stderr.flush()
    raise Exit(p.returncode if p.returncode >= 0 else 128 - p.returncode)


def exec_attached(
    name: str,
    command: list[str],
    env: dict,
    cwd: str | None,
    preexec,
    *,
    tty: bool,
    rec: dict,
    seconds: float | None = None,
) -> int:
    """``exec -i [-t]`` as smolvm does it: stdin, stdout and stderr stream while the command
    runs; with ``-t`` the command gets a terminal of its own, the CLI's terminal (when stdin
    is one) goes raw, its size is copied at start and on every SIGWINCH (default 80x24, as the
    smolvm agent's).

    How a session ends, as the real agent ends it (fidelity item 5, ``end_session``): this
    CLI ending (SIGTERM, SIGHUP, SIGINT, its output going nowhere) or ``--timeout`` (exit 124)
    kills only the ``crun exec`` wrapper and drops its pipes: the command itself is not
    signalled and lives on, seeing EOF on stdin and EPIPE on output (with ``-t``, the
    terminal's hang-up). A VM that dies takes the command with it, and this CLI ends with
    :data:`VM_LOST`, exit 1 (item 6, ``watch_vm``)."""
    import termios
    import tty as ttymod

    p, master = _spawn_attached(name, command, env, cwd, preexec, tty=tty)

    def end_session() -> None:
        for f in (p.stdin, p.stdout, p.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        if master is not None:
            with contextlib.suppress(OSError):
                os.close(master)

    saved = None
    if tty and os.isatty(0):
        saved = termios.tcgetattr(0)
        ttymod.setraw(0)

    def restore() -> None:
        if saved is not None:
            with contextlib.suppress(termios.error, OSError):
                termios.tcsetattr(0, termios.TCSAFLUSH, saved)

    def on_signal(signum: int, frame: object) -> None:
        end_session()
        restore()
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)
    watch_vm(rec, p.pid, restore)
    if tty:

        def on_winch(signum: int, frame: object) -> None:
            with contextlib.suppress(OSError):
                fcntl.ioctl(
                    master, termios.TIOCSWINSZ, fcntl.ioctl(0, termios.TIOCGWINSZ, b"\0" * 8)
                )

        signal.signal(signal.SIGWINCH, on_winch)
    deadline = None if seconds is None else time.monotonic() + seconds
    try:
        code = _attached_loop(p, master, tty, deadline)
        if code is None:  # --timeout: the wrapper is killed, the command lives on
            end_session()
            return 124
        if code == 255:  # nobody reads our output any more: the session is gone
            end_session()
            return 255
    finally:
        restore()
    if vm_gone(rec):
        vm_lost(p.pid, restore)
    return code if code >= 0 else 128 - code


def _spawn_attached(
    name: str, command: list[str], env: dict, cwd: str | None, preexec, *, tty: bool
) -> tuple[subprocess.Popen, int | None]:
    """The attached command: on a terminal of its own (``-t``) or on three pipes."""
    import termios

    if not tty:
        try:
            p = subprocess.Popen(
                command,
                env=env,
                cwd=cwd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                process_group=0,
                preexec_fn=preexec,
            )
        except FileNotFoundError:
            raise fail(f"agent operation failed: exec: command not found: {command[0]}") from None
        note_pid(p.pid, f"exec:{name}")
        return p, None
    master, slave = os.openpty()
    size = struct.pack("HHHH", 24, 80, 0, 0)
    with contextlib.suppress(OSError):
        size = fcntl.ioctl(0, termios.TIOCGWINSZ, b"\0" * 8)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, size)

    def controlling_tty() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        if preexec is not None:
            preexec()

    try:
        p = subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            preexec_fn=controlling_tty,
        )
    except FileNotFoundError:
        raise fail(f"agent operation failed: exec: command not found: {command[0]}") from None
    os.close(slave)
    note_pid(p.pid, f"exec:{name}")
    return p, master


def _attached_loop(
    p: subprocess.Popen, master: int | None, tty: bool, deadline: float | None
) -> int | None:
    """Stream until the command's output ends and it exits: its code, 255 when our output
    goes nowhere, None at the deadline."""
    sel = selectors.DefaultSelector()
    if tty:
        sel.register(master, selectors.EVENT_READ, 1)
        sinks = {master: 1}
        child_in = master
    else:
        sel.register(p.stdout.fileno(), selectors.EVENT_READ, 1)
        sel.register(p.stderr.fileno(), selectors.EVENT_READ, 2)
        sinks = {p.stdout.fileno(): 1, p.stderr.fileno(): 2}
        child_in = p.stdin.fileno()

    def pump_stdin() -> None:  # a thread: a full pipe to the command never stalls its output
        while True:
            data = b""
            with contextlib.suppress(OSError):
                data = os.read(0, 65536)
            if not data:
                if not tty:
                    with contextlib.suppress(OSError):
                        p.stdin.close()
                return
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(child_in, view) :]
            except OSError:
                return

    threading.Thread(target=pump_stdin, daemon=True).start()

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    while sinks:
        if deadline is not None and time.monotonic() >= deadline:
            return None
        for key, _ in sel.select(left()):
            try:
                data = os.read(key.fd, 65536)
            except OSError:  # EIO: the terminal's other side is gone
                data = b""
            if not data:
                sel.unregister(key.fd)
                del sinks[key.fd]
                continue
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(key.data, view) :]
            except OSError:
                return 255
    try:
        return p.wait(left())
    except subprocess.TimeoutExpired:
        return None


def humantime(text: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    for suffix in ("ms", "s", "m", "h"):
        if text.endswith(suffix) and text[: -len(suffix)].isdigit():
            return int(text[: -len(suffix)]) * units[suffix]
    raise usage(f"invalid value '{text}' for '--timeout <DURATION>'", "machine exec")


def resolve_user(user: str) -> tuple[int, int]:
    """``uid[:gid]`` or ``name[:group]`` as numbers. A name is looked up in the guest's
    ``/etc/passwd`` (``oci.rs`` ``resolve_exec_user_spec``): the fake's guest filesystem is
    the host's. A name it lacks fails the exec (the real text is not pinned)."""
    import grp
    import pwd

    name, _, group = user.partition(":")
    try:
        if name.isdigit():
            uid = int(name)
            try:
                gid = pwd.getpwuid(uid).pw_gid
            except KeyError:
                gid = uid
        else:
            pw = pwd.getpwnam(name)
            uid, gid = pw.pw_uid, pw.pw_gid
        if group:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise fail(
            f"agent operation failed: run: unable to find user {user}: no matching "
            "entries in passwd file"
        ) from None
    return uid, gid


def drop_argv(uid: int, gid: int) -> list[str]:
    """The guest's ``crun exec`` as a user: that uid and gid, no supplementary groups, and
    empty inheritable and ambient capability sets (``oci.rs`` ``OciSpec::new``), so a user
    other than root keeps no capability after its ``execve``: no ICMP or raw socket, no bind
    below 1024, no ``setuid``."""
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        "--",
    ]


def as_user(user: str | None):  # a preexec_fn or None
    """A user other than root really drops privileges when the fake runs as root (the
    capabilities go with the uid: the kernel clears them on ``setuid`` away from 0)."""
    if not user or os.geteuid() != 0:
        return None
    uid, gid = resolve_user(user)
    if uid == 0 and gid == 0:
        return None

    def drop() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    return drop


NETNS_SETUP = r"""
set -e
ip link set lo up  # a VM's own loopback is up (the gate's positive controls use it)
mount -t tmpfs -o mode=0755,size=64m fake-guest-run /run  # root's: oci.rs default_mounts
n=$1; shift
while [ "$n" -gt 0 ]; do
    host=$1; guest=$2; shift 2; n=$((n - 1))
    mkdir -p "$(dirname "$guest")"
    : > "$guest"
    mount --bind "$host" "$guest"
done
# Like a VM's own filesystem: the host's /tmp (state dirs of tests) and $HOME are not there,
# and the machine-id and hostname are the guest's own. The guest's /tmp is the machine's own:
# one directory per machine, kept across its execs (as a VM's root filesystem keeps it) and
# removed with the machine.
mount --bind "$FAKE_GUEST_TMP" /tmp
if [ -n "$FAKE_HOST_HOME" ] && [ "$FAKE_HOST_HOME" != / ] && [ -d "$FAKE_HOST_HOME" ]; then
    mount -t tmpfs -o mode=0700 fake-guest-home "$FAKE_HOST_HOME"
fi
# Volumes at their guest paths (one that neither exists nor lies under /tmp or /run, the
# guest's own, is not mounted: the fake does not create directories in the host's tree).
v=$1; shift
while [ "$v" -gt 0 ]; do
    host=$1; guest=$2; access=$3; shift 3; v=$((v - 1))
    case $guest in /tmp/*|/run/*) mkdir -p "$guest" ;; esac
    [ -d "$guest" ] || continue
    mount --bind "$host" "$guest"
    [ "$access" = ro ] && mount -o remount,bind,ro "$guest"
done
if [ -e /etc/machine-id ]; then
    echo "$FAKE_GUEST_ID" > /run/.fake-machine-id
    mount --bind /run/.fake-machine-id /etc/machine-id
fi
hostname fake-guest
# A bare image (fake-images.json "bare": [names]): no shell and no python3 anywhere a guest
# looks. /usr/bin (and /bin, its link) holds copies of the named programs only; /usr/sbin,
# /usr/local/bin and /root (pyenv's interpreters) are empty. The fake's setpriv, for a user
# drop, is copied to /run first. Run after everything above: it hides the tools it used.
if [ -n "${FAKE_BARE+x}" ]; then
    cp /usr/bin/setpriv /run/.fake-setpriv
    mkdir /run/.fake-bin
    for b in $FAKE_BARE; do cp -L "/usr/bin/$b" /run/.fake-bin/; done
    for d in /usr/sbin /usr/local/bin /usr/local/sbin /root; do
        [ -d "$d" ] && mount -t tmpfs -o mode=0755,size=1m fake-bare "$d"
    done
    mount --bind /run/.fake-bin /usr/bin
fi
exec "$@"
"""

#: Where the bare image's guest finds the fake's setpriv (its /usr/bin has none).
BARE_SETPRIV = "/run/.fake-setpriv"


def bare_bin(rec: dict) -> list[str] | None:
    """The programs a bare image keeps in /usr/bin (None: not a bare image)."""
    bare = image_config(rec).get("bare")
    return [str(b) for b in bare] if isinstance(bare, list) else None


def guest_tmp(name: str) -> str:
    """The exec-netns guest's /tmp: the machine's own, kept across its execs, emptied at each
    start (both versions' help says so). 1.32's is a tmpfs (RAM): here a directory on the
    host's /dev/shm (``guest-tmp`` in the VM dir a link to it); 1.37's a directory on the
    machine's root disk: here ``guest-tmp`` in its VM dir."""
    d = os.path.join(vm_dir(name), "guest-tmp")
    if not v137() and os.path.isdir("/dev/shm") and not os.path.lexists(d):
        shm = shm_tmp(name)
        os.makedirs(shm, exist_ok=True)
        os.chmod(shm, 0o1777)
        os.symlink(shm, d)
    os.makedirs(d, exist_ok=True)
    os.chmod(d, 0o1777)
    return d


def shm_tmp(name: str) -> str:
    """1.32's tmpfs /tmp of a machine: one per VM dir (the path hashed: two state dirs may
    hold machines of one name)."""
    digest = hashlib.sha256(vm_dir(name).encode()).hexdigest()[:16]
    return os.path.join("/dev/shm", f"fake-smolvm-tmp-{digest}")


def empty_guest_tmp(name: str) -> None:
    """A start empties the guest's /tmp (1.32: a new tmpfs; 1.37: emptied at boot)."""
    import shutil

    link = os.path.join(vm_dir(name), "guest-tmp")
    if os.path.islink(link):
        os.unlink(link)
    for d in (link, shm_tmp(name)):
        shutil.rmtree(d, ignore_errors=True)


def vm_uid_of(name: str) -> int | None:
    """The uid the machine's VMM runs as (its ``.vm-uid``), None without a drop."""
    known = read(os.path.join(vm_dir(name), ".vm-uid")).strip()
    return int(known) if known.isdigit() and "uid-drop" in faults()["fail"] else None


def netns_wrap(
    name: str,
    mount_sockets: list[str],
    command: list[str],
    vm_pid: int | None = None,
    volumes: list[str] = (),
    bare: list[str] | None = None,
) -> list[str]:
    """The exec-netns stand-in: no network at all, mounted sockets at their guest paths; the
    network namespace is the VM's own (its VMM's), shared by all its execs."""
    pairs: list[str] = []
    for i, spec in enumerate(mount_sockets):
        host, _, guest = spec.partition(":")
        if not guest.startswith("/run/"):
            raise fail(f"fake exec-netns: guest socket path must be under /run: {guest}")
        relay = mount_relay_path(vm_dir(name), i)
        pairs += [relay if os.path.exists(relay) else host, guest]
    own = f"/proc/{vm_pid}/ns/net" if vm_pid else None
    if (
        own is not None
        and os.path.exists(own)
        and os.readlink(own) != os.readlink("/proc/self/ns/net")
    ):
        enter = ["nsenter", f"--net={own}", "unshare"]
    else:
        enter = ["unshare", "--net"]
    return [
        *enter,
        "--mount",
        "--uts",
        "--propagation",
        "private",
        "env",
        f"FAKE_GUEST_ID={secrets.token_hex(16)}",
        f"FAKE_HOST_HOME={os.environ.get('HOME', '')}",
        f"FAKE_GUEST_TMP={guest_tmp(name)}",
        *([] if bare is None else [f"FAKE_BARE={' '.join(bare)}"]),
        "/bin/sh",
        "-c",
        NETNS_SETUP,
        "sh",
        str(len(pairs) // 2),
        *pairs,
        str(len(volumes) // 3),
        *volumes,
        *command,
    ]


def mount_relay_path(d: str, index: int) -> str:
    """The "VMM"'s end of a ``--mount-socket`` under a dropped uid (in its own VM dir)."""
    return os.path.join(d, f"mount-{index}.sock")


def cmd_data_dir(args: list[str]) -> None:
    opts, _ = parse(args, "machine data-dir", {"--name": ("name", True), "-n": ("name", True)})
    name = one(opts, "name")
    if name is None:
        raise usage(
            "the following required arguments were not provided:\n  --name <NAME>",
            "machine data-dir",
        )
    with locked():
        get(load(), name)
    out(vm_dir(name))


# -- the "VM" ---------------------------------------------------------------------------


def launch_workload(cfg: dict) -> None:
    """The machine's persistent workload, as smolvm launches it detached on every start: the
    create command, else the image ENTRYPOINT+CMD. It dies with the VM (same process group)."""
    argv = cfg.get("workload") or []
    if not argv:
        return
    env = cfg.get("workload_env") or {"PATH": DEFAULT_GUEST_PATH}
    with open(cfg["workload_log"], "ab") as log, open(os.devnull, "rb") as null:
        try:
            subprocess.Popen(
                argv,
                env=env,
                stdin=null,
                stdout=log,
                stderr=log,
                preexec_fn=as_user(cfg.get("workload_user")),
            )
        except OSError as e:
            log.write(f"workload failed to start: {e}\n".encode())


def swallow(conn: socket.socket) -> None:
    """A guest connection whose host-side connect failed, as libkrun leaves it (fidelity
    item 3; snapshot ``src/devices/src/virtio/vsock/muxer.rs`` ``process_op_request`` confirms
    the guest's connect whatever ``UnixProxy::connect`` returned): the bytes the guest sends
    go nowhere and it never sees EOF or a reset, until it closes or the VM dies."""
    with contextlib.suppress(OSError):
        while conn.recv(65536):
            pass
    conn.close()


def relay_service(
    listener: socket.socket, target: tuple[str, int] | str, ready: Callable[[], bool] = lambda: True
) -> None:
    """Each connection relayed to ``target``: a TCP server of the test's behind a sidecar
    service, or (a path) a ``--mount-socket`` host socket the "VMM" connects to as its uid
    (one it cannot connect hangs: :func:`swallow`). Until ``ready()`` a connection is dropped
    (the guest app does not listen yet: :func:`expose_readiness`)."""

    def connect() -> socket.socket:
        if isinstance(target, str):
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                up.connect(target)
            except OSError:
                up.close()
                raise
            return up
        return socket.create_connection(target)

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)

    def serve(conn: socket.socket) -> None:
        if not ready():
            conn.close()
            return
        try:
            up = connect()
        except OSError:
            if isinstance(target, str):
                swallow(conn)
            else:
                conn.close()
            return
        t = threading.Thread(target=pump, args=(conn, up), daemon=True)
        t.start()
        pump(up, conn)
        t.join()
        conn.close()
        up.close()

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def serve_volumes(d: str, volumes: list) -> None:
    """The "VMM", after its uid drop, opens each ``--volume`` directory for virtiofs: one its
    uid cannot reach (a parent it cannot pass, a directory it cannot read) ends the boot, so
    ``machine start`` fails (inferred: smolvm shares volumes after ``internal_boot.rs``'s
    uid-drop block and idmaps none of them; the real text is not pinned)."""
    for host, _guest, _ro in volumes:
        try:
            os.close(os.open(host, os.O_RDONLY | os.O_DIRECTORY))
        except OSError as e:
            with open(os.path.join(d, "agent-startup-error.log"), "a") as fh:
                fh.write(f"virtiofs: cannot open volume {host}: {e.strerror}\n")
            sys.exit(1)


def writable_as(path: str, uid: int) -> bool:
    """Whether ``uid`` (gid the same, no groups, as smolvm's VMM) may create in ``path``."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os._exit(0 if os.access(path, os.W_OK | os.X_OK) else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def guest_volumes(rec: dict, vm_uid: int | None) -> list[str]:
    """exec-netns: each ``--volume`` as ``HOST GUEST ro|rw`` for the guest's mounts. Under a
    dropped uid a read-write volume that uid cannot write is served read-only: the fake cannot
    make the guest's writes the VMM uid's, so they fail (EROFS where the real fails EACCES);
    the files the guest writes are root's here, the VMM uid's in a real VM."""
    words = []
    swapped = faults().get("volume_swap", {})
    for host, guest, ro in rec.get("volumes", []):
        if not ro and vm_uid is not None and not writable_as(host, vm_uid):
            ro = True
        # volume_swap {GUEST: HOST}: the guest finds another directory there (a guest that
        # replaced what was mounted, e.g. bottlenet's kit)
        words += [swapped.get(guest, host), guest, "ro" if ro else "rw"]
    return words


def expose_readiness(cfg: dict) -> Callable[[str], bool]:
    """Whether the guest app behind an exposed socket listens yet (fidelity item 10).

    The VMM binds each ``--expose-socket`` host path before the guest app exists, and the
    agent drops every host connection it cannot dial the app for (``publish_socket.rs``
    ``serve_expose`` -> ``dial_app``); ``machine start`` returns once the workload container
    is started, not listening. Faults: ``expose_ready_after`` (seconds after the start
    returns during which every exposed service drops connections) and ``expose_never_ready``
    (guest paths whose app never listens). Default: every app answers at once."""
    after = float(cfg.get("expose_ready_after") or 0.0)
    never = set(cfg.get("expose_never_ready") or ())
    since = time.monotonic()

    def ready(guest: str) -> bool:
        return guest not in never and time.monotonic() - since >= after

    return ready


#: ``boot_hold``: the file in a held machine's VM dir that lets its "VM" finish booting.
BOOT_RELEASE = "boot-release"


def boot_vm(d: str) -> None:
    """The long-lived VM stand-in: listen on the published ports and echo."""
    _import_all_now()
    with open(os.path.join(d, "boot-config.json")) as fh:
        cfg = json.load(fh)
    if cfg.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cfg.get("own_netns"):
        import ctypes

        if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0:  # CLONE_NEWNET
            sys.exit(1)
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    vm_uid = cfg.get("vm_uid")
    if vm_uid is not None:  # the per-VM uid drop, before anything is bound
        os.setgroups([])
        os.setgid(vm_uid)
        os.setuid(vm_uid)
    serve_volumes(d, cfg.get("volumes", []))
    for i, spec in enumerate(cfg.get("mount_relays", [])):
        host_path = spec.partition(":")[0]
        relay = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        relay.bind(mount_relay_path(d, i))
        # Any guest uid may connect (publish_socket.rs prepare_mount_listener: 0777).
        os.chmod(mount_relay_path(d, i), 0o777)
        relay.listen(64)
        threading.Thread(target=relay_service, args=(relay, host_path), daemon=True).start()
    time.sleep(cfg.get("slow_start") or 0)
    while cfg.get("boot_hold") and not os.path.exists(os.path.join(d, BOOT_RELEASE)):
        time.sleep(0.02)  # boot_hold: the test says when this "VM" has booted
    sel = selectors.DefaultSelector()
    listeners = []
    try:
        for host_port, _guest in cfg["ports"]:
            addrs = [(socket.AF_INET, cfg.get("publish_addr") or "127.0.0.1", True)]
            if not cfg.get("publish_addr"):
                addrs.append((socket.AF_INET6, "::1", False))
            for family, addr, required in addrs:
                try:
                    s = socket.socket(family, socket.SOCK_STREAM)
                    s.bind((addr, host_port))
                    s.listen(64)
                except OSError:
                    s.close()
                    if required:
                        raise
                    continue
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ, None)
                listeners.append(s)
        relays = cfg.get("expose_relay") or {}
        app_ready = expose_readiness(cfg)
        for _guest, host_path in cfg.get("expose_sockets", []):
            # --expose-socket: the VMM holds the host end of a guest service's socket.
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISSOCK(os.lstat(host_path).st_mode):
                        os.unlink(host_path)
                s.bind(host_path)
            except PermissionError:
                s.close()
                if vm_uid is None:
                    raise
                # As 1.32.2 under a dropped uid: logged, the socket disabled, the start goes on.
                with open(os.path.join(d, "agent-startup-error.log"), "a") as fh:
                    fh.write(
                        "WARN failed to add published socket vsock port \u2014 disabled "
                        f"host_path={host_path}\n"
                    )
                continue
            s.listen(64)
            if _guest in relays:
                host, _, port = relays[_guest].rpartition(":")
                threading.Thread(
                    target=relay_service,
                    args=(s, (host, int(port)), lambda g=_guest: app_ready(g)),
                    daemon=True,
                ).start()
                continue
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, ("expose", _guest))
            listeners.append(s)
    except OSError as e:
        with open(os.path.join(d, "agent-startup-error.log"), "w") as fh:
            fh.write(f"failed to start virtio network runtime: {e.strerror} (os error {e.errno})")
        sys.exit(1)
    with open(os.path.join(d, "ready.tmp"), "w") as fh:
        fh.write("ready\n")
    os.replace(os.path.join(d, "ready.tmp"), os.path.join(d, "ready"))
    launch_workload(cfg)
    crash_at = time.monotonic() + cfg["crash_after"] if cfg.get("crash_after") else None
    while True:
        if crash_at is not None and time.monotonic() >= crash_at:
            global STATE_DIR
            STATE_DIR = d.rsplit("/.cache/smolvm/vms/", 1)[0]
            kill_guests(read(os.path.join(d, "name")))  # the guest dies with its VM
            os._exit(3)
        for key, _ in sel.select(timeout=0.05):
            sock = key.fileobj
            if key.data is None or isinstance(key.data, tuple):
                with contextlib.suppress(OSError):
                    conn, _ = sock.accept()
                    if key.data is not None and not app_ready(key.data[1]):
                        conn.close()  # no app listens yet: the agent drops it
                        continue
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ, "conn")
                continue
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                sel.unregister(sock)
                sock.close()
                continue
            with contextlib.suppress(OSError):
                sock.setblocking(True)
                sock.sendall(data)
                sock.setblocking(False)


# -- entry ------------------------------------------------------------------------------


def cmd_egress_events(args: list[str]) -> None:
    """``machine egress-events`` (1.32.2 and 1.37.3): the denials of a machine's egress policy,
    oldest first, the newest ``--limit`` (200) kept. Here they come from the faults'
    ``egress_events`` (``{machine: [{"timestamp", "operation", "dest"}]}``, the API spec's
    EgressDenialInfo); a machine that does not exist answers ``[]``, exit 0, as both do (run
    here)."""
    spec = {"--name": ("name", True), "-n": ("name", True), "--json": ("json", False),
            "--limit": ("limit", True)}  # fmt: skip
    opts, _ = parse(args, "machine egress-events", spec)
    name = one(opts, "name", "default")
    limit = int(one(opts, "limit", "200") or 200)
    events = list(faults().get("egress_events", {}).get(name, []))
    events = events[-limit:] if limit else []
    if opts.get("json"):
        out(json.dumps(events))
    elif not events:
        out(f"No egress denials recorded for '{name}'.")
    else:
        for e in events:
            out(f"{e.get('timestamp', '')}  {e.get('operation', '')}  {e.get('dest', '')}")


MACHINE = {
    "create": cmd_create,
    "start": cmd_start,
    "stop": cmd_stop,
    "delete": cmd_delete,
    "rm": cmd_delete,
    "ls": cmd_ls,
    "list": cmd_ls,
    "status": cmd_status,
    "exec": cmd_exec,
    "data-dir": cmd_data_dir,
    "egress-events": cmd_egress_events,
}
#: The first version (in this fake's model) with each newer subcommand (1.32.2 has
#: ``egress-events``, run here; 1.9.3 has not).
SUBCOMMANDS_SINCE = {"egress-events": (1, 32, 0)}


def packed_note() -> None:
    """The ``smolmachines`` wheel's binary (``smol/smol-vmm``) prints this on stderr first, on
    every call, before it parses its argv (1.32.2, run here: the name is its executable's
    basename; a binary named ``smolvm``, or one with ``NAME.smolmachine`` beside it, prints
    nothing). Mode ``packed-note`` (fault name) prints it as ``smol-vmm``; a copy or link of
    this fake under another name prints it under that name."""
    exe = os.path.basename(sys.argv[0])
    if "packed-note" in faults()["fail"] and exe == "smolvm":
        exe = "smol-vmm"
    elif exe == "smolvm":
        return
    if os.path.exists(
        os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), exe + ".smolmachine")
    ):
        return
    err(
        f"note: no packed assets found for '{exe}' (looked for a '{exe}.smolmachine' sidecar "
        "next to the executable); running as the plain smolvm CLI. If this is a packed "
        "binary, keep its .smolmachine file alongside it."
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["_boot-vm"]:
        boot_vm(argv[1])
        return 0
    prescan(argv)
    packed_note()
    record_call(argv)
    try:
        if argv[:1] in (["--version"], ["-V"]):
            out(f"smolvm {faults().get('version', VERSION)}")
            return 0
        if not argv:
            raise usage("'smolvm' requires a subcommand but one was not provided", "<COMMAND>")
        if argv[0] not in ("machine", "vm"):
            raise usage(f"unrecognized subcommand '{argv[0]}'", "<COMMAND>")
        known = {
            k: v for k, v in MACHINE.items() if version_tuple() >= SUBCOMMANDS_SINCE.get(k, (0,))
        }
        if len(argv) < 2 or argv[1] not in known:
            sub = argv[1] if len(argv) > 1 else ""
            raise usage(f"unrecognized subcommand '{sub}'", "machine <COMMAND>")
        MACHINE[argv[1]](argv[2:])
        return 0
    except Exit as e:
        return e.code


if __name__ == "__main__":
    sys.exit("run the fake through its launcher: tests/fakes/smolvm")
