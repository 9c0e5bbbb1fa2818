"""``bottlenetctl``: the console client of the control socket (no reactor, blocking client).

Exit codes: 0 ok, 1 the daemon refused (``error: CODE: message``), 2 usage error,
3 the daemon cannot be reached. Tables for people, ``--json`` for scripts; never a traceback.

It starts at once: this module imports only the parser's needs; a command imports its client
when it runs. ``status``, ``ping`` and ``bottle ls`` on a UNIX socket use the light client
(no Twisted); everything else the blocking client (AMP, TLS).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from bottlenet import __version__
from bottlenet.cli import attach, down, selftest
from bottlenet.cli import node as node_cli
from bottlenet.cli.output import (
    EXIT_DAEMON,
    EXIT_OK,
    EXIT_USAGE,
    report_control_error,
    usage_error,
    write_error,
    write_table,
)
from bottlenet.cli.output import clean as _clean
from bottlenet.control.calls import DEFAULT_TIMEOUT, VM_TIMEOUT, count_bottles, is_slow
from bottlenet.control.clienterrors import ControlConnectionError
from bottlenet.errors import BottlenetError, InvalidArgument

if TYPE_CHECKING:
    from bottlenet.control.address import TLSCredentials
    from bottlenet.control.blocking import BlockingControlClient
    from bottlenet.control.results import NodeInfoRecord


def default_control(env: os._Environ[str] | dict[str, str]) -> str:
    """``$BOTTLENET_CONTROL``, else the daemon's own default path rule."""
    explicit = env.get("BOTTLENET_CONTROL")
    if explicit:
        return explicit
    from bottlenet.paths import default_control_path, default_state_dir

    return default_control_path(env, default_state_dir(env))


def _socket_path(control: str) -> str:
    return control[len("unix:") :] if control.startswith("unix:") else control


def _plain(value: Any) -> Any:
    """``value`` with client-side ``NamedTuple`` results as objects (json would write lists)."""
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _json(value: Any, out: TextIO) -> None:
    def default(o: Any) -> Any:
        import attrs  # only the daemon's records need it (status and ping never get here)

        if attrs.has(type(o)):
            return attrs.asdict(o)
        raise TypeError(type(o).__name__)

    out.write(json.dumps(_plain(value), default=default, sort_keys=True) + "\n")


#: A command: the client is a BlockingControlClient, or for :data:`LIGHT_HANDLERS` the
#: LightControlClient (the same method names for the calls they make).
Handler = Callable[[Any, argparse.Namespace, TextIO], None]


def cmd_status(c: BlockingControlClient, a: argparse.Namespace, out: TextIO) -> None:
    hello = c.hello()
    bottles = c.call(count_bottles())  # a one-item page: only its total is read
    node = _node_info(c) if "node" in hello.features else None
    if a.json:
        _json({"daemon": hello, "bottles": bottles, "control": c.path, "node": node}, out)
        return
    smolvm = hello.smolvm_version if hello.smolvm_available else "unavailable"
    node_rows = [] if node is None else node_cli.node_rows(node)[:3]  # host, draining, health
    write_table(
        ["FIELD", "VALUE"],
        [
            ["daemon", hello.server_version],
            ["protocol", hello.protocol],
            ["features", ",".join(hello.features)],
            ["smolvm", smolvm],
            ["smolvm from", hello.smolvm_source or "-"],
            ["VM uids", _vm_uids_row(hello.vm_uids, hello.vm_uids_basis)],
            ["bottles", bottles],
            ["control", c.path],
            *node_rows,
        ],
        out,
    )


def _vm_uids_row(model: str | None, basis: str | None) -> str:
    """``per-VM uids (seen: ...)``: the model and what it rests on (an older daemon: none)."""
    if model is None:
        return "-"
    return f"{model} ({basis})" if basis else model


def _node_info(c: BlockingControlClient) -> NodeInfoRecord | None:
    """NodeInfo for ``status``; None from a daemon without the node contract."""
    try:
        return c.node_info()
    except BottlenetError:
        return None


def cmd_ping(c: BlockingControlClient, a: argparse.Namespace, out: TextIO) -> None:
    c.ping()
    if a.json:
        _json({"ok": True}, out)
    else:
        out.write("ok\n")


class SpecFileError(Exception):
    """The --spec file could not be read as TOML (reported as a usage error)."""


#: AMP carries a value of at most 65,535 bytes: the spec's JSON must fit in one.
MAX_SPEC_JSON = 0xFFFF


def read_spec(path: str) -> str:
    """Read a TOML bottle spec and return it as JSON text for CreateBottle.

    Every way a file can be unusable is one line (a usage error), never a traceback."""
    import tomllib

    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_JSON * 4 + 1)  # far more than any spec that fits
    except OSError as e:
        raise SpecFileError(f"--spec {path}: {e.strerror}") from None
    if len(raw) > MAX_SPEC_JSON * 4:
        raise SpecFileError(f"--spec {path}: larger than {MAX_SPEC_JSON * 4} bytes")
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
        text = json.dumps(doc, separators=(",", ":"), default=str)
    except UnicodeDecodeError:
        raise SpecFileError(f"--spec {path}: not valid UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecFileError(f"--spec {path}: not valid TOML: {e}") from None
    except RecursionError:
        raise SpecFileError(f"--spec {path}: nested too deeply") from None
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_JSON:
        raise SpecFileError(
            f"--spec {path}: the spec is {size} bytes as JSON; the control protocol carries"
            f" at most {MAX_SPEC_JSON} bytes"
        )
    return text


def _bottle_rows(b: Any) -> list[list[object]]:
    rows: list[list[object]] = [
        ["name", b.name],
        ["alias", b.alias or "-"],
        ["source", b.source],
        ["state", b.state],
    ]
    if b.detail:
        rows.append(["detail", b.detail])
    if b.owner:
        rows.append(["owner", b.owner])
    if b.lease_seconds is not None:
        rows.append(["lease", f"{b.lease_seconds:g}s, runs out at {b.lease_expires_at:.0f}"])
    if b.bridge:
        rows.append(["bridge", b.bridge])
    if b.workload:
        code = b.workload_exit_code
        rows.append(["workload", b.workload if code is None else f"{b.workload} (code {code})"])
    if b.mode:
        rows += [
            ["mode", b.mode],
            ["isolation", b.isolation or "-"],
            ["isolation probe", b.probe or "-"],
            ["sidecar vm", b.sidecar_vm or "-"],
            ["agent vm", b.agent_vm or "-"],
            ["egress", " ".join(b.policy) if b.policy else "(deny all)"],
        ]
        rows += [[f"endpoint {e.service}", e.endpoint] for e in b.endpoints]
        rows += [[f"env {k}", v] for k, v in sorted(b.env.items())]
    rows += [["WARNING", w] for w in b.warnings]
    return rows


def cmd_bottle_create(c: BlockingControlClient, a: argparse.Namespace, out: TextIO) -> None:
    b = c.create_bottle(
        a.name, alias=a.alias, spec=a.spec_json, owner=a.owner, lease_seconds=a.lease
    )
    if a.json:
        _json(b, out)
    elif b.mode:
        write_table(["FIELD", "VALUE"], _bottle_rows(b), out)
    else:
        out.write(f"created {_clean(b.name)} on {_clean(b.alias)}\n")


def cmd_bottle_renew(c: BlockingControlClient, a: argparse.Namespace, out: TextIO) -> None:
    b = c.renew_lease(a.name, a.seconds)
    if a.json:
        _json(b, out)
    else:
        out.write(f"{_clean(b.name)}: lease renewed for {a.seconds:g}s\n")


def cmd_bottle_verify(c: BlockingControlClient, a: argparse.Namespace, out: TextIO) -> None:
    b, result = c.verify_bottle(a.name)
    if a.json:
        _json({"bottle": b, "result": result}, out)
    else:
        out.write(f"{_clean(b.name)}: isolation probe {_clean(result)}\n")


def cmd_egress_set(c: BlockingControlClient, a: argparse.Namespace, out: TextIO) -> None:
    hosts = c.set_egress_policy(a.name, list(a.hosts))
    if a.json:
        _json({"bottle": a.name, "allow_hosts": hosts}, out)
    else:
        out.write(f"{a.name}: egress allows {len(hosts)} host(s)\n")


def cmd_bottle_rm(c: BlockingControlClient, a: argparse.Namespace, out: TextIO) -> None:
    c.destroy_bottle(a.name)
    if a.json:
        _json({"destroyed": a.name}, out)
    else:
        out.write(f"destroyed {a.name}\n")


def cmd_bottle_ls(c: BlockingControlClient, a: argparse.Namespace, out: TextIO) -> None:
    bottles = list(c.all_bottles())
    if a.json:
        _json(bottles, out)
        return
    rows = [[b.name, b.alias or "-", b.source, b.state, b.forwards] for b in bottles]
    write_table(["NAME", "ALIAS", "SOURCE", "STATE", "FORWARDS"], rows, out)


def cmd_bottle_status(c: BlockingControlClient, a: argparse.Namespace, out: TextIO) -> None:
    b = c.bottle_status(a.name)
    forwards = list(c.all_forwards(a.name))
    if a.json:
        _json({"bottle": b, "forwards": forwards}, out)
        return
    write_table(["FIELD", "VALUE"], _bottle_rows(b), out)
    if forwards:
        out.write("\n")
        write_table(
            ["LABEL", "ENDPOINT", "TARGET"],
            [[f.label, f.endpoint, f.target] for f in forwards],
            out,
        )


def cmd_forward_add(c: BlockingControlClient, a: argparse.Namespace, out: TextIO) -> None:
    ep = c.add_forward(a.bottle, a.label, a.to, port=a.port)
    if a.json:
        _json(ep, out)
    else:
        out.write(_clean(ep.describe()) + "\n")


def cmd_forward_rm(c: BlockingControlClient, a: argparse.Namespace, out: TextIO) -> None:
    c.remove_forward(a.bottle, a.label)
    if a.json:
        _json({"removed": f"{a.bottle}/{a.label}"}, out)
    else:
        out.write(f"removed {a.bottle}/{a.label}\n")


def cmd_forward_ls(c: BlockingControlClient, a: argparse.Namespace, out: TextIO) -> None:
    forwards = list(c.all_forwards(a.bottle))
    if a.json:
        _json(forwards, out)
        return
    rows = [[f.bottle, f.label, f.endpoint, f.target] for f in forwards]
    write_table(["BOTTLE", "LABEL", "ENDPOINT", "TARGET"], rows, out)


def cmd_stats(c: BlockingControlClient, a: argparse.Namespace, out: TextIO) -> None:
    stats = list(c.all_stats(a.bottle))
    if a.json:
        _json(stats, out)
        return
    rows = [
        [s.bottle, s.label, s.accepted, s.active, s.refused, s.failed, s.bytes_in, s.bytes_out]
        for s in stats
    ]
    headers = ["BOTTLE", "LABEL", "ACCEPTED", "ACTIVE", "REFUSED", "FAILED", "IN", "OUT"]
    write_table(headers, rows, out)


def cmd_events(c: BlockingControlClient, a: argparse.Namespace, out: TextIO) -> None:
    """Print bottle events as they happen, one per line (until Ctrl-C, or ``--count``)."""
    seen = 0
    for ev in c.events(a.bottle):
        if a.json:
            _json(ev, out)
        else:
            extra = [f"state={ev.state}"] if ev.state else []
            if ev.exit_code is not None:
                extra.append(f"exit={ev.exit_code}")
            if ev.detail:
                extra.append(f"detail={ev.detail}")
            out.write(_clean(f"{ev.seq} {ev.kind} {ev.bottle} {' '.join(extra)}".rstrip()) + "\n")
        out.flush()
        seen += 1
        if a.count is not None and seen >= a.count:
            return


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError("must be a number of events, 1 or more")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError("must be a port number 0-65535")
    return int(text)


class ArgumentError(Exception):
    """A usage error found by the parser; ``main`` reports it (as JSON under ``--json``)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


def _terminal_columns() -> int:
    """What ``shutil.get_terminal_size`` answers: ``$COLUMNS``, else stdout's terminal, else 80."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


def _formatter(prog: str) -> argparse.HelpFormatter:
    """argparse's formatter with the width given (as argparse computes it), so argparse does
    not import ``shutil`` (and through it ``bz2`` and ``lzma``) for every argument added."""
    return argparse.HelpFormatter(prog, width=_terminal_columns() - 2)


class _Parser(argparse.ArgumentParser):
    """argparse that raises its usage errors instead of printing them and exiting."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise ArgumentError(self, message)


#: ``add(parent, name, handler, help)``: a subcommand that runs ``handler`` with a client.
AddCommand = Callable[[Any, str, Handler, str], argparse.ArgumentParser]


def _add_command(
    parent: Any, name: str, handler: Handler, help: str, *, json_flag: argparse.ArgumentParser
) -> argparse.ArgumentParser:
    sp: argparse.ArgumentParser = parent.add_parser(name, help=help, parents=[json_flag])
    sp.set_defaults(handler=handler)
    return sp


#: The global options that take a value (``build_parser`` declares them).
VALUE_OPTIONS = ("--control", "--cert", "--key", "--ca", "--timeout")


def command_word(words: Sequence[str]) -> str | None:
    """The subcommand named in ``words``: the first word that is neither an option nor the
    value of a global one (as argparse reads it, abbreviations included); None if there is none."""
    rest = iter(words)
    for word in rest:
        if (
            word.startswith("--")
            and "=" not in word
            and any(option.startswith(word) for option in VALUE_OPTIONS)
        ):
            next(rest, None)
        elif not word.startswith("-"):
            return word
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """bottlenetctl's parser; given the ``command`` word, the actions of the other command
    groups (``bottle``, ``egress``, ``forward``) are left out: a parser per action costs
    start-up time, and the words cannot reach them."""
    json_flag = _Parser(add_help=False)
    json_flag.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    p = _Parser(
        prog="bottlenetctl",
        description="Control a running bottlenet daemon over its control socket.",
        parents=[json_flag],
    )
    p.add_argument("--version", action="version", version=f"bottlenetctl {__version__}")
    p.add_argument(
        "--control",
        metavar="PATH|tls:HOST:PORT",
        help="control socket (default: $BOTTLENET_CONTROL, else"
        " $XDG_RUNTIME_DIR/bottlenet/control.sock, else <state-dir>/control.sock), or a"
        " daemon's TLS listener (with --cert/--key/--ca)",
    )
    p.add_argument("--cert", metavar="PEM", help="TLS control: this client's certificate")
    p.add_argument("--key", metavar="PEM", help="TLS control: this client's private key")
    p.add_argument("--ca", metavar="PEM", help="TLS control: the CA that signed the daemon's")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"seconds per call (default {DEFAULT_TIMEOUT:g}; {VM_TIMEOUT:g} for calls that may"
        " start or stop VMs: bottle create --spec, bottle rm, bottle verify, egress set, down)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add: AddCommand = partial(_add_command, json_flag=json_flag)
    add(sub, "status", cmd_status, "daemon version, protocol, smolvm, bottle count, draining")
    add(sub, "ping", cmd_ping, "check that the daemon answers")
    _add_bottle_commands(sub, add, json_flag, command)
    _add_forward_commands(sub, add, command)
    add(sub, "stats", cmd_stats, "per-forward counters").add_argument("bottle", nargs="?")
    sp = add(sub, "events", cmd_events, "print bottle events as they happen, one per line")
    sp.add_argument("--bottle", help="only this bottle's events")
    sp.add_argument("--count", type=_count, help="exit after this many events (1 or more)")
    _add_top(sub, json_flag)
    down.register(sub, add)
    node_cli.register(sub, add)
    selftest.register(sub, add)
    return p


def _add_bottle_commands(
    sub: Any, add: AddCommand, json_flag: argparse.ArgumentParser, command: str | None
) -> None:
    """``bottle ...`` (with exec, shell and logs) and ``egress set``."""
    bottle = sub.add_parser("bottle", help="create, remove, list bottles").add_subparsers(
        dest="bottle_command", required=True, metavar="ACTION"
    )
    egress = sub.add_parser("egress", help="egress policy of a bottle's sidecar").add_subparsers(
        dest="egress_command", required=True, metavar="ACTION"
    )
    if command in (None, "egress"):
        sp = add(egress, "set", cmd_egress_set, "replace the allow-list (no hosts: deny all)")
        sp.add_argument("name")
        sp.add_argument("hosts", nargs="*", metavar="HOST")
    if command not in (None, "bottle"):
        return
    sp = add(bottle, "create", cmd_bottle_create, "create a bottle (with VMs given --spec)")
    sp.add_argument("name")
    sp.add_argument("--alias", help="alias from the pool (default: the lowest free one)")
    sp.add_argument("--spec", metavar="FILE.toml", help="bottle spec: sidecar and agent VMs")
    sp.add_argument("--owner", help="an owner label recorded with the bottle")
    sp.add_argument(
        "--lease",
        type=node_cli.seconds,
        metavar="SECONDS",
        help="the daemon destroys the bottle unless its lease is renewed within this long"
        " (plus the daemon's --lease-grace)",
    )
    sp = add(bottle, "renew", cmd_bottle_renew, "renew a bottle's lease")
    sp.add_argument("name")
    sp.add_argument("seconds", type=node_cli.seconds, help="the new lease, from now")
    add(bottle, "rm", cmd_bottle_rm, "destroy a bottle and its forwards").add_argument("name")
    add(bottle, "ls", cmd_bottle_ls, "list bottles")
    add(bottle, "status", cmd_bottle_status, "one bottle and its forwards").add_argument("name")
    add(bottle, "verify", cmd_bottle_verify, "run the isolation probe again").add_argument("name")
    attach.register(bottle, json_flag)


def _add_forward_commands(sub: Any, add: AddCommand, command: str | None) -> None:
    """``forward add``, ``forward rm`` and ``forward ls``."""
    forward = sub.add_parser("forward", help="add, remove, list forwards").add_subparsers(
        dest="forward_command", required=True, metavar="ACTION"
    )
    if command not in (None, "forward"):
        return
    sp = add(forward, "add", cmd_forward_add, "add a forward; prints the agent endpoint")
    sp.add_argument("bottle")
    sp.add_argument("label")
    sp.add_argument("--to", required=True, metavar="HOST:PORT", help="loopback target")
    sp.add_argument("--port", type=_port, default=0, help="agent-side port (0: any free one)")
    sp = add(forward, "rm", cmd_forward_rm, "remove a forward")
    sp.add_argument("bottle")
    sp.add_argument("label")
    add(forward, "ls", cmd_forward_ls, "list forwards").add_argument("bottle", nargs="?")


def _add_top(sub: Any, json_flag: argparse.ArgumentParser) -> None:
    """``top``: a subcommand with a connection loop of its own (no handler)."""
    sp = sub.add_parser(
        "top",
        help="live view of bottles, forwards, relays and throughput",
        parents=[json_flag],
        description="Redraws every --interval seconds; Ctrl-C quits. Throughput is the"
        " difference of two Stats snapshots (in: agent to target, out: target to agent).",
    )
    sp.add_argument(
        "--interval",
        type=_interval,
        default=DEFAULT_INTERVAL,
        metavar="SECONDS",
        help=f"refresh period (default {DEFAULT_INTERVAL:g})",
    )
    sp.add_argument(
        "--once",
        action="store_true",
        help="print one frame (rates over one interval) and exit; exit 3 if unreachable",
    )
    sp.set_defaults(standalone=_run_top)


DEFAULT_INTERVAL = 1.0
MIN_INTERVAL = 0.05


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number of seconds") from None
    if not MIN_INTERVAL <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be between {MIN_INTERVAL} and 3600 seconds")
    return value


def _run_top(args: argparse.Namespace, path: str, out: TextIO, err: TextIO) -> int:
    """``top`` runs its own connection loop (module :mod:`bottlenet.cli.top`)."""
    from bottlenet.cli import top

    return top.run(args, path, out, err)


#: The call that sets each handler's default timeout (``calls.is_slow`` of it with the
#: handler's arguments: ``bottle create`` is slow only with ``--spec``).
HANDLER_CALLS: dict[Handler, str] = {
    cmd_status: "Hello",
    cmd_ping: "Ping",
    cmd_bottle_create: "CreateBottle",
    cmd_bottle_rm: "DestroyBottle",
    cmd_bottle_ls: "ListBottles",
    cmd_bottle_status: "BottleStatus",
    cmd_bottle_verify: "VerifyBottle",
    cmd_bottle_renew: "RenewLease",
    cmd_egress_set: "SetEgressPolicy",
    cmd_forward_add: "AddForward",
    cmd_forward_rm: "RemoveForward",
    cmd_forward_ls: "ListForwards",
    cmd_stats: "Stats",
    cmd_events: "Watch",  # events then wait without limit
    down.cmd_down: "DestroyBottle",
    node_cli.cmd_node_info: "NodeInfo",
    node_cli.cmd_node_drain: "Drain",
    node_cli.cmd_node_undrain: "Undrain",
    selftest.cmd_selftest: "Leftovers",  # every call of it may wait on VMs
}


def _default_timeout(args: argparse.Namespace) -> float:
    """The timeout of a command run without ``--timeout``: its call's."""
    handler = getattr(args, "handler", None)  # None: top, its own loop of quick calls
    command = HANDLER_CALLS[handler] if handler is not None else "Stats"
    return VM_TIMEOUT if is_slow(command, vars(args)) else DEFAULT_TIMEOUT


def main(
    argv: Sequence[str] | None = None,
    *,
    env: dict[str, str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    environ = dict(os.environ) if env is None else env
    words, command = attach.split_command(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser(command_word(words))
    as_json = "--json" in words  # known before parsing, so even a usage error is JSON
    try:
        args = parser.parse_args(words)
    except ArgumentError as e:
        if not as_json:
            e.parser.print_usage(err)
        return usage_error(err, e.message, as_json=as_json, prog=e.parser.prog)
    except SystemExit as e:  # --help, --version
        return int(e.code or 0) if isinstance(e.code, int) else EXIT_USAGE
    args.command_after_dashes = command
    args.json = getattr(args, "json", False)
    control = args.control or default_control(environ)
    path = _socket_path(control) if not control.startswith("tls:") else control
    from bottlenet.control.address import parse_control_address

    try:
        args.tls = _tls_credentials(args, environ) if control.startswith("tls:") else None
        parse_control_address(control)
    except BottlenetError as e:
        return usage_error(err, e.message, as_json=args.json)
    explicit_timeout = args.timeout

    def connect() -> BlockingControlClient:
        from bottlenet.control.blocking import BlockingControlClient

        vm = explicit_timeout if explicit_timeout is not None else VM_TIMEOUT
        return BlockingControlClient(path, timeout=args.timeout, vm_timeout=vm, tls=args.tls)

    if getattr(args, "logs", False):
        args.timeout = explicit_timeout or VM_TIMEOUT
        return attach.run_logs(connect, args, err)
    if getattr(args, "attached", False):
        problem = attach.prepare(args)
        if problem is not None:
            return usage_error(err, problem, as_json=args.json)
        if explicit_timeout is not None and explicit_timeout <= 0:
            return usage_error(err, "--timeout must be positive", as_json=args.json)
        args.timeout = explicit_timeout or VM_TIMEOUT
        return attach.run_exec(partial(_exec_client, path, args, connect), args, err)
    if args.timeout is None:
        args.timeout = _default_timeout(args)
    if args.timeout <= 0:
        return usage_error(err, "--timeout must be positive", as_json=args.json)
    standalone = getattr(args, "standalone", None)
    if standalone is not None:  # a subcommand that runs its own connection loop (top)
        return int(standalone(args, path, out, err))
    try:  # the spec file is read before the daemon is contacted: a bad file is a usage error
        args.spec_json = read_spec(args.spec) if getattr(args, "spec", None) else None
    except SpecFileError as e:
        return usage_error(err, str(e), as_json=args.json)
    try:
        with _client_for(args.handler, path, args, connect) as client:
            args.handler(client, args, out)
    except (ControlConnectionError, BottlenetError) as e:
        return report_control_error(e, path, err, as_json=args.json)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # never a traceback for a person at a terminal
        message = f"bottlenetctl failed: {type(e).__name__}"
        write_error(err, "INTERNAL", message, as_json=args.json)
        return EXIT_DAEMON
    return EXIT_OK


LIGHT_HANDLERS: frozenset[Handler] = frozenset(
    {cmd_status, cmd_ping, cmd_bottle_ls, node_cli.cmd_node_info}
)


def _client_for(
    handler: Handler,
    path: str,
    args: argparse.Namespace,
    connect: Callable[[], BlockingControlClient],
) -> Any:
    """The light client for the simple calls on a UNIX socket, else the blocking one."""
    if handler in LIGHT_HANDLERS and args.tls is None:
        from bottlenet.control.lightclient import LightControlClient

        return LightControlClient(path, args.timeout)
    return connect()


def _exec_client(
    path: str, args: argparse.Namespace, connect: Callable[[], BlockingControlClient]
) -> Any:
    """``bottle exec`` on a UNIX socket: the light client (no AMP import), else blocking."""
    if args.tls is None:
        from bottlenet.control.lightclient import LightControlClient

        return LightControlClient(path, args.timeout)
    return connect()


def _tls_credentials(args: argparse.Namespace, env: dict[str, str]) -> TLSCredentials:
    """``--cert/--key/--ca``, else ``BOTTLENET_CONTROL_CERT/_KEY/_CA``."""
    given = [args.cert, args.key, args.ca]
    if any(given):
        if not all(given):
            raise InvalidArgument("--cert, --key and --ca go together")
        from bottlenet.control.address import TLSCredentials

        return TLSCredentials(args.cert, args.key, args.ca)
    from bottlenet.control.address import TLSCredentials

    creds = TLSCredentials.from_env(env)
    if creds is None:
        raise InvalidArgument(
            "--control tls:HOST:PORT needs --cert, --key and --ca (or BOTTLENET_CONTROL_CERT,"
            " BOTTLENET_CONTROL_KEY and BOTTLENET_CONTROL_CA)"
        )
    return creds


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
