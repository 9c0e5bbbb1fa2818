"""``bottlenetctl selftest``: the one command a user runs on a new host to see VM bottles work.

It creates a throwaway VM bottle from the user's images (or spec) through the running daemon
and checks, one line each, what a first real boot depends on: smolvm, KVM, the privilege model,
the sidecar's services, the launch gate, the bridge, exec as root and as the image's USER, a
read-write volume, a workload's start and exit code, the event stream, and a teardown that
leaves nothing (asked of the daemon with ``Leftovers``, which looks in smolvm's own listing).
Each FAIL line says what was seen and the fix. Exit status 0 only when every check passes.

The observations are made by :class:`Run` (I/O against the daemon); every verdict is a pure
function of them, so each FAIL path is tested without a VM. Its own guest commands (the
workload, the attached command, the process count, the connect, the volume's round trip, the
uid) run on bottlenet's guest kit when the daemon has one ready (:class:`GuestTools`), so an
image with no python3 and no shell passes; without a kit they need the image's python3 and
``/bin/sh``, as bottlenet's own guest commands then do.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import io
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO

from bottlenet.cli.output import clean as _clean
from bottlenet.control import calls
from bottlenet.errors import BottlenetError

if TYPE_CHECKING:
    from bottlenet.cli.invocation import Invocation
    from bottlenet.control.blocking import BlockingControlClient
    from bottlenet.control.records import BottleRecord
    from bottlenet.control.results import HelloResult


class Verdict(enum.StrEnum):
    PASS = "PASS"
    #: Works, but outside what bottlenet is tested with: said, not counted as a failure.
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"


class Check(NamedTuple):
    """One line of the report: ``step`` with its verdict, what was seen, and the fix."""

    step: str
    verdict: Verdict
    seen: str
    fix: str = ""


#: The steps, in the order they are reported.
STEPS = (
    "daemon",
    "smolvm",
    "privilege",
    "kit",
    "images",
    "kvm",
    "sidecar",
    "gate",
    "bridge",
    "exec-root",
    "exec-user",
    "session-end",
    "volume",
    "workload",
    "events",
    "teardown",
)
#: The steps a create proves, in the order it passes them, and the error code of each.
CREATE_STEPS = ("images", "kvm", "sidecar", "gate", "bridge")
#: How a refusal of the spec's images starts (bottles.md, step 0: checked before any machine).
IMAGE_KEYS = ("agent.image", "sidecar.image")
CODE_STEP = {
    "KVM_UNAVAILABLE": "kvm",
    "SIDECAR_NOT_READY": "sidecar",
    "ISOLATION_FAILED": "gate",
    "ISOLATION_UNAVAILABLE": "gate",
    "BRIDGE_FAILED": "bridge",
    "EGRESS_LAYER_FAILED": "bridge",
}
FIXES = {
    "smolvm": "install the vm extra (pip install 'bottlenet[vm]') or start the daemon with"
    " --smolvm /abs/path/smolvm (1.8.0 or newer; tested 1.32.2 and 1.37.3); docs/smolvm.md",
    "smolvm-untested": "install a tested one (pip install 'bottlenet[vm]' pins it) or expect"
    " what docs/smolvm.md lists as unchecked for a new version",
    "images": "the images in docs/quickstart.md are examples: give an agent image this host"
    " has (a local archive, e.g. docker save python:3.12-slim -o agent.tar) or can pull, and a"
    " sidecar image that follows docs/sidecar.md (docs/sidecar.md, Agent image)",
    "kvm": "the VM process must open /dev/kvm: load kvm_intel or kvm_amd; for a non-root"
    " daemon add its user to the kvm group (usermod -aG kvm USER) and restart the daemon;"
    " docs/operations.md",
    "kvm-per-vm": "the VM process must open /dev/kvm: load kvm_intel or kvm_amd; as root,"
    " smolvm runs each VM under a uid of its own (2000000 and up), so /dev/kvm must be open"
    " to them (crw-rw-rw-, as most distributions' udev rules make it; ls -l /dev/kvm);"
    " docs/operations.md",
    "sidecar": "the sidecar image must listen on /run/bottlenet/<service>.sock for each"
    " service (created by root: /run is a root 0755 tmpfs); docs/sidecar.md",
    "gate": "the agent VM must reach its own endpoints and nothing else; read the verdict"
    " above and docs/bottles.md (launch gate)",
    "gate-skipped": "restart the daemon without --unsafe-skip-isolation-probe",
    "bridge": "bottlenet's guest kit runs the bridge (see the kit line); without a kit the"
    " agent image needs python3 and /bin/sh; docs/sidecar.md (the in-guest bridge)",
    "kit": "bottlenet builds its guest kit from its own interpreter at start (--guest-kit"
    " auto): the daemon's log says why it could not; without it every agent image needs"
    " python3 and /bin/sh; docs/sidecar.md",
    "exec-root": "smolvm must run `machine exec -u 0`; docs/smolvm.md",
    "exec-user": "the image's USER (or agent.user) must exist in the image's /etc/passwd",
    "session-end": "bottlenet runs attached guest commands under a session wrapper that ends"
    " their process group when smolvm drops the session; docs/smolvm.md (session ends)",
    "volume": "under per-VM uids the agent VM's uid must be able to write the directory;"
    " docs/security.md (volumes)",
    "workload": "the workload runs as agent.user, else the image's USER; docs/sidecar.md",
    "events": "the daemon's event stream (bottlenetctl events) must report the bottle's life",
    "teardown": "remove what is listed by hand (bottlenetctl bottle rm, smolvm machine"
    " delete); then report it: a teardown must leave nothing",
    "teardown-uid": "a uid reservation is a file named after the uid in smolvm's registry,"
    " <smolvm data dir>/.cache/smolvm/uids/ (the daemon's is <state-dir>/smolvm): once"
    " `ps -u UID` lists nothing, remove that file (rm); end a process it lists first"
    " (kill); then report it: a teardown must leave nothing",
}

WORKLOAD_EXIT = 7
WORKLOAD_MARK = "bottlenet-selftest-workload"
#: Seconds the workload waits for its go file (it polls ten times a second).
WORKLOAD_WAIT = 600


#: A guest command that never reads its input; its argv carries a marker.
SLEEPER = "import time\nwhile True: time.sleep(1)"
#: Counts the guest processes whose argv carries the marker (given reversed, so the counter's
#: own argv does not carry it).
COUNTER = (
    "import os, sys\nm = sys.argv[1][::-1].encode()\nn = 0\n"
    "for p in os.listdir('/proc'):\n"
    "    try:\n        n += p.isdigit() and m in open('/proc/%s/cmdline' % p, 'rb').read()\n"
    "    except OSError:\n        pass\nprint(n)\n"
)
#: Seconds a guest command gets to show up, and then to end after its session.
SESSION_WAIT = 30.0


def _go_file(name: str) -> str:
    return f"/tmp/.bottlenet-selftest-go-{name}"


class GuestTools(NamedTuple):
    """The selftest's guest commands: on bottlenet's guest kit (``kit``: its program as a
    guest runs it, from Hello), else on the image's python3 and ``/bin/sh``. Each gives the
    argv and what goes to its stdin (None: nothing)."""

    kit: tuple[str, ...] = ()

    def workload(self, name: str) -> list[str]:
        """Waits until told (its go file), prints a line, exits 7."""
        if self.kit:
            words = [_go_file(name), str(WORKLOAD_WAIT), str(WORKLOAD_EXIT), WORKLOAD_MARK]
            return [*self.kit, "wait-for", *words]
        script = (
            f"n=0; while [ ! -e {_go_file(name)} ] && [ $n -lt {WORKLOAD_WAIT * 10} ];"
            f" do sleep 0.1; n=$((n+1)); done; echo {WORKLOAD_MARK}; exit {WORKLOAD_EXIT}"
        )
        return ["/bin/sh", "-c", script]

    def sleeper(self, marker: str) -> list[str]:
        """A command that never reads its input; its argv carries ``marker``."""
        if self.kit:
            return [*self.kit, "idle", marker]
        return ["python3", "-c", SLEEPER, marker]

    def counter(self, marker: str) -> list[str]:
        """Prints how many guest processes carry ``marker`` (given reversed)."""
        if self.kit:
            return [*self.kit, "procs", marker[::-1]]
        return ["python3", "-c", COUNTER, marker[::-1]]

    def connect(self, port: int) -> tuple[list[str], bytes | None]:
        """Connects to the guest's 127.0.0.1:``port``: exit 0 when it connected."""
        if self.kit:  # the bridge's reach check: "BNB reach PORT ok|timeout|ERRNO"
            check = {"nonce": "selftest", "ports": [[port, f"tcp:127.0.0.1:{port}"]], "timeout": 5}
            return [*self.kit, "reach"], json.dumps(check).encode()
        probe = (
            "import socket,sys\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), 5).close()\n"
            "except OSError as e:\n"
            "    sys.exit(str(e))\n"
        )
        return ["python3", "-c", probe], None

    def write(self, path: str, text: str) -> tuple[list[str], bytes | None]:
        if self.kit:
            return [*self.kit, "write", path], f"{text}\n".encode()
        return ["/bin/sh", "-c", f"echo {text} > {path}"], None

    def touch(self, path: str) -> tuple[list[str], bytes | None]:
        """An empty file at ``path``."""
        return ([*self.kit, "write", path], b"") if self.kit else (["touch", path], None)

    def read(self, path: str) -> list[str]:
        return [*self.kit, "read", path] if self.kit else ["cat", path]

    def uid(self) -> tuple[list[str], str]:
        """Prints the uid (the kit's ``whoami``: ``uid:gid``); the command's name."""
        return (
            ([*self.kit, "whoami"], "whoami (the kit's)") if self.kit else (["id", "-u"], "id -u")
        )

    def who(self) -> list[str]:
        return [*self.kit, "whoami"] if self.kit else ["id"]


def connected(tools: GuestTools, seen: ExecSeen, port: int) -> str:
    """``ok`` when the guest's connect to ``port`` was made, else what it said."""
    if tools.kit:
        words = seen.stdout.split()
        # connected: the host's end answered and closed ("ok") or kept it open ("timeout")
        if seen.code == 0 and words[:3] == ["BNB", "reach", str(port)]:
            return "ok" if words[3:4] in (["ok"], ["timeout"]) else " ".join(words[3:4])
        return _said(seen)
    return "ok" if seen.code == 0 else _said(seen)


def build_spec(
    base: dict[str, Any] | None,
    args: argparse.Namespace,
    volume: str,
    tools: GuestTools | None = None,
) -> dict[str, Any]:
    """The throwaway bottle's spec: the user's, else one from the images given, with the
    selftest's workload (on the kit when there is one) and read-write volume."""
    if base is not None:
        doc = json.loads(json.dumps(base))  # a deep copy of plain JSON values
    else:
        services = args.service or ["egress:3128"]
        doc = {
            "mode": "socket",
            "sidecar": {
                "image": args.sidecar_image,
                "service": [
                    {"name": n, "guest_port": int(p), "env": []}
                    for n, _, p in (s.partition(":") for s in services)
                ],
            },
            "agent": {"image": args.agent_image, "env": ["LANG=C.UTF-8"]},
        }
    agent = doc.setdefault("agent", {})
    agent["workload"] = (tools or GuestTools()).workload(args.name)
    # The same path in the guest: any image has room for it, and it names what it mounts.
    agent["volumes"] = [*agent.get("volumes", []), f"{volume}:{volume}:rw"]
    return doc


# -- verdicts (pure) ------------------------------------------------------------------------


def judge_hello(hello: HelloResult, control: str) -> list[Check]:
    """``daemon``, ``smolvm`` and ``privilege`` from the daemon's Hello."""
    checks = [
        Check(
            "daemon",
            Verdict.PASS,
            f"bottlenet {hello.server_version}, protocol {hello.protocol}, at {control}",
        ),
    ]
    if hello.smolvm_available and hello.smolvm_tested is False:
        tested = " and ".join(hello.smolvm_tested_versions) or "other versions"
        said = (
            f"smolvm {hello.smolvm_version} is untested: bottlenet is tested with {tested}"
            f" ({hello.smolvm_source or 'source not reported'})"
        )
        checks.append(Check("smolvm", Verdict.WARN, said, FIXES["smolvm-untested"]))
    elif hello.smolvm_available:
        said = hello.smolvm_source or f"smolvm {hello.smolvm_version}"
        checks.append(Check("smolvm", Verdict.PASS, said))
    else:
        checks.append(
            Check("smolvm", Verdict.FAIL, "the daemon has no usable smolvm", FIXES["smolvm"])
        )
    checks.append(judge_privilege(hello))
    checks.append(judge_kit(hello.guest_kit))
    return checks


def judge_privilege(hello: HelloResult) -> Check:
    """The privilege model, and what it rests on: the uid a VM process was seen to run as,
    or only what the daemon's uid implies (no VM start seen yet)."""
    model = hello.vm_uids or "not reported"
    return Check(
        "privilege",
        Verdict.PASS,
        f"{model} ({hello.vm_uids_basis})" if hello.vm_uids_basis else model,
    )


def judge_kit(kit: str | None) -> Check:
    """``kit``: bottlenet's guest kit is built (an image then needs nothing of bottlenet's);
    without one the images' python3 and /bin/sh serve, which this line says as a FAIL."""
    if kit is None:
        return Check("kit", Verdict.SKIP, "the daemon does not report a guest kit (older daemon)")
    if kit.startswith(("ready:", "building")):
        return Check("kit", Verdict.PASS, kit)
    return Check("kit", Verdict.FAIL, kit, FIXES["kit"])


def judge_create_error(error: BottlenetError, *, per_vm_uids: bool = False) -> list[Check]:
    """The create's steps when the create failed with ``error``: the steps before the one the
    code names passed, that one failed, the rest were not reached. ``per_vm_uids``: the
    daemon's VMs run under uids of their own (it changes the KVM fix)."""
    seen = f"{error.code}: {error.message}"
    failed = CODE_STEP.get(error.code)
    if error.code == "INVALID_ARGUMENT" and error.message.startswith(IMAGE_KEYS):
        return [Check("images", Verdict.FAIL, seen, FIXES["images"])]
    if failed is None and "volume" in error.message:
        return [Check("volume", Verdict.FAIL, seen, FIXES["volume"])]
    if failed is None:
        return [
            Check("images", Verdict.SKIP, "not told apart: the create failed at once (see kvm)"),
            Check(
                "kvm",
                Verdict.FAIL,
                f"the VMs did not start: {seen}",
                "read the message; docs/operations.md (troubleshooting)",
            ),
        ]
    checks = []
    for step in CREATE_STEPS:
        if step == failed:
            fix = FIXES["kvm-per-vm" if step == "kvm" and per_vm_uids else step]
            checks.append(Check(step, Verdict.FAIL, seen, fix))
            break
        checks.append(Check(step, Verdict.PASS, "passed (the create went on past it)"))
    return checks


def judge_created(record: BottleRecord) -> list[Check]:
    """The create's steps from the created bottle's record."""
    services = ", ".join(e.service for e in record.endpoints) or "none"
    checks = [
        Check("images", Verdict.PASS, "both images taken"),
        Check("kvm", Verdict.PASS, f"both VMs started ({record.sidecar_vm}, {record.agent_vm})"),
        Check("sidecar", Verdict.PASS, f"services answered: {services}"),
    ]
    if record.probe == "PASS":
        checks.append(Check("gate", Verdict.PASS, f"isolation probe PASS ({record.mode} mode)"))
    elif record.probe and record.probe.startswith("SKIPPED"):
        checks.append(
            Check("gate", Verdict.FAIL, f"launch gate {record.probe}", FIXES["gate-skipped"])
        )
    else:
        checks.append(
            Check("gate", Verdict.FAIL, f"launch gate {record.probe or 'not run'}", FIXES["gate"])
        )
    return checks


def judge_bridge(record: BottleRecord, reached: dict[int, str]) -> Check:
    """``bridge``: its status row, and a guest TCP connect to each service's port."""
    if not record.bridge or not record.bridge.startswith("running"):
        return Check("bridge", Verdict.FAIL, f"bridge {record.bridge or 'off'}", FIXES["bridge"])
    bad = {port: why for port, why in reached.items() if why != "ok"}
    if bad:
        said = "; ".join(f"127.0.0.1:{p} {why}" for p, why in sorted(bad.items()))
        return Check("bridge", Verdict.FAIL, f"in the guest: {said}", FIXES["bridge"])
    ports = ", ".join(f"127.0.0.1:{p}" for p in sorted(reached))
    return Check("bridge", Verdict.PASS, f"{record.bridge}; guest connects to {ports}")


class ExecSeen(NamedTuple):
    code: int | None
    stdout: str
    stderr: str
    error: str | None = None


def _said(seen: ExecSeen) -> str:
    if seen.error is not None:
        return seen.error
    tail = (seen.stderr.strip().splitlines() or [""])[-1]
    return f"exit {seen.code}" + (f": {tail}" if tail else "")


def judge_exec_root(seen: ExecSeen, command: str = "id -u") -> Check:
    """``command`` printed the uid 0 (the kit's ``whoami`` prints ``uid:gid``)."""
    printed = seen.stdout.strip()
    if seen.code == 0 and printed.split(":")[0] == "0":
        return Check("exec-root", Verdict.PASS, f"`{command}` with -u 0 printed {printed}")
    return Check(
        "exec-root",
        Verdict.FAIL,
        f"`{command}` with -u 0: {_said(seen)}, printed {printed[:40]!r}",
        FIXES["exec-root"],
    )


def judge_exec_user(seen: ExecSeen) -> Check:
    if seen.code == 0 and seen.stdout.strip():
        who = seen.stdout.strip().splitlines()[0][:80]
        return Check("exec-user", Verdict.PASS, f"as the image's user: {who}")
    return Check(
        "exec-user", Verdict.FAIL, f"`id` as the image's user: {_said(seen)}", FIXES["exec-user"]
    )


def judge_session_end(started: bool, ended: bool, waited: float) -> Check:
    """``session-end``: a guest command that ignores its input ends when its session does."""
    if not started:
        return Check(
            "session-end",
            Verdict.FAIL,
            "the attached command never showed in the guest",
            FIXES["session-end"],
        )
    if not ended:
        return Check(
            "session-end",
            Verdict.FAIL,
            f"the command still ran {waited:.0f} s after its session ended",
            FIXES["session-end"],
        )
    return Check(
        "session-end", Verdict.PASS, "a command that ignores its input ended with its session"
    )


def judge_volume(
    volume: str,
    guest_wrote: str | None,
    host_read: str | None,
    guest_read: str | None,
    want_guest: str,
    want_host: str,
) -> Check:
    """``volume``: the guest's write seen on the host, the host's seen in the guest."""
    if host_read != want_guest:
        said = guest_wrote or f"the host found {host_read!r}"
        return Check("volume", Verdict.FAIL, f"guest to host: {said}", FIXES["volume"])
    if guest_read != want_host:
        return Check(
            "volume", Verdict.FAIL, f"host to guest: the guest read {guest_read!r}", FIXES["volume"]
        )
    return Check("volume", Verdict.PASS, f"round trip both ways through {volume}")


def judge_workload(state_before: str | None, code: int | None, log: str) -> Check:
    if state_before is None or not state_before.startswith("running"):
        return Check(
            "workload",
            Verdict.FAIL,
            f"workload {state_before or 'not started'} before it was told to go",
            FIXES["workload"],
        )
    if code != WORKLOAD_EXIT:
        return Check(
            "workload",
            Verdict.FAIL,
            f"exit code {code}, expected {WORKLOAD_EXIT}",
            FIXES["workload"],
        )
    if WORKLOAD_MARK not in log:
        return Check(
            "workload",
            Verdict.FAIL,
            "exit code seen, but its output is not in the bottle's logs",
            FIXES["workload"],
        )
    return Check("workload", Verdict.PASS, f"started, ran, exited {code}, output in the logs")


EXPECTED_EVENTS = ("created", "ready", "workload_exited", "destroyed")


def judge_events(kinds: Sequence[str]) -> Check:
    """``events``: the bottle's life, in order, on the event stream."""
    rest = iter(kinds)
    missing = [k for k in EXPECTED_EVENTS if k not in rest]  # in order: a subsequence
    if missing:
        return Check(
            "events",
            Verdict.FAIL,
            f"saw {', '.join(kinds) or 'none'}; missing or out of order: {', '.join(missing)}",
            FIXES["events"],
        )
    return Check("events", Verdict.PASS, ", ".join(kinds))


def judge_teardown(destroy_error: str | None, leftovers: Sequence[str]) -> Check:
    if destroy_error is not None:
        return Check(
            "teardown", Verdict.FAIL, f"destroy failed: {destroy_error}", FIXES["teardown"]
        )
    if leftovers:
        # vmctl.residue's lines: "uid N is still reserved ...", "pid N still runs as VM uid"
        of_uids = sum(1 for line in leftovers if line.startswith(("uid ", "pid ")))
        fixes = [FIXES["teardown"]] if of_uids < len(leftovers) else []
        fixes += [FIXES["teardown-uid"]] if of_uids else []
        return Check("teardown", Verdict.FAIL, "; ".join(leftovers), "; ".join(fixes))
    return Check(
        "teardown",
        Verdict.PASS,
        "nothing left: no machine, no bottle directory, no VM uid reservation or process",
    )


# -- the run (I/O against the daemon) -------------------------------------------------------


class Run:
    """One selftest against the daemon behind ``client``: :meth:`checks` yields each line as
    soon as it is known; the throwaway bottle is destroyed whatever happens."""

    def __init__(
        self,
        client: BlockingControlClient,
        args: argparse.Namespace,
        base_spec: dict[str, Any] | None,
        control: str,
        idle: float,
    ) -> None:
        self.c = client
        self.args = args
        self.name: str = args.name
        #: How long an event may take to come (a VM's work: the VM timeout, or --timeout).
        self.idle = idle
        self.base_spec = base_spec
        self.control = control
        self.kinds: list[str] = []
        self.torn_down = False
        self.per_vm_uids = False
        #: The guest commands: on the daemon's kit once Hello says one is ready.
        self.tools = GuestTools()

    def checks(self) -> Iterator[Check]:
        """Every step once, in :data:`STEPS` order: those the run passed by are SKIP."""
        todo = list(STEPS)
        reason = "not reached"
        for check in self._steps():
            while todo and todo[0] != check.step:
                yield Check(todo.pop(0), Verdict.SKIP, reason)
            if todo:
                todo.pop(0)
            if check.verdict is Verdict.FAIL and reason == "not reached":
                reason = f"not reached ({check.step} failed)"
            yield check
        for step in todo:
            yield Check(step, Verdict.SKIP, reason)

    def _steps(self) -> Iterator[Check]:
        hello = self._kit_built(self.c.hello())
        self.per_vm_uids = (hello.vm_uids or "").startswith("per-VM")
        self.tools = GuestTools(hello.guest_kit_argv)
        first = judge_hello(hello, self.control)
        if first[1].verdict is Verdict.FAIL:
            yield from first
            return
        yield from first[:2]  # privilege and kit after the create: what its VMs showed
        import shutil  # here, not at bottlenetctl's start (shutil imports bz2 and lzma)
        import tempfile

        volume = self.args.volume_dir or tempfile.mkdtemp(
            prefix="bottlenet-selftest-", dir="/var/tmp"
        )
        made = self.args.volume_dir is None
        try:
            if made:
                os.chmod(volume, 0o755)  # as a user's project directory usually is
            yield from self._with_bottle(volume)
        finally:
            if made:
                shutil.rmtree(volume, ignore_errors=True)

    def _kit_built(self, hello: HelloResult) -> HelloResult:
        """Hello once the daemon's kit is no longer being built (it is at its start; the
        create would wait for it too), so the guest commands are chosen for what the bottle
        will mount; bounded by the call timeout."""
        import time

        deadline = time.monotonic() + self.idle
        while (hello.guest_kit or "").startswith("building") and time.monotonic() < deadline:
            time.sleep(0.5)
            hello = self.c.hello()
        return hello

    def _hello_lines(self) -> Iterator[Check]:
        """``privilege`` (what the create's VMs showed) and ``kit``, from one Hello."""
        hello = self.c.hello()
        yield judge_privilege(hello)
        yield judge_kit(hello.guest_kit)

    def _with_bottle(self, volume: str) -> Iterator[Check]:
        spec = build_spec(self.base_spec, self.args, volume, self.tools)
        self.c.watch(self.name)
        try:
            record = self.c.call(calls.create_bottle(self.name, spec=json.dumps(spec)))
        except BottlenetError as e:
            yield from self._hello_lines()
            yield from judge_create_error(e, per_vm_uids=self.per_vm_uids)
            yield from self._teardown(destroy=False)
            return
        try:
            yield from self._hello_lines()
            yield from judge_created(record)
            yield judge_bridge(self.c.call(calls.bottle_status(self.name)), self._reach(spec))
            argv, command = self.tools.uid()
            yield judge_exec_root(self._exec(argv, user="0"), command)
            yield judge_exec_user(self._exec(self.tools.who()))
            yield self._session_end()
            yield self._volume(volume)
            yield self._workload()
            yield from self._teardown(destroy=True)
        except BaseException:  # the daemon went away, Ctrl-C: still leave nothing behind
            if not self.torn_down:
                with contextlib.suppress(Exception):
                    self.c.call(calls.destroy_bottle(self.name))
            raise

    def _exec(
        self, argv: Sequence[str], stdin: bytes | None = None, user: str | None = None
    ) -> ExecSeen:
        out, err = io.BytesIO(), io.BytesIO()
        given = None if stdin is None else io.BytesIO(stdin)
        try:
            code = self.c.exec(
                self.name,
                list(argv),
                stdin=given,
                stdout=out,
                stderr=err,
                user=user,
                time_limit=60,
            )
        except BottlenetError as e:
            return ExecSeen(None, "", "", f"{e.code}: {e.message}")
        return ExecSeen(
            code,
            out.getvalue().decode("utf-8", "replace"),
            err.getvalue().decode("utf-8", "replace"),
        )

    def _session_end(self) -> Check:
        """Start an attached command that ignores stdin, drop its session, and watch the
        guest's process list until it is gone (bounded)."""
        from bottlenet.control.calls import ExecRequest

        marker = f"bottlenet-selftest-session-{self.name}"
        request = ExecRequest(
            self.name, tuple(self.tools.sleeper(marker)), user="0", stdin=True, fds=False
        )
        try:
            session = self.c.start_exec(request)
        except BottlenetError as e:
            return Check(
                "session-end", Verdict.FAIL, f"{e.code}: {e.message}", FIXES["session-end"]
            )
        with session:
            started = self._poll(marker, want=True)
        ended = self._poll(marker, want=False)
        return judge_session_end(started, ended, SESSION_WAIT)

    def _poll(self, marker: str, *, want: bool) -> bool:
        """Whether a guest process carrying ``marker`` came to be (``want``) or to be gone,
        within :data:`SESSION_WAIT` seconds."""
        import time

        deadline = time.monotonic() + SESSION_WAIT
        while True:
            seen = self._exec(self.tools.counter(marker), user="0")
            if seen.code == 0 and (seen.stdout.strip() != "0") == want:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)

    def _reach(self, spec: dict[str, Any]) -> dict[int, str]:
        """Per service port: "ok" when a guest TCP connect to 127.0.0.1:port succeeds."""
        reached: dict[int, str] = {}
        for service in spec.get("sidecar", {}).get("service", []):
            port = int(service["guest_port"])
            argv, stdin = self.tools.connect(port)
            reached[port] = connected(self.tools, self._exec(argv, stdin, user="0"), port)
        return reached

    def _volume(self, volume: str) -> Check:
        import secrets

        to_host, to_guest = secrets.token_hex(8), secrets.token_hex(8)
        argv, stdin = self.tools.write(f"{volume}/from-guest", to_host)
        wrote = self._exec(argv, stdin, user="0")
        host_read = _read_text(os.path.join(volume, "from-guest"))
        _write_new(os.path.join(volume, "from-host"), to_guest + "\n")
        read = self._exec(self.tools.read(f"{volume}/from-host"), user="0")
        return judge_volume(
            volume,
            None if wrote.code == 0 else f"the guest's write: {_said(wrote)}",
            host_read,
            read.stdout.strip() if read.code == 0 else None,
            to_host,
            to_guest,
        )

    def _workload(self) -> Check:
        before = self.c.call(calls.bottle_status(self.name)).workload
        self._exec(*self.tools.touch(_go_file(self.name)), user="0")
        code = self._wait_event("workload_exited") if before else None
        log = io.BytesIO()
        try:
            self.c.logs(self.name, stdout=log, stderr=io.BytesIO(), tail=50)
        except BottlenetError:
            pass
        return judge_workload(before, code, log.getvalue().decode("utf-8", "replace"))

    def _wait_event(self, kind: str) -> int | None:
        """Take events until ``kind`` comes (its exit code), or the call timeout passes."""
        try:
            for ev in self.c.events(self.name, idle=self.idle):
                self.kinds.append(ev.kind)
                if ev.kind == kind:
                    return ev.exit_code
        except TimeoutError:
            pass
        return None

    def _teardown(self, *, destroy: bool) -> Iterator[Check]:
        error = None
        if destroy:
            try:
                self.torn_down = True
                self.c.call(calls.destroy_bottle(self.name))
                self._wait_event("destroyed")
            except BottlenetError as e:
                error = f"{e.code}: {e.message}"
            yield judge_events(self.kinds)
        leftovers = self.c.call(calls.leftovers(self.name))
        yield judge_teardown(error, leftovers)


def _read_text(path: str) -> str | None:
    """The start of a file the guest wrote (a volume is the guest's ground: never a FIFO's
    block, a device or a link followed)."""
    from bottlenet.paths import open_regular

    try:
        fd = open_regular(path)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(256).decode("utf-8", "replace").strip()


def _write_new(path: str, text: str) -> None:
    """Write a new file into the guest's volume: never through a link or into a file the
    guest planted there first (``O_EXCL|O_NOFOLLOW``; that fails the round trip instead)."""
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
    except OSError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(text)


# -- the command ----------------------------------------------------------------------------


class SelftestFailed(BottlenetError):
    """At least one check failed (each says what was seen and the fix)."""

    code = "SELFTEST_FAILED"


def render(check: Check) -> str:
    line = f"{check.verdict:<4}  {check.step:<11}  {_clean(check.seen)}\n"
    if check.fix:
        line += f"{'':<4}  {'':<11}  fix: {_clean(check.fix)}\n"
    return line


def cmd_selftest(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    from bottlenet.errors import InvalidArgument

    a = inv.options
    base = json.loads(inv.spec_json) if inv.spec_json else None
    if base is None and not (a.agent_image and a.sidecar_image):
        raise InvalidArgument(
            "selftest needs --spec FILE.toml, or --agent-image and --sidecar-image"
        )
    for s in a.service or ():
        name, _, port = s.partition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"--service {s}: must be NAME:PORT (a port 1-65535)")
    # the options with the throwaway bottle's name (a copy: the parsed words stay as read)
    a = argparse.Namespace(**{**vars(a), "name": a.name or f"selftest-{os.urandom(3).hex()}"})
    checks: list[Check] = []
    for check in Run(c, a, base, c.path, inv.vm_timeout).checks():
        checks.append(check)
        if not inv.json:
            out.write(render(check))
            out.flush()
    failed = [ch for ch in checks if ch.verdict not in (Verdict.PASS, Verdict.WARN)]
    if inv.json:
        out.write(
            json.dumps(
                {"ok": not failed, "bottle": a.name, "checks": [ch._asdict() for ch in checks]},
                sort_keys=True,
            )
            + "\n"
        )
    if failed:
        raise SelftestFailed(
            f"{len(failed)} of {len(checks)} checks did not pass (first: {failed[0].step})"
        )


def register(sub: Any, add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``selftest`` to bottlenetctl's subcommands; ``add`` is cli.build_parser's helper."""
    sp = add(sub, "selftest", cmd_selftest, "check, on this host, that VM bottles work")
    sp.add_argument("--spec", metavar="FILE.toml", help="base the throwaway bottle on this spec")
    sp.add_argument("--agent-image", help="the agent image (without --spec)")
    sp.add_argument("--sidecar-image", help="the sidecar image (without --spec)")
    sp.add_argument(
        "--service",
        action="append",
        metavar="NAME:PORT",
        help="a sidecar service (without --spec; repeatable; default egress:3128)",
    )
    sp.add_argument("--name", help="the throwaway bottle's name (default selftest-<random>)")
    sp.add_argument(
        "--volume-dir",
        metavar="DIR",
        help="host directory for the read-write volume check (default: a new one"
        " under /var/tmp, removed after)",
    )
