#!/usr/bin/env python3
"""An example launcher: one VM bottle for one agent session, with nothing left behind.

It creates a socket-mode VM bottle from a typed spec, prints the agent's stamped environment,
runs a command in the agent VM (an interactive shell on your terminal by default, or
``--command`` without a terminal), and destroys the bottle when the command ends, on Ctrl-C
and on SIGTERM. It exits with the command's exit code.

    python examples/launcher.py --agent-image /var/lib/bottles/agent.tar \\
        --sidecar-image registry.example/bottle-sidecar:1
    python examples/launcher.py ... --command 'echo "$HTTPS_PROXY"; id -u'

Plain Python and the blocking client: no reactor. ``--control`` takes a socket path or
``tls:HOST:PORT`` (then set BOTTLENET_CONTROL_CERT, _KEY and _CA).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys

from bottlenet.control.blocking import BlockingControlClient, ControlConnectionError
from bottlenet.control.specbuilder import Agent, BottleSpec, Service, Sidecar
from bottlenet.control.terminal import forward_winch, raw_terminal, terminal_size
from bottlenet.errors import BottlenetError, NotFound


def build_spec(args: argparse.Namespace) -> BottleSpec:
    return BottleSpec(
        mode="socket",
        sidecar=Sidecar(
            image=args.sidecar_image,
            services=[
                Service("egress", 3128, env=["HTTPS_PROXY=http://{host}:{port}"]),
                Service("git", 9418, env=["GIT_GATE_URL=http://{host}:{port}/"]),
            ],
        ),
        agent=Agent(image=args.agent_image, env=["LANG=C.UTF-8"]),
    )


def run_command(client: BlockingControlClient, name: str, args: argparse.Namespace) -> int:
    if args.command is not None:  # no terminal: stdout/stderr stream to ours
        return client.exec(
            name,
            ["/bin/sh", "-c", args.command],
            stdout=sys.stdout.buffer,
            stderr=sys.stderr.buffer,
        )
    fd = sys.stdin.fileno()
    tty = os.isatty(fd)
    session = client.open_exec(
        name, ["/bin/sh"], stdin=True, tty=tty, size=terminal_size(fd) if tty else None
    )
    with session, raw_terminal(fd if tty else None), forward_winch(session, fd if tty else None):
        return session.run(sys.stdin.buffer, sys.stdout.buffer, sys.stderr.buffer)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--control", default=os.environ.get("BOTTLENET_CONTROL"), required=False)
    p.add_argument("--agent-image", required=True)
    p.add_argument("--sidecar-image", required=True)
    p.add_argument("--name", default=f"launch-{secrets.token_hex(3)}")
    p.add_argument("--command", help="run this (sh -c) without a terminal instead of a shell")
    args = p.parse_args(argv)
    if not args.control:
        p.error("--control (or $BOTTLENET_CONTROL) is required")
    spec = build_spec(args)  # a bad value fails here, before the daemon is asked anything

    def terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    client = BlockingControlClient(args.control)
    created = False
    try:
        with client:
            bottle = client.create_bottle(args.name, spec=spec.to_json())
            created = True
            print(f"bottle {bottle.name}: {bottle.state}, {bottle.isolation}", flush=True)
            for key, value in sorted(bottle.env.items()):
                print(f"  {key}={value}", flush=True)
            return run_command(client, bottle.name, args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (BottlenetError, ControlConnectionError) as e:
        print(f"launcher: {e}", file=sys.stderr)
        return 1
    finally:
        if created:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cleanup is not interrupted
            try:
                with BlockingControlClient(args.control) as c:
                    c.destroy_bottle(args.name)
                print(f"bottle {args.name} destroyed", file=sys.stderr, flush=True)
            except NotFound:
                pass
            except (BottlenetError, ControlConnectionError) as e:
                print(f"launcher: could not destroy {args.name}: {e}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
