"""``bottlenetctl``: the console client of the control socket (no reactor, blocking client).

Exit codes: 0 ok, 1 the daemon refused (``error: CODE: message``), 2 usage error,
3 the daemon cannot be reached. Tables for people, ``--json`` for scripts; never a traceback.

It starts at once: this module imports only the parser's needs; a command imports its client
when it runs. ``status``, ``ping``, ``bottle ls``, ``node info`` and ``bottle exec`` on a UNIX
socket use the light client (no Twisted); everything else the blocking client (AMP, TLS).

The words are parsed once, in :func:`main`, into an
:class:`~bottlenet.cli.invocation.Invocation`; each subcommand's parser names what runs it
(``set_defaults(run=...)``). A call's limit is its own pace (:mod:`bottlenet.control.calls`)
unless ``--timeout`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TextIO

from bottlenet import __version__
from bottlenet.cli import attach, down, selftest
from bottlenet.cli import node as node_cli
from bottlenet.cli import pool as pool_cli
from bottlenet.cli.invocation import ClientCommand, Handler, Invocation, every
from bottlenet.cli.output import EXIT_USAGE, usage_error, write_table
from bottlenet.cli.output import clean as _clean
from bottlenet.control import calls
from bottlenet.control.calls import DEFAULT_TIMEOUT, VM_TIMEOUT
from bottlenet.errors import BottlenetError, InvalidArgument

if TYPE_CHECKING:
    from bottlenet.control.address import TLSCredentials
    from bottlenet.control.blocking import BlockingControlClient
    from bottlenet.control.lightclient import LightControlClient
    from bottlenet.control.results import NodeInfoRecord

    #: The client of a ``light`` command: either (both run ``call`` and ``hello``).
    Client = BlockingControlClient | LightControlClient


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


def cmd_status(c: Client, inv: Invocation, out: TextIO) -> None:
    hello = c.hello()
    bottles = c.call(calls.count_bottles())  # a one-item page: only its total is read
    node = _node_info(c) if "node" in hello.features else None
    if inv.json:
        _json({"daemon": hello, "bottles": bottles, "control": c.path, "node": node}, out)
        return
    smolvm = hello.smolvm_version if hello.smolvm_available else "unavailable"
    if hello.smolvm_available and hello.smolvm_tested is False:
        smolvm = f"{smolvm} (untested: tested with {', '.join(hello.smolvm_tested_versions)})"
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
            ["guest kit", hello.guest_kit or "-"],
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


def _node_info(c: Client) -> NodeInfoRecord | None:
    """NodeInfo for ``status``; None from a daemon without the node contract."""
    try:
        return c.call(calls.node_info())
    except BottlenetError:
        return None


def cmd_ping(c: Client, inv: Invocation, out: TextIO) -> None:
    c.call(calls.ping())
    if inv.json:
        _json({"ok": True}, out)
    else:
        out.write("ok\n")


class SpecFileError(Exception):
    """The --spec file could not be read as TOML (reported as a usage error)."""


#: AMP carries a value of at most 65,535 bytes: the spec's JSON must fit in one.
MAX_SPEC_JSON = 0xFFFF


def in_spec_file(e: InvalidArgument, path: str | None, spec_json: str | None) -> InvalidArgument:
    """The daemon's refusal of a ``--spec`` key (``mode: ...``, ``agent.image: ...``) with the
    file's name in front, so the line says which file to fix; any other refusal as it is."""
    if path is None or spec_json is None:
        return e
    keys = json.loads(spec_json)
    key = e.message.split(":", 1)[0].split(".", 1)[0].split("[", 1)[0]
    if key not in keys:
        return e
    return InvalidArgument(f"--spec {path}: {e.message}")


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


def cmd_bottle_create(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    o = inv.options
    try:
        b = c.call(calls.create_bottle(o.name, o.alias, inv.spec_json, o.owner, o.lease, o.pool))
    except InvalidArgument as e:
        raise in_spec_file(e, o.spec, inv.spec_json) from None
    if inv.json:
        _json(b, out)
        return
    if b.mode:
        write_table(["FIELD", "VALUE"], _bottle_rows(b), out)
    else:
        out.write(f"created {_clean(b.name)} on {_clean(b.alias)}\n")
    if b.capability is not None and b.capability != inv.capability:
        out.write(
            f"capability {_clean(b.capability)}: give it as BOTTLENET_CAPABILITY to this "
            "bottle's later commands (it is the only way to reach it)\n"
        )


def cmd_bottle_renew(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    o = inv.options
    b = c.call(calls.renew_lease(o.name, o.seconds))
    if inv.json:
        _json(b, out)
    else:
        out.write(f"{_clean(b.name)}: lease renewed for {o.seconds:g}s\n")


def cmd_bottle_verify(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    b, result = c.call(calls.verify_bottle(inv.options.name))
    if inv.json:
        _json({"bottle": b, "result": result}, out)
    else:
        out.write(f"{_clean(b.name)}: isolation probe {_clean(result)}\n")


def cmd_egress_set(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    name = inv.options.name
    hosts = c.call(calls.set_egress_policy(name, list(inv.options.hosts)))
    if inv.json:
        _json({"bottle": name, "allow_hosts": hosts}, out)
    else:
        out.write(f"{name}: egress allows {len(hosts)} host(s)\n")


def cmd_bottle_rm(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    name = inv.options.name
    c.call(calls.destroy_bottle(name))
    if inv.json:
        _json({"destroyed": name}, out)
    else:
        out.write(f"destroyed {name}\n")


def cmd_bottle_ls(c: Client, inv: Invocation, out: TextIO) -> None:
    bottles = list(every(c, calls.list_bottles))
    if inv.json:
        _json(bottles, out)
        return
    rows = [[b.name, b.alias or "-", b.source, b.state, b.forwards] for b in bottles]
    write_table(["NAME", "ALIAS", "SOURCE", "STATE", "FORWARDS"], rows, out)


def cmd_bottle_status(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    name = inv.options.name
    b = c.call(calls.bottle_status(name))
    forwards = list(every(c, lambda o: calls.list_forwards(name, o)))
    if inv.json:
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


def cmd_forward_add(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    o = inv.options
    ep = c.call(calls.add_forward(o.bottle, o.label, o.to, o.port))
    if inv.json:
        _json(ep, out)
    else:
        out.write(_clean(ep.describe()) + "\n")


def cmd_forward_rm(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    o = inv.options
    c.call(calls.remove_forward(o.bottle, o.label))
    if inv.json:
        _json({"removed": f"{o.bottle}/{o.label}"}, out)
    else:
        out.write(f"removed {o.bottle}/{o.label}\n")


def cmd_forward_ls(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    bottle = inv.options.bottle
    forwards = list(every(c, lambda o: calls.list_forwards(bottle, o)))
    if inv.json:
        _json(forwards, out)
        return
    rows = [[f.bottle, f.label, f.endpoint, f.target] for f in forwards]
    write_table(["BOTTLE", "LABEL", "ENDPOINT", "TARGET"], rows, out)


def cmd_stats(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    bottle = inv.options.bottle
    stats = list(every(c, lambda o: calls.stats(bottle, o)))
    if inv.json:
        _json(stats, out)
        return
    rows = [
        [s.bottle, s.label, s.accepted, s.active, s.refused, s.failed, s.bytes_in, s.bytes_out]
        for s in stats
    ]
    headers = ["BOTTLE", "LABEL", "ACCEPTED", "ACTIVE", "REFUSED", "FAILED", "IN", "OUT"]
    write_table(headers, rows, out)


def cmd_events(c: BlockingControlClient, inv: Invocation, out: TextIO) -> None:
    """Print bottle events as they happen, one per line (until Ctrl-C, or ``--count``)."""
    seen = 0
    count = inv.options.count
    for ev in c.events(inv.options.bottle):
        if inv.json:
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
        if count is not None and seen >= count:
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


class AddCommand(Protocol):
    """``add(parent, name, handler, help)``: a subcommand that runs ``handler`` with a client
    (``light``: the light client may, on a UNIX socket)."""

    def __call__(
        self, parent: Any, name: str, handler: Handler, help: str, *, light: bool = False
    ) -> argparse.ArgumentParser: ...


def _add_command(
    parent: Any,
    name: str,
    handler: Handler,
    help: str,
    *,
    json_flag: argparse.ArgumentParser,
    light: bool = False,
) -> argparse.ArgumentParser:
    """A subcommand that runs ``handler`` with a client (the light one if ``light``)."""
    sp: argparse.ArgumentParser = parent.add_parser(name, help=help, parents=[json_flag])
    sp.set_defaults(run=ClientCommand(handler, light))
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
    )
    # before or after the command word: here False unless given, a command's own if given
    p.add_argument("--json", action="store_true", help="machine-readable output")
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
    p.set_defaults(spec=None)  # only bottle create and selftest take --spec
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add: AddCommand = partial(_add_command, json_flag=json_flag)
    add(
        sub,
        "status",
        cmd_status,
        "daemon version, protocol, smolvm, bottle count, draining",
        light=True,
    )
    add(sub, "ping", cmd_ping, "check that the daemon answers", light=True)
    _add_bottle_commands(sub, add, json_flag, command)
    _add_forward_commands(sub, add, command)
    add(sub, "stats", cmd_stats, "per-forward counters").add_argument("bottle", nargs="?")
    sp = add(sub, "events", cmd_events, "print bottle events as they happen, one per line")
    sp.add_argument("--bottle", help="only this bottle's events")
    sp.add_argument("--count", type=_count, help="exit after this many events (1 or more)")
    _add_top(sub, json_flag)
    down.register(sub, add)
    node_cli.register(sub, add)
    pool_cli.register(sub, add)
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
    sp.add_argument(
        "--pool",
        choices=("auto", "off", "only"),
        help="take a warm pool's bottle of this spec when one is ready (auto, the default), "
        "never (off), or refuse when none is (only)",
    )
    sp = add(bottle, "renew", cmd_bottle_renew, "renew a bottle's lease")
    sp.add_argument("name")
    sp.add_argument("seconds", type=node_cli.seconds, help="the new lease, from now")
    add(bottle, "rm", cmd_bottle_rm, "destroy a bottle and its forwards").add_argument("name")
    add(bottle, "ls", cmd_bottle_ls, "list bottles", light=True)
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
    sp.set_defaults(run=_run_top)


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


def _run_top(inv: Invocation, out: TextIO, err: TextIO) -> int:
    """``top`` runs its own connection loop (module :mod:`bottlenet.cli.top`)."""
    from bottlenet.cli import top

    return top.run(inv, out, err)


class UsageError(Exception):
    """A bad invocation seen after parsing (exit 2, as the parser's own errors)."""


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
    words, after_dashes = attach.split_command(list(sys.argv[1:] if argv is None else argv))
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
    try:
        inv = invocation(args, after_dashes, environ)._replace(words=tuple(words))
    except UsageError as e:
        return usage_error(err, str(e), as_json=args.json)
    return inv.run(inv, out, err)


def invocation(
    args: argparse.Namespace, after_dashes: Sequence[str] | None, env: dict[str, str]
) -> Invocation:
    """The parsed words as one value; a :class:`UsageError` for what the parser cannot see
    (the control address and its TLS files, ``--timeout`` not positive, a bad ``--spec``)."""
    control = args.control or default_control(env)
    from bottlenet.control.address import parse_control_address

    try:
        tls = _tls_credentials(args, env) if control.startswith("tls:") else None
        parse_control_address(control)
    except BottlenetError as e:
        raise UsageError(e.message) from None
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    try:  # read before the daemon is contacted: a bad file is a usage error
        spec_json = read_spec(args.spec) if args.spec else None
    except SpecFileError as e:
        raise UsageError(str(e)) from None
    return Invocation(
        run=args.run,
        options=args,
        path=control if control.startswith("tls:") else _socket_path(control),
        tls=tls,
        timeout=args.timeout,
        json=args.json,
        spec_json=spec_json,
        after_dashes=tuple(after_dashes or ()),
        capability=env.get("BOTTLENET_CAPABILITY") or None,
    )


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
